"""The target's sessions and the three kinds of call a batch runs for them, each with its own check, feed, span and
finish: a round to verify (VerifyCall), a pending token scored ahead of its round (AheadCall, docs/design/
decode_ahead.md) and an opening session's prompt, prefilled a chunk at a time (PrefillCall).

target_worker.engine runs a batch of them as one forward pass and hands each call the rows it fed.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from opentelemetry.context import Context

from specdec.common.batched_forward import as_sampling_input
from specdec.common.batcher import CONTINUE, Continue
from specdec.common.cached_sequence import CachedSequence
from specdec.common.errors import FailedPrecondition
from specdec.common.grammar import GrammarMatcher, mask_logits
from specdec.common.protocol import as_distribution
from specdec.common.rounds import DraftQ, Verdict, WorkerTiming
from specdec.common.sampling import (
    SamplingParams,
    TokenLogprob,
    accept_while_argmax,
    adjusted_logits,
    logits_to_probs,
    token_logprobs,
    top_entries,
    verify_draft,
)
from specdec.common.telemetry import tracer
from specdec.common.timing import elapsed_us

if TYPE_CHECKING:
    from specdec.target_worker.engine import TargetEngine


@dataclass
class TargetSession:
    session_id: str
    sequence: CachedSequence
    params: SamplingParams
    generator: torch.Generator
    num_p_entries: int
    last_active: float = field(default_factory=time.monotonic)
    ahead: "Ahead | None" = None  # its pending token, scored before its round arrived
    output_from: int = 0  # where the request's output begins in its tokens (the logit adjustments' prompt ends)
    logprobs: int | None = None  # the committed tokens' log-probabilities, with this many alternatives (None: off)
    prompt_logprobs: list[TokenLogprob] | None = None  # filled by the prefill when asked for (None: not asked)
    grammar: GrammarMatcher | None = None  # at the committed output

    @property
    def can_run_ahead(self) -> bool:
        """Its next round's first row may be scored in a pass of its own: the same numbers as in the round's own
        pass only where a row's logits depend neither on the rows beside it nor on their count (what GetInfo's
        decodes_ahead says)."""
        return self.sequence.runner.rows_alone

    @property
    def argmax_verdict(self) -> bool:
        """Greedy and reporting no p: p is one-hot, so a verdict reads only the argmax of the logits, never q."""
        return self.params.greedy and not self.num_p_entries

    def adjusted(self, logits: torch.Tensor, draft_tokens: list[int]) -> torch.Tensor:
        """The rows of a round, each adjusted as a one-at-a-time target would have at its position."""
        return adjusted_logits(logits, self.params, self.sequence.tokens, self.output_from, draft_tokens)


@dataclass
class Ahead:
    """A pending token scored ahead: the logits of the position after it, and the figures of the pass."""

    logits: torch.Tensor  # [1, V]
    compute_us: int
    batch_size: int
    batch_tokens: int


@dataclass
class SessionOpened:
    session_id: str
    cached_tokens: int
    compute_us: int
    queue_us: int = 0  # waiting in the worker beside its passes (for a batch, for the other chunks' turns)
    reused_tokens: int = 0  # of the prompt, copied from a closed session's cache instead of computed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when the opening asked for them


@dataclass
class PassFigures:
    """A batch's forward pass as its calls report it: its compute (0: no pass ran), its calls and its tokens."""

    forward_us: int
    batch_size: int
    batch_tokens: int

    @property
    def attributes(self) -> dict:
        return {"specdec.batch_size": self.batch_size, "specdec.batch_tokens": self.batch_tokens}


@dataclass
class PrefillBudget:
    """The prompt tokens one pass may still prefill, and the size of every session's chunks."""

    left: int
    chunk: int


class BaseCall:
    """The steps of a call in a batch; a kind of call (a dataclass with its session, trace parent, queued_at and
    queue_us) overrides those it takes part in."""

    session: TargetSession
    keeps_rows = False  # whether the pass keeps the logits of every token it feeds (else only the last one's)

    def check(self, engine: "TargetEngine") -> None:
        """Raises the error of a call that may not run."""

    def start(self, engine: "TargetEngine") -> None:
        """Readies the call for its first pass (an error fails this call alone)."""

    def feed(self, budget: PrefillBudget) -> list[int]:
        """The tokens the call feeds this pass."""
        raise NotImplementedError

    def span(self, figures: PassFigures):
        raise NotImplementedError

    def finish(self, engine: "TargetEngine", logits: torch.Tensor | None, span, figures: PassFigures):
        """The call's result after the pass, given the rows it kept (None: it fed nothing); ends its span."""
        raise NotImplementedError


