"""The speculate-verify loop: one generation request is one session on each worker.

Per round (docs/design/round.md): the draft syncs the previous verdict and proposes g tokens with their q; the
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
import logging
import time
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.errors import InvalidArgument, Unavailable
from common.rounds import Proposal
from common.sampling import SamplingParams, stream_seed
from common.telemetry import tracer
from common.timing import elapsed_us
from common.tokenizer import Tokenizer
from common.validation import check_prompt, check_token_ids
from coordinator.config import CoordinatorConfig
from coordinator.gamma_policy import CostModelPolicy, FixedPolicy, HeuristicPolicy, MeasuredSpeed
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import Delta, OutputTracker
from coordinator.round import (
    DraftSync,
    Phase,
    RoundResult,
    RoundWorkers,
    handling,
    raise_if_cancelled,
    round_stats,
    speculation_round,
    truncated,
)
from coordinator.finish_reasons import FINISH_REASON_NAMES
from coordinator.types import GenerationParams, GenerationResult, RoundStats, TimeSplit
from coordinator.workers import DraftSession, IncompatibleWorkers, TargetSession, WorkerInfo, Workers
from specdec.v1 import generation_pb2

PROVIDER = "specdec"
log = logging.getLogger("specdec.coordinator")
DEADLINE_MARGIN = 0.25  # seconds
DEFAULT_HEURISTIC_START = 4  # Hugging Face starts its heuristic schedule at num_assistant_tokens
SEEDED_AUTO_GAMMA = 4  # auto for seeded sampling, which must not depend on timings


def span_context(span: trace.Span) -> Context:
    return trace.set_span_in_context(span)


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
        self.metrics = CoordinatorMetrics(workers.status)
        self.measured_speed = MeasuredSpeed()
        self.running = 0  # requests in progress
        self.server_address, self.server_port = "localhost", 0  # where clients reach it: set by listening_on

    def listening_on(self, address: str, port: int) -> None:
        """Where the server that serves this engine listens (its spans' server.address and server.port)."""
        self.server_address, self.server_port = address, port

    @property
    def max_context_length(self) -> int:
        limits = [w.max_context_length for w in (self.target, self.draft) if w and w.max_context_length]
        return min(limits) if limits else 0

    def check(self, params: GenerationParams) -> None:
        """Checks that need the deployment's models and limits (field-level checks are in coordinator.requests)."""
        limit, vocab_size = self.max_context_length, self.target.vocab_size
        # A bad id is the token ids' fault (named first, as their own field); an empty or too long prompt is the
        # prompt's, whether it came as text or as ids.
        check_prompt(params.prompt_token_ids, vocab_size, limit, "prompt", ids_field="prompt_token_ids")
        check_token_ids([token for token, _ in params.sampling.logit_bias], vocab_size, "logit_bias")
        prompt = len(params.prompt_token_ids)
        if limit and params.max_new_tokens_given and prompt + params.max_new_tokens > limit:
            raise InvalidArgument(
                "max_new_tokens",
                f"{prompt} prompt tokens + {params.max_new_tokens} new tokens exceed the context of {limit}; "
                f"ask for at most {limit - prompt}",
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
            "server.address": self.server_address,
            "server.port": self.server_port,
            "specdec.draft.model": self.draft.model_name if self.draft else "",
            "specdec.gamma": params.num_speculative_tokens,
        }
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        return attributes

    async def connect_draft(self) -> bool:
        """True when a draft worker can be used now: known, compatible, and not backing off after a failure."""
        if not self.workers.has_draft or self.draft_disabled or not self.workers.draft_available():
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
            return False
        self.draft = draft
        self.measured_speed.forget_draft()
        log.info("draft worker %s connected", draft.model_name)
        return True

    async def generate(
        self,
        params: GenerationParams,
        parent: Context | None = None,
        time_limit: float | None = None,
        kind: SpanKind = SpanKind.SERVER,
    ):
        """Yields deltas as rounds commit tokens, then the GenerationResult.

        time_limit: seconds the caller still waits (its gRPC deadline); bounds the retries after a worker failure.
        kind: of the request's span: SERVER where it is the server's span for the call, INTERNAL under another
        server span (the HTTP API's).
        """
        started = time.perf_counter()
        self.check(params)
        root = tracer().start_span(
            f"{params.operation} {self.target.model_name}",
            context=parent,
            kind=kind,
            attributes=self.root_attributes(params),
        )
        run = RequestRun(self, params, root, started, time_limit)
        self.running += 1
        try:
            async for event in run.events():
                yield event
        except GeneratorExit:  # the caller stopped reading (e.g. after the result): not an error of the request
            raise
        except BaseException as error:
            root.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            root.set_attribute("error.type", type(error).__name__)
            raise
        finally:
            self.running -= 1
            root.end()

    async def generate_all(self, params: GenerationParams, parent: Context | None = None, time_limit: float | None = None):
        async with contextlib.aclosing(self.generate(params, parent, time_limit)) as events:
            async for event in events:
                if isinstance(event, GenerationResult):
                    return event
        raise RuntimeError("generation ended without a result")


# How much longer than its measured per-token cost a long prefill may take: the cost curve is measured at a
# 160-token context, and attention over a long prompt costs more per token the longer it is (measured on the
# gguf engine, SmolLM2, 2 cores: 4,000 tokens in one pass took 2.4x the per-token cost of its 64-token pass).
PREFILL_SLACK = 4.0


def prefill_allowance(forward_costs: list[tuple[int, float]], tokens: int) -> float:
    """Seconds a prefill of `tokens` may take beyond a round's deadline: PREFILL_SLACK times the cost per token
    at the largest count the worker measured; 0 when it measured none."""
    if not forward_costs:
        return 0.0
    counted, milliseconds = max(forward_costs)
    return PREFILL_SLACK * tokens * milliseconds / counted / 1000


def derived_seed(seed: int | None, generation: int, stream: str = "reopen") -> int | None:
    """The seed of a reopened session: a fresh random stream, so no uniform is used twice in a request (a stream
    per worker role: "reopen" for the target, "reopen-draft" for the draft)."""
    if seed is None or generation == 0:
        return seed
    return stream_seed(seed, f"{stream}:{generation}")


def session_sampling(sampling: SamplingParams, committed: list[int], seed: int | None) -> SamplingParams:
    """A session's sampling parameters: the request's, with its seed, and the committed tokens its prompt holds
    counted as output by the logit adjustments."""
    return replace(sampling, seed=seed, generated_tokens=len(committed))


def timings_choose_gamma(params: GenerationParams) -> bool:
    """Whether the cost model chooses the request's gamma from measured speeds: auto, except with the heuristic
    schedule, and except for seeded sampling. Gamma decides how the random streams are consumed, so a seeded
    request must not let timings choose it, or the same seed would give different text on another replica or after
    a restart."""
    sampling = params.sampling
    seeded = sampling.seed is not None and not sampling.greedy
    return params.num_speculative_tokens < 0 and params.gamma_schedule != "heuristic" and not seeded


def gamma_policy_for(engine: GenerationEngine, params: GenerationParams, opening_overhead_ms: float | None = None):
    """How a request chooses each round's gamma: the fixed gamma it asked for, the heuristic schedule, or (auto)
    the cost model over the workers' measured speeds. opening_overhead_ms: the target opening's transport, the
    round overhead's first guess where the deployment has measured none yet."""
    gamma, config = params.num_speculative_tokens, engine.config
    if gamma >= 0:
        return FixedPolicy(gamma)
    if params.gamma_schedule == "heuristic":
        return HeuristicPolicy(DEFAULT_HEURISTIC_START, config.max_num_speculative_tokens)
    if not timings_choose_gamma(params):
        return FixedPolicy(SEEDED_AUTO_GAMMA)
    draft, speed = engine.draft, engine.measured_speed
    return CostModelPolicy(
        engine.target.forward_costs,
        draft.forward_costs if draft else [],
        config.max_num_speculative_tokens,
        acceptance=speed.request_acceptance(model_free=not (draft and draft.forward_costs)),
        target_scale=speed.target_scale,
        row_scales=speed.row_scales,
        draft_scale=speed.draft_scale,
        shared_acceptance=speed.acceptance,
        draft_exchange=speed.draft_exchange,
        # From what the deployment's rounds pay now, else the opening's transport. Not the opening's whole round
        # trip, as it was: under load that includes waiting behind other sessions' passes (hundreds of ms), which
        # made drafting look nearly free for a request's first rounds.
        overhead_ms=speed.round_overhead.value if speed.round_overhead.value is not None else opening_overhead_ms,
        shared_overhead=speed.round_overhead,
        peers=lambda: engine.running - 1,
        calibration=speed.calibration,
        draft_traits=speed.draft_traits,
    )


class RequestWorkers(RoundWorkers):
    """One request's sessions on the workers, as its rounds use them, and what happens when a worker fails.

    A failing or slow draft only costs speed: the request continues target-only (same output for greedy), and
    speculates again if a session can be reopened on a healthy draft worker. A failed target session is reopened
    with the prompt and every committed token re-prefilled, within the request's time limit; nothing already
    streamed is repeated or lost, since only committed tokens are ever streamed.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        params: GenerationParams,
        root: trace.Span,
        output: OutputTracker,
        deadline: float | None,
        max_tokens: int,
    ):
        self.engine = engine
        self.config = engine.config
        self.params = params
        self.root = root
        self.root_context = span_context(root)
        self.output = output
        self.deadline = deadline  # time.monotonic() when the caller stops waiting; None: it waits
        self.max_tokens = max_tokens  # what each session reserves on its worker
        self.target: TargetSession | None = None
        self.draft: DraftSession | None = None
        self.target_generation = 0
        self.reopened = 0  # target sessions reopened after a failure
        self.draft_reopens = 0  # draft sessions reopened after a failure
        self.fallback_reason = ""
        self.cached_prompt_tokens = 0  # of the prompt, reused from the target's prefix cache at the first opening
        self.prompt_logprobs = []  # the first opening's, when the request asked for them
        # A model draft whose opening waits until the gamma policy first wants to draft (see defers_draft), and
        # that opening while it runs behind the rounds, with the number of committed tokens it prefills.
        self.deferred_draft = False
        self.draft_opening: asyncio.Future | None = None
        self.draft_opened_on = 0

    @property
    def committed(self) -> list[int]:
        """The tokens the request has committed so far: what a reopened session is prefilled with after the prompt."""
        return self.output.token_ids

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def fall_back(self, reason: str, error: BaseException | None = None) -> None:
        """Continues without speculation: a span event, a metric (once per request), and a pause before that draft
        worker gets sessions again; another healthy one may take the request over (reopen_draft)."""
        detail = f"{type(error).__name__}: {error}" if error else reason
        if not self.fallback_reason:
            self.engine.metrics.record_fallback(reason)
        self.fallback_reason = self.fallback_reason or reason
        self.root.add_event("speculation.fallback", {"specdec.fallback.reason": reason, "exception.message": detail})
        if error is not None:
            log.warning("draft worker failed (%s); the request goes on without it", detail)
            if self.draft is not None and isinstance(error, TimeoutError | Unavailable):
                # Only a worker that is gone or too slow is paused for every request; an error of this session
                # alone (its input, its numerics) must not turn speculation off for the others.
                self.engine.workers.failed(self.draft, detail)
        if self.draft is not None:
            asyncio.ensure_future(close_all(self.draft))
        self.draft = None

    async def open_target(
        self, committed: list[int], parent: Context, first_error: BaseException | None = None, like: TargetSession | None = None
    ) -> None:
        """(Re)opens the target session on prompt + committed tokens, retrying with backoff within the time limit.
        like: the failed session it replaces (the new one runs the same model with the same numerics)."""
        # A long prompt's prefill (in chunks, between the other sessions' rounds) may take far longer than a round:
        # the opening gets the round deadline plus what the worker's measured cost says the prefill needs.
        prefill = prefill_allowance(self.engine.target.forward_costs, len(self.params.prompt_token_ids) + len(committed))
        open_timeout = self.config.target_timeout + prefill
        until = time.monotonic() + self.config.target_retry_window + prefill
        if self.deadline is not None:
            # Answer UNAVAILABLE a moment before the caller's own deadline, so it learns what failed.
            until = min(until, self.deadline - DEADLINE_MARGIN)
        delay, attempts, last_error = 0.1, 0, first_error
        while True:
            sampling = session_sampling(
                self.params.sampling, committed, derived_seed(self.params.sampling.seed, self.target_generation)
            )
            remaining = until - time.monotonic()
            try:
                opening = self.engine.workers.open_target(
                    self.params.prompt_token_ids + committed,
                    sampling,
                    self.config.num_p_entries,
                    parent,
                    like,
                    self.max_tokens,
                    self.params.logprobs,
                    self.params.prompt_logprobs and not committed,  # the first opening's prefill scores the prompt
                )
                self.target = await asyncio.wait_for(opening, max(0.05, min(remaining, open_timeout)))
                if not committed:
                    self.cached_prompt_tokens = self.target.reused_tokens
                    self.prompt_logprobs = getattr(self.target, "prompt_logprobs", [])
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

    async def open(self, parent: Context) -> None:
        """Opens (and prefills) both sessions concurrently. A draft that cannot open only turns speculation off."""
        # A request that only scores its prompt (max_new_tokens 0) has no round to draft for.
        wants_draft = self.params.num_speculative_tokens != 0 and self.params.max_new_tokens > 0
        use_draft = wants_draft and await self.engine.connect_draft()
        if wants_draft and not use_draft:
            self.fall_back("draft_unavailable" if self.engine.workers.has_draft else "no_draft_worker")
        if use_draft and self.defers_draft():
            self.deferred_draft, use_draft = True, False
        draft_opening = None
        if use_draft:
            draft_opening = asyncio.ensure_future(self.opening_draft([], self.params.sampling, parent))
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
                self.draft = await asyncio.wait_for(draft_opening, self.draft_open_timeout([]))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
                self.fall_back("draft_open_failed", error)

    def defers_draft(self) -> bool:
        """Whether the draft session opens only once the gamma policy first wants to draft, in the background, the
        rounds running target-only until it is open: for a model draft (opening it prefills the prompt on the
        draft worker) whose use the cost model decides. Opened with the target's, a model that the cost model
        prices out (on a CPU, a draft costing half a target step) still cost every request its prefill: awaited
        before the first round, and on cores shared with the target beside the target's own work (measured on the
        Qwen 1.5B's editing loop with the 0.5B `#int8` as its draft: 1.0-1.4 s of the draft's prefill in each
        request's opening against 0.3-0.7 s for the target's, and 0.79x target-only over the workload with two
        tokens drafted in all). Not with overlap, whose pre-drafts begin with the first round."""
        draft = self.engine.draft
        return bool(draft and draft.forward_costs) and timings_choose_gamma(self.params) and not self.params.overlap

    def begin_deferred_draft(self) -> None:
        """Starts opening the deferred draft session on the prompt and the tokens committed so far (once)."""
        if self.draft_opening is not None:
            return
        committed = list(self.committed)
        self.draft_opened_on = len(committed)
        self.root.add_event("draft.open", {"specdec.committed_tokens": len(committed)})
        self.draft_opening = asyncio.ensure_future(self.opening_draft(committed, self.params.sampling, self.root_context))

    def take_opened_draft(self) -> list[int] | None:
        """The deferred draft session once its opening has finished: it becomes the request's draft, and the
        tokens committed since the opening began (what it has not heard of) are returned. None while it is still
        opening, or when it failed: the request then goes on without a draft, as after a failed opening with the
        target's (deferred_draft is False and there is no draft)."""
        opening = self.draft_opening
        if opening is None or not opening.done():
            return None
        self.draft_opening, self.deferred_draft = None, False
        if opening.cancelled():  # its channel closed under it (a shutdown): a draft that failed to open
            self.fall_back("draft_open_failed")
            return None
        try:
            self.draft = opening.result()
        except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
            self.fall_back("draft_open_failed", error)
            return None
        return self.committed[self.draft_opened_on :]

    def draft_open_timeout(self, committed: list[int]) -> float:
        """The draft's round deadline, plus what its measured cost says the prompt's prefill needs (a model draft
        prefills a long prompt in chunks; one slower than a round is not a failed worker)."""
        costs = self.engine.draft.forward_costs if self.engine.draft else []
        return self.config.draft_timeout + prefill_allowance(costs, len(self.params.prompt_token_ids) + len(committed))

    def opening_draft(self, committed: list[int], sampling, parent: Context):
        """Opens a draft session on the prompt and the committed tokens; each draft worker tried gets
        draft_open_timeout to open it, and one that misses it is marked failed, so that a later opening does not
        pick it again. The deferred opening and reopen_draft await it with no deadline of their own: an outer one
        of the same length fires first and leaves the slow worker unmarked."""
        return self.engine.workers.open_draft(
            self.params.prompt_token_ids + committed,
            session_sampling(sampling, committed, sampling.seed),
            self.config.max_q_entries,
            parent,
            self.draft_open_timeout(committed),
            self.max_tokens,
        )

    async def reopen_draft(self) -> bool:
        """After a draft worker failed mid-request: a draft session on another healthy draft worker, prefilled with
        the prompt and every committed token, so that the request speculates again (a few tries per request)."""
        if self.draft_reopens >= self.config.max_draft_reopens or not self.engine.workers.draft_available():
            return False
        self.draft_reopens += 1
        sampling = replace(self.params.sampling, seed=derived_seed(self.params.sampling.seed, self.draft_reopens, "reopen-draft"))
        try:
            self.draft = await self.opening_draft(self.committed, sampling, self.root_context)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
            self.fall_back("draft_open_failed", error)
            return False
        self.root.add_event("draft.reopen", {"specdec.committed_tokens": len(self.committed)})
        return True

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

    async def verify(self, proposal: Proposal | None, parent: Context, decode_ahead: bool = False):
        """The target's verdict; a failed target session is reopened and the same proposal verified again."""
        drafted = proposal.token_ids if proposal else []
        dists = proposal.distributions if proposal else []
        while True:
            try:
                async with asyncio.timeout(self.config.target_timeout):
                    return await self.target.verify(drafted, dists, parent, decode_ahead)
            except (TimeoutError, Unavailable) as error:
                await self.reopen_target(error, parent)

    async def reopen_target(self, error: TimeoutError | Unavailable, parent: Context) -> None:
        """Replaces the failed target session by one prefilled with the prompt and the committed tokens."""
        detail = f"{type(error).__name__}: {error}"
        self.engine.workers.failed(self.target, detail)
        await close_all(self.target)
        if self.reopened >= self.config.max_target_retries:
            # A request whose rounds keep failing workers (a query of death) must not walk through the pool.
            raise Unavailable(f"target worker unavailable: {self.reopened} reopened sessions failed (last: {detail})") from None
        log.warning("target session failed (%s); reopening it on %d committed tokens", detail, len(self.committed))
        self.root.add_event("target.reopen", {"exception.message": detail})
        self.engine.metrics.reopened.add(1, {"gen_ai.request.model": self.engine.target.model_name})
        self.reopened += 1
        self.target_generation += 1
        await self.open_target(self.committed, parent, error, like=self.target)

    async def close(self) -> None:
        """Closes the sessions open now, and one still opening."""
        opening, self.draft_opening = self.draft_opening, None
        late = []
        if opening is not None:
            opening.cancel()
            late = await asyncio.gather(opening, return_exceptions=True)  # a session that opened meanwhile
        await close_all(self.target, self.draft, *late)


