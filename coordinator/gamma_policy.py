"""How many tokens to draft each round (gamma), per session.

The cost model picks the gamma that maximises expected tokens per second of the session:

    rate(g) = E[tokens | g] / (draft(g) + verify((sessions in the batch) * (g + 1)) + overhead)
    E[tokens | g] = (1 - a^(g+1)) / (1 - a)             (Leviathan et al. 2023, eq. 1)

with a the running acceptance estimate (starting from the deployment's recent acceptance, see
MeasuredSpeed.request_acceptance); draft(g) the draft's
compute plus what asking it costs a round beyond that (its exchange), paid only when g > 0; verify(n) the
target's measured cost curve; both curves rescaled by what the rounds of this coordinator's requests actually took
(MeasuredSpeed, shared by its requests); overhead the round's target exchange and coordinator time. When the target
batches other sessions with this one, verify is the cost of the whole batch, assuming the others choose as this
session does: that is the gamma that maximises the batch's throughput, which each session would otherwise
overspend (an extra token is nearly free to the session that drafts it, and slows every session of the batch).
In a batch, a gain too small to measure is not taken (BATCH_MARGIN): a session that drafts reaches the target
later than those that do not, and the batch waits for it.

g = 0 (no speculation) is one of the choices, so a draft that keeps missing is not asked; its estimate drifts back
to the prior while unused, which makes the session try again now and then.

A model-free draft in this process that rates each token it proposes (Proposal.confidence: the suffix trees in the
coordinator) is sized by its proposal instead: asked for all it may propose (ask), it returns a continuation whose
tokens it rates one by one, and the round verifies the prefix with the most expected tokens per second (trim), each
token's acceptance its confidence calibrated against the deployment's verdicts (ConfidenceCalibration). One
acceptance rate for every token of every proposal cannot tell a copy running on from a guess: on the editing
workload's suffix proposals, offline, the first token was accepted 0.53-0.56 of the time and each later one
0.90-0.99 once those before it were, and a match of twelve tokens or more 0.96-0.99 against 0.35 for one or two.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from specdec.common.acceptance import ConfidenceCalibration, DecayedRate, expected_tokens
from specdec.common.cost_curve import cheapest_rows, cost_at
from specdec.common.rounds import Proposal
from specdec.coordinator.round import RoundResult

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 1.0  # the prior counts as this many drafted tokens
# A model draft's acceptance until the deployment has measured it. Optimistic, so that the first requests draft:
# a draft that agrees less shows it within a few rounds, where a pessimistic start never drafts and so never learns
# (at 0.5 the cost model never asked the Qwen 0.5B to draft for the 1.5B, which agrees with 0.85-0.92 of its
# greedy code tokens: the pair ran at target-only speed, docs/results/).
MODEL_DRAFT_PRIOR = 0.8
# How many drafted tokens the deployment's rate weighs in a model draft's request: how well two models agree is a
# property of the pair more than of the text, so one early rejection must not stop a request from drafting (at
# weight 1 it did, and the request never drafted again: after one miss its estimate fell to 0.4).
MODEL_PRIOR_WEIGHT = 8.0
EVIDENCE_DECAY = 0.9  # per drafting round: older rounds weigh less, so the estimate follows the text
IDLE_DECAY = 0.98  # per round without drafting: the estimate drifts back to the prior, so a session tries again
SCALE_DECAY = 0.8
BATCH_MARGIN = 1.05  # in a shared batch, drafting must be predicted 5 % faster than not drafting
# Per round of any request: the deployment's acceptance follows its traffic, and (rounds without drafting) drifts
# back to its prior.
DEPLOYMENT_DECAY = 0.995


@dataclass
class AcceptanceEstimate(DecayedRate):
    """The probability that the target accepts a drafted token, from this session's recent rounds, starting from
    a prior (the deployment's recent acceptance, see MeasuredSpeed)."""

    prior: float = PRIOR_ACCEPTANCE
    decay: float = EVIDENCE_DECAY  # per drafting round
    prior_weight: float = PRIOR_WEIGHT
    idle_decay: float = IDLE_DECAY  # per round without drafting

    def observe(self, drafted: int, accepted: int) -> None:
        """A round that drafted `drafted` tokens and had `accepted` accepted: each accepted token is a success, the
        first rejection (if any) a failure; the tokens after it were never tested. A round without drafting only
        lets the estimate drift back towards the prior."""
        if drafted:
            self.update(accepted, accepted + (accepted < drafted))
        else:
            self.update(0, 0, self.idle_decay)


def decayed_mean(mean: float | None, value: float, weight: float = 1.0) -> float:
    """An exponentially weighted mean moved towards value by a measurement counting as `weight` measurements
    (SCALE_DECAY kept per measurement); value itself where there is no mean yet."""
    if mean is None:
        return value
    keep = SCALE_DECAY**weight
    return keep * mean + (1 - keep) * value


@dataclass
class Scale:
    """Measured over predicted time: follows a worker that is slower (or faster) than when it was calibrated."""

    value: float = 1.0
    measured: bool = False  # whether any round has measured it
    # The first measurement replaces the curve's guess instead of moving it by a fifth (the draft's: its curve is
    # only measured in rounds that draft, and one that priced the draft out would otherwise keep doing so).
    first_replaces: bool = False

    def update(self, measured_ms: float, predicted_ms: float, weight: float = 1.0) -> None:
        """weight: how many measurements this one counts as (the sessions of one pass share it, see
        CostModelPolicy.observe)."""
        if predicted_ms > 0 and measured_ms > 0:
            first = self.first_replaces and not self.measured
            self.value = measured_ms / predicted_ms if first else decayed_mean(self.value, measured_ms / predicted_ms, weight)
            self.measured = True


@dataclass
class RunningMean:
    """An exponentially weighted mean of a time in milliseconds; None until first measured."""

    value: float | None = None

    def update(self, ms: float, weight: float = 1.0) -> None:
        self.value = decayed_mean(self.value, ms, weight)


def draft_scale() -> Scale:
    return Scale(first_replaces=True)


def deployment_acceptance() -> AcceptanceEstimate:
    """The deployment's rate, starting from a model draft's prior (a model-free draft's requests read its evidence
    from the neutral prior instead, see MeasuredSpeed.prior)."""
    return AcceptanceEstimate(prior=MODEL_DRAFT_PRIOR, decay=DEPLOYMENT_DECAY, idle_decay=DEPLOYMENT_DECAY)


@dataclass
class DraftTraits:
    """What the draft's proposals have shown of it: whether it rates its tokens (Proposal.confidence) and whether it
    runs in this process (nothing to pay for asking it). Shared by a coordinator's requests (MeasuredSpeed), so that
    a request sizes its first round as the ones before it learned to."""

    rates_tokens: bool = False
    in_process: bool = False

    def observe(self, proposal: Proposal) -> None:
        if proposal.token_ids:  # an empty proposal (no match) shows neither
            self.rates_tokens, self.in_process = bool(proposal.confidence), not proposal.bytes_sent


@dataclass
class MeasuredSpeed:
    """How fast the workers run as the rounds of every request measured it (measured over predicted), shared by
    all requests of one coordinator: a new request starts from what earlier ones saw rather than from the start-up
    calibration alone, which two workers calibrating at once on shared cores distort (each measures the other's
    load), and which a short request would otherwise never get to correct."""

    target_scale: Scale = field(default_factory=Scale)
    row_scales: dict[int, Scale] = field(default_factory=dict)
    draft_scale: Scale = field(default_factory=draft_scale)
    # The deployment's recent acceptance: the prior of a new request, which otherwise would start from a guess and
    # spend its first rounds learning what every earlier request already showed. Every request's rounds feed it,
    # those that draft and those that do not (which let it drift back to its prior, so that a deployment whose
    # rate once fell tries again).
    acceptance: AcceptanceEstimate = field(default_factory=deployment_acceptance)
    # What asking the draft costs a round beyond its compute: the exchange's transport, handling and queueing.
    draft_exchange: RunningMean = field(default_factory=RunningMean)
    # What a round pays beyond the target's work (its exchange and the coordinator): where a new request's
    # estimate starts (CostModelPolicy.overhead_ms).
    round_overhead: RunningMean = field(default_factory=RunningMean)
    # What the draft's confidences are worth (a draft that rates its tokens): sparse per request, so shared.
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    draft_traits: DraftTraits = field(default_factory=DraftTraits)

    def request_acceptance(self, model_free: bool) -> AcceptanceEstimate:
        """A new request's estimate: from prior(model_free), which weighs as MODEL_PRIOR_WEIGHT drafted tokens for
        a model draft (the pair's agreement) and PRIOR_WEIGHT for a model-free one (the request's own text)."""
        weight = PRIOR_WEIGHT if model_free else MODEL_PRIOR_WEIGHT
        return AcceptanceEstimate(prior=self.prior(model_free), prior_weight=weight)

    def prior(self, model_free: bool) -> float:
        """Where a new request's acceptance estimate starts. A model draft's acceptance is much the same from one
        request to the next (how well two models agree): the deployment's recent rate. A model-free draft's
        (prompt lookup) belongs to each request's own text: an answer that copies its input accepts most proposals,
        a new program almost none, so what earlier requests saw must not stop a request from trying. It starts at
        least at the neutral prior: a few rounds then show which kind of request it is (measured on the 1.5B pair's
        128-token suite: after a run of code prompts the deployment's rate had fallen so far that the input-grounded
        prompts of the second repeat drafted 2-4 tokens each instead of 79, and ran 0.9x target-only)."""
        if not model_free:
            return self.acceptance.value
        # The deployment's evidence from the neutral prior: MODEL_DRAFT_PRIOR is a model draft's guess, not this one's.
        return max(self.acceptance.value_from(PRIOR_ACCEPTANCE), PRIOR_ACCEPTANCE)

    def forget_draft(self) -> None:
        """A new draft worker: what was learned with the previous one (its speed against its curve, how often its
        tokens were accepted, what asking it cost) no longer holds."""
        self.draft_scale = draft_scale()
        self.acceptance = deployment_acceptance()
        self.draft_exchange = RunningMean()
        self.calibration = ConfidenceCalibration()
        self.draft_traits = DraftTraits()


class GammaPolicy:
    """How a session chooses gamma: ask (tokens to draft up front), trim (how many of a proposal's tokens to
    verify), choose (overlap's pre-drafts, behind a verification), and what it learns from each round. This base
    learns nothing; its policies take in what they use of a round through the observe hooks."""

    def choose(self, limit: int, hidden_behind: int = 0) -> int:
        raise NotImplementedError

    def ask(self, limit: int) -> int:
        return self.choose(limit)

    def trim(self, proposal: Proposal) -> int:
        return len(proposal.token_ids)

    def learn(self, result: RoundResult) -> None:
        """What a round teaches: the draft's speed, acceptance, and the target's batch."""
        verdict, verify = result.verdict, result.verdict.timing
        if result.exposed is not None:
            drafted = result.exposed.timing
            self.observe_draft(len(result.exposed.token_ids), drafted.compute_us, drafted.batch_size)
        self.observe(
            result.drafted,
            verdict.num_accepted,
            result.drafted + 1,
            verify.compute_us,
            verify.batch_size,
            verify.batch_tokens,
        )
        if result.pre is not None:
            self.observe_draft(len(result.pre.token_ids) + 1, result.pre.timing.compute_us, result.pre.timing.batch_size)
        if result.proposal is not None and result.proposal.confidence:
            self.observe_confidence(result.proposal.confidence, verdict.num_accepted)

    def observe(
        self, drafted: int, accepted: int, verified_tokens: int, verify_us: int, batch_size: int, batch_tokens: int
    ) -> None:
        pass

    def observe_draft(self, drafted: int, compute_us: int, batch_size: int = 1) -> None:
        pass

    def observe_confidence(self, confidence: list[float], accepted: int) -> None:
        pass

    def observe_overhead(self, overhead_us: int, draft_exchange_us: int | None = None) -> None:
        """overhead_us: what every round pays beyond the target's work; draft_exchange_us: what this round's
        draft exchange cost beyond drafting (None: the round did not ask the draft)."""


@dataclass
class CostModelPolicy(GammaPolicy):
    """Chooses gamma from the acceptance estimate and both workers' cost curves (see the module's docstring).

    speed: the coordinator's (shared by its requests): the scales it reads and feeds, the deployment's acceptance
    and round overhead it feeds, the draft's exchange, calibration and traits. Read through it on every use, so that
    a new draft worker (MeasuredSpeed.forget_draft) is what the requests in flight learn about too.
    """

    target_costs: list[tuple[int, float]]
    draft_costs: list[tuple[int, float]]  # empty: a model-free draft (prompt lookup), free to ask
    max_gamma: int
    speed: MeasuredSpeed = field(default_factory=MeasuredSpeed)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # this session's
    overhead_ms: float | None = None  # per round: the target's exchange beyond its work, and the coordinator's
    other_sessions: int = 0  # sessions batched with this one in the target's last forward pass
    peers: Callable[[], int] = lambda: 0  # requests of this coordinator running beside this one, now

    # The curve's look-ups by token count, computed once per count: choose() asks for every gamma every round.
    rows_for: dict[int, int] = field(default_factory=dict, repr=False)
    cost_of: dict[int, float] = field(default_factory=dict, repr=False)

    @property
    def target_scale(self) -> Scale:
        return self.speed.target_scale

    @property
    def row_scales(self) -> dict[int, Scale]:  # by padded row count
        return self.speed.row_scales

    @property
    def draft_scale(self) -> Scale:
        return self.speed.draft_scale

    @property
    def shared_acceptance(self) -> AcceptanceEstimate:
        return self.speed.acceptance

    @property
    def shared_overhead(self) -> RunningMean:
        return self.speed.round_overhead

    @property
    def draft_exchange(self) -> RunningMean:  # per drafting round
        return self.speed.draft_exchange

    @property
    def calibration(self) -> ConfidenceCalibration:
        return self.speed.calibration

    @property
    def draft_traits(self) -> DraftTraits:
        return self.speed.draft_traits

    def target_rows(self, tokens: int) -> int:
        rows = self.rows_for.get(tokens)
        if rows is None:
            rows = self.rows_for[tokens] = cheapest_rows(self.target_costs, tokens)
        return rows

    def target_ms(self, rows: int) -> float:
        cost = self.cost_of.get(rows)
        if cost is None:
            cost = self.cost_of[rows] = cost_at(self.target_costs, rows)
        return cost

    def batched_with(self) -> int:
        """Sessions expected in the target's next pass beside this one: those of its last pass, or this
        coordinator's other requests running now if more (a new request, or one whose last pass ran out of phase,
        would otherwise plan as if alone)."""
        return max(self.other_sessions, self.peers())

    def verify_ms(self, tokens: int) -> float:
        """The target's pass over the batch, each of its sessions feeding as many tokens as this one."""
        rows = self.target_rows(tokens * (1 + self.batched_with()))
        return self.scale_at(rows) * self.target_ms(rows)

    def scale_at(self, rows: int) -> float:
        """The correction measured at this row count, else the one measured over all rounds: the calibration's
        shape can be off too (contexts longer than it used, kernels that behave differently under load)."""
        scale = self.row_scales.get(rows)
        return scale.value if scale is not None else self.target_scale.value

    def draft_ms(self, gamma: int) -> float:
        """Drafting gamma tokens: gamma sequential passes of one token each."""
        return self.draft_scale.value * gamma * cost_at(self.draft_costs, 1) if gamma else 0.0

    def round_ms(self, gamma: int, draft_hidden: bool = False) -> float:
        # A round that drafts pays the draft's compute and its exchange; one that does not skips the draft worker.
        draft = 0.0 if draft_hidden or not gamma else self.draft_ms(gamma) + (self.draft_exchange.value or 0.0)
        return draft + self.verify_ms(gamma + 1) + (self.overhead_ms or 0.0)

    def rate(self, gamma: int, draft_hidden: bool = False) -> float:
        ms = self.round_ms(gamma, draft_hidden)
        return expected_tokens(self.acceptance.value, gamma) / (ms / 1e3) if ms > 0 else float(gamma + 1)

    def choose(self, limit: int, hidden_behind: int = 0) -> int:
        """The best gamma in [0, min(limit, max_gamma)]; ties go to the smaller one.

        hidden_behind: the drafting runs while the target verifies a round of this many tokens (overlap), so only
        gammas whose drafting fits inside that verification are considered, at no drafting cost.
        """
        limit = min(limit, self.max_gamma)
        draft_hidden = hidden_behind > 0
        if draft_hidden and self.draft_costs:
            # One extra pass drafts the assumed bonus token.
            fits = int(self.verify_ms(hidden_behind) / max(self.draft_ms(1), 1e-6)) - 1
            limit = min(limit, max(1, fits))
        best = self.best_paying((gamma, self.rate(gamma, draft_hidden)) for gamma in range(1, limit + 1))
        if not best and limit and self.draft_costs and not self.draft_scale.measured and self.rate(1, True) > self.rate(0):
            # A model draft that is never asked is never measured: its curve, taken at start-up, may have been
            # measured under another process's load (docs/results/2026-12-07-start-up-lock-and-the-qwen-drafts.md), and
            # would then price out for good a draft that would pay at its real speed. Until a round has measured it,
            # a round drafts one token (its first measurement replaces the curve's guess, see Scale).
            return 1
        return best

    def best_paying(self, rates: Iterable[tuple[int, float]]) -> int:
        """Of (gamma, tokens per second) choices, the fastest gamma, ties going to the smaller one; 0 unless it is
        faster than a round without drafting."""
        best, best_rate = 0, 0.0
        for gamma, rate in rates:
            if rate > best_rate * 1.000001:
                best, best_rate = gamma, rate
        # Batched with other sessions, a gain too small to measure is not taken: a session that drafts reaches the
        # target later than those that do not, and the batch waits for it (or runs without it).
        margin = BATCH_MARGIN if self.batched_with() else 1.000001
        return best if best_rate > self.rate(0) * margin else 0

    def ask(self, limit: int) -> int:
        """Tokens to ask the draft for up front. A model-free draft in this process that rates its tokens is asked
        for all it may propose, every round (it costs nothing; trim then picks how many to verify). Otherwise as
        choose: a model's tokens cost a pass each, and a draft worker's ask costs an exchange, which only the
        session's acceptance rate prices (a rated proposal from a worker is verified as choose sized it, so that
        the rate keeps learning; trimmed to nothing, it taught nothing and the worker was never asked again)."""
        draft = self.draft_traits
        if draft.rates_tokens and draft.in_process and not self.draft_costs:
            return min(limit, self.max_gamma)
        return self.choose(limit)

    def trim(self, proposal: Proposal) -> int:
        """How many of the proposal's tokens to verify: where it rates them, the prefix with the most expected
        tokens per second of its round (drafting is done: only verification and overhead count), each token
        accepted with its calibrated confidence once those before it were; 0 if none beats a round without them
        (by BATCH_MARGIN in a shared batch, as in choose). Otherwise all of them: choose sized it (see ask).
        Records what the proposal shows of the draft (DraftTraits), which the next ask reads."""
        self.draft_traits.observe(proposal)
        if not (proposal.confidence and self.draft_traits.in_process):
            return len(proposal.token_ids)
        return self.best_paying(self.prefix_rates(proposal.confidence[: len(proposal.token_ids)]))

    def prefix_rates(self, confidence: list[float]) -> Iterator[tuple[int, float]]:
        """(gamma, tokens per second) of verifying each prefix of rated tokens, drafting done: E[tokens | gamma] is
        1 + the sum over i <= gamma of the product of the calibrated confidences up to i."""
        expected, reach = 1.0, 1.0
        for gamma, value in enumerate(confidence, 1):
            reach *= self.calibration.estimate(value)
            expected += reach
            ms = self.round_ms(gamma, draft_hidden=True)
            yield gamma, expected / (ms / 1e3) if ms > 0 else expected

    def observe_confidence(self, confidence: list[float], accepted: int) -> None:
        """A verified proposal's confidences and how many of its tokens were accepted."""
        self.calibration.observe(confidence, accepted)

    def observe(
        self, drafted: int, accepted: int, verified_tokens: int, verify_us: int, batch_size: int, batch_tokens: int
    ) -> None:
        """Learns from a finished round: acceptance, the target's speed, and the load of its batch."""
        self.acceptance.observe(drafted, accepted)
        self.shared_acceptance.observe(drafted, accepted)
        self.other_sessions = max(0, batch_size - 1)
        rows = self.target_rows(max(batch_tokens, verified_tokens))
        predicted = self.target_ms(rows)
        # The scales are shared by the requests of a coordinator, and every session of a batch reports the same
        # pass: each counts for its share, so that a pass of 8 sessions moves them as one measurement, not as 8
        # (which left them at the last pass's noise, and the choice between row counts with it). Sessions that do
        # not report here (openings, fixed-gamma requests, another coordinator's) make a pass count for less.
        share = 1 / max(batch_size, 1)
        self.target_scale.update(verify_us / 1e3, predicted, share)
        self.row_scales.setdefault(rows, Scale(self.target_scale.value)).update(verify_us / 1e3, predicted, share)

    def observe_draft(self, drafted: int, compute_us: int, batch_size: int = 1) -> None:
        """batch_size: sessions of the draft's pass, which all report it (see observe)."""
        if drafted and self.draft_costs:
            self.draft_scale.update(compute_us / 1e3, drafted * cost_at(self.draft_costs, 1), 1 / max(batch_size, 1))

    def observe_overhead(self, overhead_us: int, draft_exchange_us: int | None = None) -> None:
        ms = overhead_us / 1e3
        self.overhead_ms = decayed_mean(self.overhead_ms, ms)
        self.shared_overhead.update(ms, 1 / (1 + self.other_sessions))
        if draft_exchange_us is not None:
            self.draft_exchange.update(draft_exchange_us / 1e3)


@dataclass
class FixedPolicy(GammaPolicy):
    """The same gamma every round; learns nothing."""

    gamma: int

    def choose(self, limit: int, hidden_behind: int = 0) -> int:
        return min(self.gamma, limit)


@dataclass
class HeuristicPolicy(FixedPolicy):
    """Hugging Face's `num_assistant_tokens_schedule="heuristic"`: +2 after a round where every drafted token was
    accepted, -1 (to at least 1) otherwise."""

    max_gamma: int = 16

    def observe(
        self, drafted: int, accepted: int, verified_tokens: int, verify_us: int, batch_size: int, batch_tokens: int
    ) -> None:
        if not drafted:
            return
        self.gamma = min(self.gamma + 2, self.max_gamma) if accepted == drafted else max(1, self.gamma - 1)