@dataclass
class VerifyCall(BaseCall):
    """One session's round in a batch: its draft tokens, their q, and the trace context it belongs to."""

    session: TargetSession
    draft_tokens: list[int]
    draft_dists: list[DraftQ]  # as received; a sampled session's converted to tensors once checked
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0
    # Under a grammar: the masks of the rows it scores, and how many drafted tokens it feeds (up to the first one
    # the grammar forbids, which is tested without a row of its own: its p is 0, so it is rejected).
    allowed: torch.Tensor | None = None
    fed: int | None = None
    num_tested: int | None = None

    keeps_rows = True

    @property
    def feeds(self) -> list[int]:
        return self.draft_tokens if self.fed is None else self.draft_tokens[: self.fed]

    @property
    def tested(self) -> list[int]:
        return self.draft_tokens if self.num_tested is None else self.draft_tokens[: self.num_tested]

    def check(self, engine: "TargetEngine") -> None:
        engine.require_open(self.session)
        engine.check_step(self.session, self.draft_tokens, self.draft_dists)
        if not self.session.argmax_verdict:  # a greedy verdict never reads q (p is one-hot): q is only checked
            self.draft_dists = [as_distribution(d) for d in self.draft_dists]
        if self.session.grammar is not None:
            self.allowed, self.fed, self.num_tested = self.session.grammar.masks_along(self.draft_tokens)

    def feed(self, budget: PrefillBudget) -> list[int]:
        """Its pending and drafted tokens (only the drafted ones where its pending token was scored ahead)."""
        return self.session.sequence.pending() + self.feeds

    def span(self, figures: PassFigures):
        attributes = {"specdec.gamma": len(self.draft_tokens), **figures.attributes}
        return tracer().start_span("target.verify", context=self.parent, attributes=attributes)

    def finish(self, engine: "TargetEngine", logits: torch.Tensor | None, span, figures: PassFigures) -> Verdict | Exception:
        """The round's verdict on the rows scored for it (its first one ahead, the rest by this pass, if any), with
        the passes' figures: a round scored wholly ahead reports the pass that scored it."""
        batch_size, batch_tokens = figures.batch_size, figures.batch_tokens
        ahead, self.session.ahead = self.session.ahead, None
        if ahead is not None:
            logits = ahead.logits if logits is None else torch.cat([ahead.logits, logits])
            if figures.forward_us == 0:
                batch_size, batch_tokens = ahead.batch_size, ahead.batch_tokens
        try:
            verdict = engine.decide(self, logits, span)
        except Exception as error:  # noqa: BLE001 - fails this session's stream (and frees it), not the batch
            return error
        timing = verdict.timing
        timing.batch_size, timing.batch_tokens = batch_size, batch_tokens
        timing.compute_us += figures.forward_us + (ahead.compute_us if ahead else 0)
        timing.ahead_us = ahead.compute_us if ahead else 0
        timing.queue_us = self.queue_us
        return verdict

    def decide(self, engine: "TargetEngine", logits: torch.Tensor, span) -> Verdict:
        """The acceptance test on the session's scored rows, and the rollback of what it rejected."""
        session, draft_tokens = self.session, self.tested
        session.last_active = time.monotonic()
        start = time.perf_counter()
        gamma = len(self.draft_tokens)
        try:
            num_accepted, next_token, draft_token_probs, distributions = self.accepted(logits)
            draft_token_probs += [0.0] * (gamma - len(draft_token_probs))  # cut by the grammar: p = 0
            span.set_attributes({"specdec.accepted": num_accepted, "specdec.rollback": gamma - num_accepted})
        finally:
            span.end()
        compute_us = elapsed_us(start)
        sync_us = self.roll_back(num_accepted)
        engine.metrics.record_rollback(sync_us / 1e6)
        committed = draft_tokens[:num_accepted] + [next_token]
        # The log-probabilities are the model's own, before the mask and the adjustments.
        logprobs = [] if session.logprobs is None else token_logprobs(as_sampling_input(logits), committed, session.logprobs)
        session.sequence.tokens += committed
        if session.grammar is not None:
            session.grammar.consume(committed)
        return Verdict(
            num_accepted,
            next_token,
            gamma - num_accepted,
            draft_token_probs,
            distributions,
            WorkerTiming(compute_us, sync_us),
            logprobs=logprobs,
        )

    def accepted(self, logits: torch.Tensor) -> tuple[int, int, list[float], list]:
        """The acceptance test: how many drafted tokens it accepts, the token after them, the drafted tokens' p and
        the reported p entries."""
        session, draft_tokens = self.session, self.tested
        if self.allowed is not None:
            logits = mask_logits(as_sampling_input(logits), self.allowed)
        scores = session.adjusted(as_sampling_input(logits), draft_tokens) if session.params.adjusts_logits else logits
        if session.argmax_verdict:
            # p is one-hot at the argmax: the verdict needs only the argmax, computed where the logits are.
            argmax = scores.argmax(dim=-1).tolist()
            num_accepted, next_token = accept_while_argmax(argmax, draft_tokens)
            return num_accepted, next_token, [float(a == x) for a, x in zip(argmax, draft_tokens, strict=False)], []
        probs = logits_to_probs(as_sampling_input(scores), session.params)
        num_accepted, next_token = verify_draft(probs, draft_tokens, self.draft_dists, session.params, session.generator)
        tested = torch.arange(len(draft_tokens))
        draft_token_probs = probs[tested, torch.tensor(draft_tokens, dtype=torch.long)].tolist()
        distributions = top_entries(probs, session.num_p_entries) if session.num_p_entries else []
        return num_accepted, next_token, draft_token_probs, distributions

    def roll_back(self, num_accepted: int) -> int:
        """Crops the cache to the pending token and the accepted drafted ones; the time it took (us)."""
        sequence, rejected = self.session.sequence, len(self.draft_tokens) - num_accepted
        with tracer().start_as_current_span(
            "kv.rollback", context=self.parent, attributes={"specdec.worker": "target", "specdec.rollback": rejected}
        ):
            sync_start = time.perf_counter()
            sequence.crop_to(len(sequence.tokens) + num_accepted)
            return elapsed_us(sync_start)