class RequestRun:
    """One request's loop: opens its sessions, runs speculation rounds until the output is finished, streams what
    they commit, and records the request (its span's attributes, round stats and metrics). Worker failures are
    handled by its RequestWorkers."""

    def __init__(
        self, engine: GenerationEngine, params: GenerationParams, root: trace.Span, started: float, time_limit: float | None
    ):
        self.engine = engine
        self.params = params
        self.root = root
        self.root_context = span_context(root)
        self.started = started
        deadline = time.monotonic() + time_limit if time_limit is not None else None
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
        if self.output.max_new_tokens == 0:  # nothing to generate: the prompt's prefill (and its logprobs) is the request
            self.output.finish_reason = generation_pb2.FINISH_REASON_LENGTH
        self.logprobs = []  # per committed output token, when the request asked for them
        # What each session reserves on its worker: every token the request may commit, and a round's drafted
        # tokens beyond them (with overlap's assumed token); a worker caps it at its context.
        max_gamma = (
            engine.config.max_num_speculative_tokens if params.num_speculative_tokens < 0 else params.num_speculative_tokens
        )
        max_tokens = len(params.prompt_token_ids) + self.output.max_new_tokens + max_gamma + 2
        self.workers = RequestWorkers(engine, params, root, self.output, deadline, max_tokens)
        self.totals, self.rounds = TimeSplit(), []  # the request's time split; its rounds' stats
        self.opened = started  # when the sessions began opening (set by events)
        self.first_token_at: float | None = None
        # The plan of the rounds, set once the sessions are open (open_sessions).
        self.policy = None
        self.speculating = self.overlap = self.behind_only = False
        self.sync, self.ready = DraftSync(), None  # what the draft has not heard of; a proposal drafted last round
        self.scored_ahead = False  # the round under way asked the target to score the next one's first token

    async def events(self):
        """Yields a Delta for each round that commits output, then the GenerationResult."""
        self.opened = time.perf_counter()
        try:  # from here on, whatever happens, both sessions are closed
            await self.open_sessions()
            round_start = time.perf_counter()
            while not self.output.finished:
                raise_if_cancelled()
                planned = await self.prepare_round()
                # A round whose first token the target scored ahead drafts nothing: its drafted tokens would run in
                # a pass of their own after that one. It only stops the run ahead; the next round drafts.
                gamma = 0 if self.scored_ahead else planned
                self.scored_ahead = self.decodes_ahead_after(planned)
                round_span = tracer().start_span("speculate", context=self.root_context, attributes={"specdec.gamma": gamma})
                try:
                    result = await speculation_round(
                        self.workers,
                        self.sync,
                        gamma,
                        self.ready,
                        self.pre_draft_gamma,
                        phases_under(round_span),
                        self.scored_ahead,
                        self.policy.trim,
                    )
                    delta = self.commit(result)
                    if delta is not None:
                        yield delta
                    # A round ends where the next begins, so the time spent streaming its delta counts in it.
                    round_end = time.perf_counter()
                    self.record_round(result, elapsed_us(round_start, round_end), round_span)
                    round_start = round_end
                finally:
                    round_span.end()
        finally:
            await self.close_sessions()
        yield self.finish()

    async def open_sessions(self) -> None:
        """Opens (and prefills) the sessions under the `prefill` span, then plans the rounds: the gamma policy, and
        whether they speculate and overlap."""
        with child_span("prefill", self.root_context) as parent:
            await self.workers.open(parent)
        self.totals.prefill_us = elapsed_us(self.opened)
        self.policy = gamma_policy_for(self.engine, self.params, self.workers.target.opening_overhead_us / 1e3)
        self.speculating = self.workers.has_draft or self.workers.deferred_draft
        self.overlap = self.params.overlap and self.speculating
        # With overlap a model draft drafts only behind verification: after a discarded pre-draft the target
        # verifies the pending token alone while the draft pre-drafts again (a model-free draft costs nothing
        # to ask, so it still drafts up front).
        self.behind_only = self.overlap and bool(self.engine.draft and self.engine.draft.forward_costs)

    async def prepare_round(self) -> int:
        """Readies the next round: a new draft session where the draft failed, the proposal drafted last round cut
        to the room left; returns how many tokens to draft up front (0: none, or `ready` is the proposal)."""
        workers = self.workers
        if self.speculating and not workers.has_draft:
            if workers.deferred_draft:
                unheard = workers.take_opened_draft()
                if unheard is not None:
                    self.sync, self.ready = DraftSync(), None
                    self.sync.commit_unheard(unheard)
                elif not workers.deferred_draft:
                    # It failed to open: no speculation for the rest of the request, as when an opening with the
                    # target's fails (reopening would prefill again in the foreground, what deferring avoids).
                    self.speculating = False
            elif await workers.reopen_draft():
                self.sync, self.ready = DraftSync(), None  # the new session holds every committed token
        room = self.output.remaining - 1
        if self.ready is not None:
            self.ready = truncated(self.ready, room)
        if workers.deferred_draft:
            # Not open yet: the first round the policy would draft opens it; rounds run target-only meanwhile.
            if self.policy.ask(room) > 0:
                workers.begin_deferred_draft()
            return 0
        if not workers.has_draft or self.behind_only or self.ready is not None:
            return 0
        return self.policy.ask(room)

    def decodes_ahead_after(self, gamma: int) -> bool:
        """Whether the target scores the next round's first token as soon as this round's verdict gives it
        (VerifyStep.decode_ahead): where the gamma policy drafts nothing now (nor was anything drafted for this
        round), so that the next round is expected not to draft either, and one is to come. Not with overlap,
        whose pre-drafts run behind rounds that draft nothing."""
        return (
            self.engine.config.decode_ahead
            and self.workers.target.decodes_ahead
            and gamma == 0
            and self.ready is None
            and not self.overlap
            and self.output.remaining > 1
        )

    def pre_draft_gamma(self, drafted: int) -> int:
        """Overlap: how many tokens to pre-draft behind the verification of a round that drafted `drafted`."""
        room = self.output.remaining - drafted - 2  # this round commits drafted + 1 at most
        return self.policy.choose(room, hidden_behind=drafted + 1) if self.overlap and room > 0 else 0

    def commit(self, result: RoundResult) -> Delta | None:
        """Takes in a round's result: what the policy learns, the tokens committed; returns what to stream (None
        when the round made no output visible yet, e.g. while a possible stop string is held back)."""
        self.ready = result.ready
        learn(self.policy, result)
        delta = self.output.add(result.committed)
        if self.params.logprobs is not None:
            # Aligned with the committed tokens; the output may have cut them at a stop.
            self.logprobs = (self.logprobs + result.verdict.logprobs)[: len(self.output.token_ids)]
            delta.logprobs = self.logprobs[len(self.output.token_ids) - len(delta.token_ids) :]
        if not (delta.token_ids or delta.text):
            return None
        if self.params.prompt_logprobs and self.first_token_at is None:
            delta.prompt_logprobs = self.workers.prompt_logprobs
        self.first_token_at = self.first_token_at or time.perf_counter()
        return delta

    def record_round(self, result: RoundResult, wall_us: int, round_span: trace.Span) -> None:
        """The round's stats: in the policy's overhead estimate, the request's totals, and its `speculate` span."""
        stats = round_stats(result, wall_us)
        self.policy.observe_overhead(*exchange_costs(result, stats))
        self.rounds.append(stats)
        self.totals.add(stats.time_split)
        if round_span.is_recording():
            round_span.set_attributes(stats.attributes())

    async def close_sessions(self) -> None:
        """Closes the sessions, even when the request is cancelled; the time it takes is the coordinator's."""
        closing = time.perf_counter()
        await asyncio.shield(self.workers.close())
        self.totals.coordinator_us += elapsed_us(closing)

    def finish(self) -> GenerationResult:
        """The request's result, also set on its span and recorded in the metrics."""
        finished = time.perf_counter()
        self.totals.total_us = elapsed_us(self.started, finished)
        self.totals.coordinator_us += elapsed_us(self.started, self.opened)
        result = self.result()
        self.root.set_attributes(self.result_attributes(result))
        self.engine.metrics.record_request(
            self.params, result, self.engine.target.model_name, self.first_token_at, self.started, finished
        )
        return result

    def result(self) -> GenerationResult:
        output = self.output
        return GenerationResult(
            text=output.text,
            token_ids=output.token_ids,
            finish_reason=output.finish_reason,
            prompt_tokens=len(self.params.prompt_token_ids),
            num_speculative_tokens=self.params.num_speculative_tokens if self.speculating else 0,
            rounds=self.rounds,
            time_split=self.totals,
            fallback_reason=self.workers.fallback_reason,
            overlap=self.overlap,
            cached_prompt_tokens=self.workers.cached_prompt_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.workers.prompt_logprobs,
        )

    def result_attributes(self, result: GenerationResult) -> dict:
        """The root span's attributes of the finished request."""
        return {
            "gen_ai.usage.output_tokens": len(result.token_ids),
            "specdec.cached_prompt_tokens": result.cached_prompt_tokens,
            "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES.get(result.finish_reason, "unknown")],
            "gen_ai.response.model": self.engine.target.model_name,
            "specdec.rounds": len(self.rounds),
            "specdec.drafted_tokens": result.drafted_tokens,
            "specdec.accepted_tokens": result.accepted_tokens,
            "specdec.overlapped_rounds": result.overlapped_rounds,
            "specdec.target.reopened_sessions": self.workers.reopened,
            **self.totals.attributes("specdec.time"),
        }


