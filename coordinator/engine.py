"""The speculate-verify loop: one generation request is one session on each worker.

Per round (../design/round.md): the draft syncs the previous verdict and proposes g tokens with their q; the
target scores them in one pass and returns n accepted plus the next token; the committed tokens go through the
output tracker (EOS, stop strings, max_new_tokens) before anything is streamed. The engine knows nothing of
gRPC's server side; coordinator.server translates protobuf to calls on it.

Every request is traced: a root span named by the GenAI conventions, a `speculate` span per round with `draft`
and `verify` children, whose contexts travel to the workers so that their spans join the same trace. Spans are
started and ended explicitly (never attached as the current context) because this is an async generator that
yields between rounds.
"""

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.errors import InvalidArgument, Unavailable
from common.rounds import Proposal
from common.sampling import SamplingParams
from common.telemetry import tracer
from common.tokenizer import Tokenizer
from coordinator.gamma_policy import CostModelPolicy, FixedPolicy, HeuristicPolicy, MeasuredSpeed, Scale
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import OutputTracker
from coordinator.workers import DraftSession, TargetSession, WorkerInfo, Workers
from specdec.v1 import generation_pb2

PROVIDER = "specdec"
log = logging.getLogger("specdec.coordinator")
DEADLINE_MARGIN = 0.25  # seconds
DEFAULT_HEURISTIC_START = 4  # Hugging Face starts its heuristic schedule at num_assistant_tokens
SEEDED_AUTO_GAMMA = 4  # auto for seeded sampling, which must not depend on timings
FINISH_REASON_NAMES = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_EOS: "stop",
    generation_pb2.FINISH_REASON_STOP: "stop",
}


@dataclass
class GenerationParams:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int  # -1: chosen each round (auto), 0: off
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    operation: str = "text_completion"  # GenAI operation name: "chat" for chat messages
    gamma_schedule: str = "cost_model"  # how auto chooses gamma: "cost_model" or "heuristic"
    overlap: bool = False  # draft round n+1 while the target verifies round n


@dataclass
class TimeSplit:
    """Where time went, in microseconds; the parts add up to total_us."""

    prefill_us: int = 0
    draft_us: int = 0
    verify_us: int = 0
    sync_us: int = 0
    network_us: int = 0
    coordinator_us: int = 0
    total_us: int = 0
    draft_overlapped_us: int = 0  # drafting hidden behind verification; not part of total_us
    queue_us: int = 0  # waiting on the workers for a batch to form or for the pass before it

    def add(self, other: "TimeSplit") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def attributes(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}.{name.removesuffix('_us')}_us": getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class RoundRecord:
    gamma: int
    drafted: int
    accepted: int
    committed: int
    time_split: TimeSplit
    bytes_sent: int
    bytes_received: int
    overlapped: bool = False  # the proposal was drafted while the previous round was verified
    target_batch_size: int = 1

    @property
    def rollback(self) -> int:
        return self.drafted - self.accepted


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: int
    prompt_tokens: int
    num_speculative_tokens: int
    rounds: list[RoundRecord]
    time_split: TimeSplit
    fallback_reason: str = ""
    overlap: bool = False

    @property
    def overlapped_rounds(self) -> int:
        return sum(r.overlapped for r in self.rounds)

    @property
    def drafted_tokens(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else 0.0


@dataclass
class CoordinatorConfig:
    default_num_speculative_tokens: int | None = None  # None: auto (-1) with a draft worker, 0 without
    max_num_speculative_tokens: int = 16
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_q_entries: int = 64
    num_p_entries: int = 0
    server_address: str = "localhost"
    server_port: int = 0
    draft_timeout: float = 2.0  # per-round deadline of the draft worker; missing it turns speculation off
    draft_retry_initial: float = 0.5  # first pause before a failed draft worker is tried again, doubling
    draft_retry_max: float = 30.0
    target_timeout: float = 60.0  # per-round deadline of the target worker
    target_retry_window: float = 30.0  # how long a request keeps reopening a failed target session
    max_target_retries: int = 10
    overlap: bool = False  # default of GenerateRequest.overlap


def elapsed_us(start: float, end: float) -> int:
    return int((end - start) * 1e6)


def round_split(
    proposal: Proposal | None, pre: Proposal | None, verdict, draft_rtt_us: int, verify_rtt_us: int, pre_rtt_us: int, wall_us: int
) -> TimeSplit:
    """A round's time by where it went: worker-reported compute, sync and queueing; the rest of each round trip is
    network.

    proposal: drafted before verification (exposed); pre: drafted during it (overlap), whose work counts as hidden
    except for what ran past the verification.
    """
    draft_work = (proposal.compute_us + proposal.sync_us + proposal.queue_us) if proposal else 0
    verify_work = verdict.compute_us + verdict.sync_us + verdict.queue_us
    concurrent_us = max(verify_rtt_us, pre_rtt_us)
    past_verify_us = concurrent_us - verify_rtt_us
    pre_work = (pre.compute_us + pre.sync_us) if pre else 0
    pre_exposed = min(pre_work, past_verify_us)
    return TimeSplit(
        draft_us=(proposal.compute_us if proposal else 0) + pre_exposed,
        verify_us=verdict.compute_us,
        sync_us=(proposal.sync_us if proposal else 0) + verdict.sync_us,
        queue_us=(proposal.queue_us if proposal else 0) + verdict.queue_us,
        network_us=max(0, draft_rtt_us - draft_work) + max(0, verify_rtt_us - verify_work) + past_verify_us - pre_exposed,
        coordinator_us=max(0, wall_us - draft_rtt_us - concurrent_us),
        total_us=wall_us,
        draft_overlapped_us=pre_work - pre_exposed,
    )


def span_context(span: trace.Span) -> Context:
    return trace.set_span_in_context(span)


class DraftAvailability:
    """When to try the draft worker again after it failed: exponentially growing pauses, reset by a success."""

    def __init__(self, initial: float = 0.5, maximum: float = 30.0):
        self.initial, self.maximum = initial, maximum
        self.delay = 0.0
        self.retry_at = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self) -> None:
        self.delay = min(max(2 * self.delay, self.initial), self.maximum)
        self.retry_at = time.monotonic() + self.delay

    def succeeded(self) -> None:
        self.delay, self.retry_at = 0.0, 0.0