@dataclass
class AheadCall(BaseCall):
    """A session's pending token fed before its next round arrives (decode ahead): the pass scores the row the
    round would score first, and the round then feeds only its drafted tokens, or nothing at all."""

    session: TargetSession
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0

    def check(self, engine: "TargetEngine") -> None:
        engine.require_open(self.session)
        engine.check_decode_ahead(self.session)
        if self.session.ahead is not None or len(self.session.sequence.pending()) != 1:
            raise FailedPrecondition("decode ahead needs one pending token not yet scored")

    def feed(self, budget: PrefillBudget) -> list[int]:
        """Its pending token."""
        return self.session.sequence.pending()

    def span(self, figures: PassFigures):
        return tracer().start_span("target.decode_ahead", context=self.parent, attributes=figures.attributes)

    def finish(self, engine: "TargetEngine", logits: torch.Tensor | None, span, figures: PassFigures) -> Ahead:
        span.end()
        self.session.ahead = Ahead(logits.clone(), figures.forward_us, figures.batch_size, figures.batch_tokens)
        return self.session.ahead


@dataclass
class PrefillCall(BaseCall):
    """An opening session's prompt, prefilled in a batch with the other sessions' rounds: in chunks, a pass at a
    time, when it is longer than the engine's max_prefill_tokens (the call then goes into several batches)."""

    session: TargetSession
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0
    compute_us: int = 0  # of its chunks so far
    reused_tokens: int | None = None  # of its prompt, copied from the prefix cache (None: not looked up yet)

    @property
    def keeps_rows(self) -> bool:
        """A prefill that reports the prompt's log-probabilities keeps a row per token it feeds."""
        return self.session.prompt_logprobs is not None

    def start(self, engine: "TargetEngine") -> None:
        """The first pass starts from the longest prefix of its prompt a closed session left in the prefix cache;
        the prefill then feeds only the rest. An error (e.g. no memory for the copy) fails this opening alone."""
        if self.reused_tokens is not None:
            return
        sequence = self.session.sequence
        # The prompt's log-probabilities need every row of it computed.
        reusing = engine.prefixes is not None and self.session.prompt_logprobs is None
        self.reused_tokens = engine.prefixes.start_from(sequence.tokens, sequence.cache) if reusing else 0

    def feed(self, budget: PrefillBudget) -> list[int]:
        """The next chunk of its prompt (all but the last token, which stays pending for the first round), or
        nothing when the chunk is over what the pass may still prefill."""
        sequence = self.session.sequence
        start = sequence.cache_len
        chunk = sequence.tokens[start : min(len(sequence.tokens) - 1, start + budget.chunk)]
        if len(chunk) > budget.left:
            chunk = []  # the next pass's
        budget.left -= len(chunk)
        return chunk

    def span(self, figures: PassFigures):
        attributes = {
            "specdec.worker": "target",
            "specdec.prompt_tokens": len(self.session.sequence.tokens),
            "specdec.reused_tokens": self.reused_tokens or 0,
            **figures.attributes,
        }
        return tracer().start_span("prefill", context=self.parent, attributes=attributes)

    def finish(
        self, engine: "TargetEngine", logits: torch.Tensor | None, span, figures: PassFigures
    ) -> SessionOpened | FailedPrecondition | Continue:
        """CONTINUE while chunks of its prompt remain, then SessionOpened. logits: the rows of the chunk this pass
        fed (each scoring the prompt token after it)."""
        span.end()
        self.compute_us += figures.forward_us
        session, sequence = self.session, self.session.sequence
        if session.prompt_logprobs is not None and logits is not None:
            scored = len(session.prompt_logprobs)
            following = sequence.tokens[scored + 1 : scored + 1 + logits.shape[0]]
            session.prompt_logprobs += token_logprobs(as_sampling_input(logits), following, session.logprobs)
        if sequence.cache_len < len(sequence.tokens) - 1:
            return CONTINUE  # chunks of its prompt still to run
        try:
            engine.finish_opening(session)
        except FailedPrecondition as error:
            return error
        in_worker_us = elapsed_us(self.queued_at) if self.queued_at else self.compute_us
        return SessionOpened(
            session.session_id,
            sequence.cache_len,
            self.compute_us,
            max(0, in_worker_us - self.compute_us),
            self.reused_tokens or 0,
            session.prompt_logprobs or [],
        )


Call = VerifyCall | AheadCall | PrefillCall