def learn(policy, result: RoundResult) -> None:
    """What the gamma policy learns from a round: the draft's speed, acceptance, and the target's batch."""
    verdict = result.verdict
    if result.exposed is not None:
        policy.observe_draft(len(result.exposed.token_ids), result.exposed.compute_us, result.exposed.batch_size)
    policy.observe(
        result.drafted, verdict.num_accepted, result.drafted + 1, verdict.compute_us, verdict.batch_size, verdict.batch_tokens
    )
    if result.pre is not None:
        policy.observe_draft(len(result.pre.token_ids) + 1, result.pre.compute_us, result.pre.batch_size)
    if result.proposal is not None and result.proposal.confidence:
        policy.observe_confidence(result.proposal.confidence, verdict.num_accepted)


def exchange_costs(result: RoundResult, stats: RoundStats) -> tuple[int, int | None]:
    """What the round paid beyond the target's work (its exchange and the coordinator), and what asking the draft
    cost beyond drafting (None when the round did not ask it): a round without drafting skips the second."""
    verify_work, _ = handling(result.verdict)
    beyond_verify = max(0, result.verify_rtt_us - verify_work)
    beyond_verify += max(0, result.pre_rtt_us - result.verify_rtt_us)  # a pre-draft that outlasted verification
    draft_exchange = result.draft_rtt_us - result.exposed.compute_us if result.exposed is not None else None
    return beyond_verify + stats.time_split.coordinator_us, draft_exchange


@contextlib.contextmanager
def child_span(name: str, parent: Context, **attributes):
    """A span under parent; its context is what the worker calls of this phase carry."""
    span = tracer().start_span(name, context=parent, attributes=attributes or None)
    try:
        yield span_context(span)
    finally:
        span.end()


def phases_under(round_span: trace.Span) -> Phase:
    """The round's phases (draft, verify) as child spans of its `speculate` span."""
    parent = span_context(round_span)

    def phase(name: str, gamma: int, overlapped: bool):
        if not overlapped:
            return child_span(name, parent)
        return child_span(name, parent, **{"specdec.overlapped": True, "specdec.gamma": gamma})

    return phase


async def close_all(*sessions) -> None:
    """Closes whichever of the sessions exist (exceptions, e.g. from a failed opening, are skipped)."""
    with contextlib.suppress(Exception):
        await asyncio.gather(
            *(s.close() for s in sessions if s is not None and not isinstance(s, BaseException)), return_exceptions=True
        )