class IncompatibleWorkers(Exception):
    """The draft and target cannot work together."""


def check_pair(target: WorkerInfo, draft: WorkerInfo | None, tokenizer_fingerprint: str) -> None:
    if tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"the coordinator's tokenizer ({tokenizer_fingerprint}) differs from the target worker's "
            f"({target.model_name}, {target.tokenizer_fingerprint}); pass --tokenizer with the target's model"
        )
    if draft is not None and draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"draft model {draft.model_name!r} and target model {target.model_name!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}); "
            "speculative decoding needs both to share one vocabulary"
        )


class GenerationEngine:
    def __init__(
        self, workers: Workers, tokenizer: Tokenizer, target: WorkerInfo, draft: WorkerInfo | None, config: CoordinatorConfig
    ):
        self.workers = workers
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft  # None until a configured draft worker has answered GetInfo
        self.draft_disabled = False
        self.config = config
        self.metrics = CoordinatorMetrics()
        self.draft_availability = DraftAvailability(config.draft_retry_initial, config.draft_retry_max)
        self.measured_speed = MeasuredSpeed()

    @property
    def max_context_length(self) -> int:
        limits = [w.max_context_length for w in (self.target, self.draft) if w and w.max_context_length]
        return min(limits) if limits else 0

    def check(self, params: GenerationParams) -> None:
        """Checks that need the deployment's models and limits (field-level checks are in coordinator.requests)."""
        if not params.prompt_token_ids:
            raise InvalidArgument("prompt", "the prompt has no tokens")
        bad = [t for t in params.prompt_token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InvalidArgument(
                "prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.target.vocab_size})"
            )
        limit = self.max_context_length
        if limit and len(params.prompt_token_ids) >= limit:
            raise InvalidArgument(
                "prompt", f"{len(params.prompt_token_ids)} prompt tokens leave no room in the context of {limit}"
            )

    def root_attributes(self, params: GenerationParams) -> dict:
        sampling = params.sampling
        attributes = {
            "gen_ai.operation.name": params.operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self.target.model_name,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.max_tokens": params.max_new_tokens,
            "gen_ai.usage.input_tokens": len(params.prompt_token_ids),
            "server.address": self.config.server_address,
            "server.port": self.config.server_port,
            "specdec.draft.model": self.draft.model_name if self.draft else "",
            "specdec.gamma": params.num_speculative_tokens,
        }
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        return attributes

    async def connect_draft(self) -> bool:
        """True when the draft worker can be used now: known, compatible, and not backing off after a failure."""
        if not self.workers.has_draft or self.draft_disabled or not self.draft_availability.ready():
            return False
        if self.draft is not None:
            return True
        try:
            draft = await asyncio.wait_for(self.workers.draft_info(), self.config.draft_timeout)
            check_pair(self.target, draft, self.tokenizer.fingerprint)
        except IncompatibleWorkers as error:
            log.error("draft worker disabled: %s", error)
            self.draft_disabled = True
            return False
        except Exception as error:  # noqa: BLE001 - an absent draft only costs speed
            log.warning("draft worker unavailable (%s); serving target-only, retrying in a while", error)
            self.draft_availability.failed()
            return False
        self.draft = draft
        self.measured_speed.draft_scale = Scale()  # learned against the previous draft's curve
        log.info("draft worker %s connected", draft.model_name)
        return True

    async def generate(self, params: GenerationParams, parent: Context | None = None, time_limit: float | None = None):
        """Yields deltas as rounds commit tokens, then the GenerationResult.

        time_limit: seconds the caller still waits (its gRPC deadline); bounds the retries after a worker failure.
        """
        started = time.perf_counter()
        self.check(params)
        root = tracer().start_span(
            f"{params.operation} {self.target.model_name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=self.root_attributes(params),
        )
        run = RequestRun(self, params, root, started, time_limit)
        try:
            async for event in run.events():
                yield event
        except BaseException as error:
            root.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            root.set_attribute("error.type", type(error).__name__)
            raise
        finally:
            root.end()

    async def generate_all(self, params: GenerationParams, parent: Context | None = None, time_limit: float | None = None):
        async for event in self.generate(params, parent, time_limit):
            if isinstance(event, GenerationResult):
                return event
        raise RuntimeError("generation ended without a result")


def derived_seed(seed: int | None, generation: int) -> int | None:
    """The seed of a reopened target session: a fresh random stream, so no uniform is used twice in a request."""
    if seed is None or generation == 0:
        return seed
    digest = hashlib.blake2b(f"reopen:{generation}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RequestRun:
    """One request's sessions and rounds, including what happens when a worker fails.

    A failing or slow draft only costs speed: the request continues target-only (same output for greedy). A failed
    target session is reopened with the prompt and every committed token re-prefilled, within the request's time
    limit; nothing already streamed is repeated or lost, since only committed tokens are ever streamed.
    """

    def __init__(
        self, engine: GenerationEngine, params: GenerationParams, root: trace.Span, started: float, time_limit: float | None
    ):
        self.engine = engine
        self.config = engine.config
        self.params = params
        self.root = root
        self.root_context = span_context(root)
        self.started = started
        self.deadline = time.monotonic() + time_limit if time_limit is not None else None
        self.target: TargetSession | None = None
        self.draft: DraftSession | None = None
        self.target_generation = 0
        self.fallback_reason = ""
        context_room = (
            engine.max_context_length - len(params.prompt_token_ids) if engine.max_context_length else params.max_new_tokens
        )
        self.output = OutputTracker(
            engine.tokenizer,
            max_new_tokens=min(params.max_new_tokens, context_room),
            stop=params.stop,
            eos_token_ids=engine.target.eos_token_ids,
            ignore_eos=params.ignore_eos,
        )

    def fall_back(self, reason: str, error: BaseException | None = None) -> None:
        """Continues without speculation: a span event, a metric, and a pause before the draft is tried again."""
        detail = f"{type(error).__name__}: {error}" if error else reason
        self.fallback_reason = self.fallback_reason or reason
        self.root.add_event("speculation.fallback", {"specdec.fallback.reason": reason, "exception.message": detail})
        self.engine.metrics.record_fallback(reason)
        if error is not None:
            log.warning("draft worker failed (%s); finishing the request target-only", detail)
            self.engine.draft_availability.failed()
        if self.draft is not None:
            asyncio.ensure_future(close_all(self.draft))
        self.draft = None

    async def open_target(self, committed: list[int], parent: Context, first_error: BaseException | None = None) -> None:
        """(Re)opens the target session on prompt + committed tokens, retrying with backoff within the time limit."""
        until = time.monotonic() + self.config.target_retry_window
        if self.deadline is not None:
            # Answer UNAVAILABLE a moment before the caller's own deadline, so it learns what failed.
            until = min(until, self.deadline - DEADLINE_MARGIN)
        delay, attempts, last_error = 0.1, 0, first_error
        while True:
            sampling = replace(self.params.sampling, seed=derived_seed(self.params.sampling.seed, self.target_generation))
            remaining = until - time.monotonic()
            try:
                opening = self.engine.workers.open_target(
                    self.params.prompt_token_ids + committed, sampling, self.config.num_p_entries, parent
                )
                self.target = await asyncio.wait_for(opening, max(0.05, min(remaining, self.config.target_timeout)))
                return
            except (TimeoutError, Unavailable) as error:
                last_error, attempts = error, attempts + 1
            self.target_generation += 1
            if attempts > self.config.max_target_retries or time.monotonic() + delay >= until:
                raise Unavailable(
                    f"target worker unavailable: {attempts} attempts to open a session failed "
                    f"(last: {type(last_error).__name__}: {last_error or 'timed out'})"
                )
            self.root.add_event("target.retry", {"specdec.attempt": attempts, "exception.message": str(last_error)})
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    async def open_sessions(self, parent: Context) -> None:
        """Opens (and prefills) both sessions concurrently. A draft that cannot open only turns speculation off."""
        use_draft = self.params.num_speculative_tokens != 0 and await self.engine.connect_draft()
        if self.params.num_speculative_tokens != 0 and not use_draft:
            self.fall_back("draft_unavailable" if self.engine.workers.has_draft else "no_draft_worker")
        draft_opening = None
        if use_draft:
            draft_opening = asyncio.ensure_future(
                self.engine.workers.open_draft(
                    self.params.prompt_token_ids, self.params.sampling, self.config.max_q_entries, parent
                )
            )
        try:
            await self.open_target([], parent)
        except BaseException:
            if draft_opening is not None:
                draft_opening.cancel()
                await close_all(*(await asyncio.gather(draft_opening, return_exceptions=True)))
            raise
        if draft_opening is not None:
            # Both prefill concurrently; the draft gets its round deadline beyond the target's prefill.
            try:
                self.draft = await asyncio.wait_for(draft_opening, self.config.draft_timeout)
                self.engine.draft_availability.succeeded()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
                self.fall_back("draft_open_failed", error)

    async def propose(
        self, num_accepted: int, committed: list[int], g: int, parent: Context, assume_accepted: bool = False
    ) -> Proposal | None:
        """The draft's proposal, or None once the draft has failed or missed its per-round deadline."""
        try:
            async with asyncio.timeout(self.config.draft_timeout):
                return await self.draft.step(num_accepted, committed, g, parent, assume_accepted)
        except TimeoutError as error:
            self.fall_back("draft_timeout", error)
        except Exception as error:  # noqa: BLE001 - a failing draft only costs speed
            self.fall_back("draft_failed", error)
        return None

    async def pre_draft(self, sync: "DraftSync", g: int, parent: Context) -> tuple[Proposal | None, int]:
        """Overlap: drafts the next round while the target verifies this one (see DraftStep.assume_accepted);
        returns the proposal (None on failure) and its round-trip time."""
        span = tracer().start_span("draft", context=parent, attributes={"specdec.overlapped": True, "specdec.gamma": g})
        start = time.perf_counter()
        try:
            proposal = await self.propose(*sync.take(), g, span_context(span), assume_accepted=True)
        finally:
            span.end()
        return proposal, elapsed_us(start, time.perf_counter())

    async def verify(self, proposal: Proposal | None, parent: Context):
        """The target's verdict; a failed target session is reopened and the same proposal verified again."""
        drafted = proposal.token_ids if proposal else []
        dists = proposal.distributions if proposal else []
        while True:
            try:
                async with asyncio.timeout(self.config.target_timeout):
                    return await self.target.verify(drafted, dists, parent)
            except (TimeoutError, Unavailable) as error:
                log.warning("target session failed (%s); reopening it on %d committed tokens", error, len(self.output.token_ids))
                self.root.add_event("target.reopen", {"exception.message": f"{type(error).__name__}: {error}"})
                await close_all(self.target)
                self.target_generation += 1
                await self.open_target(self.output.token_ids, parent, error)

    def make_policy(self):
        gamma = self.params.num_speculative_tokens
        if gamma >= 0:
            return FixedPolicy(gamma)
        if self.params.gamma_schedule == "heuristic":
            return HeuristicPolicy(DEFAULT_HEURISTIC_START, self.config.max_num_speculative_tokens)
        sampling = self.params.sampling
        if sampling.seed is not None and not sampling.greedy:
            # Gamma decides how the random streams are consumed: a seeded request must not let timings choose it,
            # or the same seed would give different text on another replica or after a restart.
            return FixedPolicy(SEEDED_AUTO_GAMMA)
        draft, speed = self.engine.draft, self.engine.measured_speed
        return CostModelPolicy(
            self.engine.target.forward_costs,
            draft.forward_costs if draft else [],
            self.config.max_num_speculative_tokens,
            target_scale=speed.target_scale,
            row_scales=speed.row_scales,
            draft_scale=speed.draft_scale,
        )

    async def events(self):
        totals = TimeSplit()
        rounds: list[RoundRecord] = []
        first_token_at = None
        output = self.output
        opened = time.perf_counter()
        try:  # from here on, whatever happens, both sessions are closed
            prefill_span = tracer().start_span("prefill", context=self.root_context)
            try:
                await self.open_sessions(span_context(prefill_span))
            finally:
                prefill_span.end()
            totals.prefill_us = elapsed_us(opened, time.perf_counter())
            policy = self.make_policy()
            # The opening's round trip beyond the target's prefill: a first guess of the per-round overhead.
            policy.observe_overhead(max(0, totals.prefill_us - self.target.prefill_us))
            speculating = self.draft is not None
            overlap = self.params.overlap and speculating
            # With overlap a model draft drafts only behind verification: after a discarded pre-draft the target
            # verifies the pending token alone while the draft pre-drafts again (a model-free draft costs nothing
            # to ask, so it still drafts up front).
            behind_only = overlap and bool(self.engine.draft and self.engine.draft.forward_costs)
            sync = DraftSync()  # what the draft has not heard of yet
            ready: Proposal | None = None  # drafted during the previous round, consistent with the committed tokens
            round_start = time.perf_counter()
            while not output.finished:
                raise_if_cancelled()
                room = output.remaining - 1
                overlapped = ready is not None
                if ready is not None:
                    proposal, exposed, g = truncated(ready, room), None, len(ready.token_ids)
                    ready = None
                else:
                    g = policy.choose(room) if self.draft and not behind_only else 0
                    proposal = exposed = None
                round_span = tracer().start_span("speculate", context=self.root_context, attributes={"specdec.gamma": g})
                round_context = span_context(round_span)
                t0 = time.perf_counter()
                if g > 0 and not overlapped:
                    draft_span = tracer().start_span("draft", context=round_context)
                    try:
                        proposal = exposed = await self.propose(*sync.take(), g, span_context(draft_span))
                    finally:
                        draft_span.end()
                    if exposed is not None:
                        policy.observe_draft(len(exposed.token_ids), exposed.compute_us)
                t1 = time.perf_counter()
                drafted = proposal.token_ids if proposal else []
                pre_task = None
                if overlap and self.draft is not None and output.remaining > len(drafted) + 2:
                    g_next = policy.choose(output.remaining - len(drafted) - 2, hidden_behind=len(drafted) + 1)
                    if g_next > 0:
                        pre_task = asyncio.ensure_future(self.pre_draft(sync, g_next, round_context))
                verify_span = tracer().start_span("verify", context=round_context)
                try:
                    verdict = await self.verify(proposal, span_context(verify_span))
                except BaseException:
                    if pre_task is not None:
                        pre_task.cancel()
                    raise
                finally:
                    verify_span.end()
                t2 = time.perf_counter()
                pre, pre_rtt = (await pre_task) if pre_task is not None else (None, 0)
                committed = drafted[: verdict.num_accepted] + [verdict.next_token]
                hit = (
                    pre is not None
                    and verdict.num_accepted == len(drafted)
                    and pre.assumed_token == verdict.next_token
                    and self.draft is not None
                )
                if hit:
                    sync.confirm(len(drafted) + 1)
                    ready = pre if pre.token_ids else None
                elif proposal is not None or pre_task is not None:
                    sync.reject(verdict.num_accepted, verdict.next_token)
                else:
                    sync.commit_unheard(committed)
                policy.observe(
                    len(drafted),
                    verdict.num_accepted,
                    len(drafted) + 1,
                    verdict.compute_us,
                    verdict.batch_size,
                    verdict.batch_tokens,
                )
                if pre is not None:
                    policy.observe_draft(len(pre.token_ids) + 1, pre.compute_us)
                delta = output.add(committed)
                if delta.token_ids or delta.text:
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    yield delta
                # A round ends where the next begins, so the time spent streaming its delta counts in it.
                round_end = time.perf_counter()
                split = round_split(
                    exposed,
                    pre,
                    verdict,
                    elapsed_us(t0, t1),
                    elapsed_us(t1, t2),
                    pre_rtt,
                    elapsed_us(round_start, round_end),
                )
                policy.observe_overhead(split.network_us + split.coordinator_us)
                record = RoundRecord(
                    gamma=g,
                    drafted=len(drafted),
                    accepted=verdict.num_accepted,
                    committed=len(committed),
                    time_split=split,
                    bytes_sent=sum(p.bytes_sent for p in (exposed, pre) if p) + verdict.bytes_sent,
                    bytes_received=sum(p.bytes_received for p in (exposed, pre) if p) + verdict.bytes_received,
                    overlapped=overlapped,
                    target_batch_size=verdict.batch_size,
                )
                round_start = round_end
                rounds.append(record)
                totals.add(record.time_split)
                round_span.set_attributes(round_attributes(record))
                round_span.end()
        finally:
            closing = time.perf_counter()
            await asyncio.shield(close_all(self.target, self.draft))
            totals.coordinator_us += elapsed_us(closing, time.perf_counter())
        finished = time.perf_counter()
        totals.total_us = elapsed_us(self.started, finished)
        totals.coordinator_us += elapsed_us(self.started, opened)
        result = GenerationResult(
            text=output.text,
            token_ids=output.token_ids,
            finish_reason=output.finish_reason,
            prompt_tokens=len(self.params.prompt_token_ids),
            num_speculative_tokens=self.params.num_speculative_tokens if speculating else 0,
            rounds=rounds,
            time_split=totals,
            fallback_reason=self.fallback_reason,
            overlap=overlap,
        )
        self.root.set_attributes(
            {
                "gen_ai.usage.output_tokens": len(output.token_ids),
                "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES.get(output.finish_reason, "unknown")],
                "gen_ai.response.model": self.engine.target.model_name,
                "specdec.rounds": len(rounds),
                "specdec.drafted_tokens": result.drafted_tokens,
                "specdec.accepted_tokens": result.accepted_tokens,
                "specdec.overlapped_rounds": result.overlapped_rounds,
                **totals.attributes("specdec.time"),
            }
        )
        self.engine.metrics.record_request(
            self.params, result, self.engine.target.model_name, first_token_at, self.started, finished
        )
        yield result


def raise_if_cancelled() -> None:
    """asyncio.wait_for in Python 3.11 can swallow a cancellation that arrives as its awaitable completes (fixed in
    3.12): the request would then run on after its caller left. The task still counts the cancellation."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


class DraftSync:
    """What the draft worker has not heard of yet, sent with the next draft step (see DraftStep).

    confirmed: tokens of the draft's chain (its proposals and assumed tokens since the last sync) the target has
    committed; committed: tokens committed after them that the chain does not hold. Overlap hits extend the chain
    without a sync; any other verdict needs one.
    """

    def __init__(self):
        self.confirmed = 0
        self.committed: list[int] = []

    def take(self) -> tuple[int, list[int]]:
        """(num_accepted, committed_token_ids) for the next step; nothing to apply while the chain is all valid."""
        if not self.committed:
            return 0, []
        sync = (self.confirmed, self.committed)
        self.confirmed, self.committed = 0, []
        return sync

    def confirm(self, tokens: int) -> None:
        self.confirmed += tokens

    def reject(self, accepted: int, next_token: int) -> None:
        """The target accepted `accepted` of the chain's outstanding tokens, then committed next_token."""
        self.confirmed += accepted
        self.committed = [next_token]

    def commit_unheard(self, tokens: list[int]) -> None:
        """A round the draft took no part in."""
        self.committed = self.committed + tokens


def truncated(proposal: Proposal, room: int) -> Proposal:
    if len(proposal.token_ids) <= room:
        return proposal
    return replace(proposal, token_ids=proposal.token_ids[:room], distributions=proposal.distributions[:room])


def round_attributes(record: RoundRecord) -> dict:
    return {
        "specdec.gamma": record.gamma,
        "specdec.drafted": record.drafted,
        "specdec.accepted": record.accepted,
        "specdec.rollback": record.rollback,
        "specdec.committed": record.committed,
        "specdec.bytes_sent": record.bytes_sent,
        "specdec.bytes_received": record.bytes_received,
        "specdec.overlapped": record.overlapped,
        "specdec.target_batch_size": record.target_batch_size,
        **record.time_split.attributes("specdec.time"),
    }


async def close_all(*sessions) -> None:
    """Closes whichever of the sessions exist (exceptions, e.g. from a failed opening, are skipped)."""
    with contextlib.suppress(Exception):
        await asyncio.gather(
            *(s.close() for s in sessions if s is not None and not isinstance(s, BaseException)), return_exceptions=True
        )
