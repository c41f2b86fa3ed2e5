"""One request's sessions on the workers, as its rounds use them, and what happens when a worker fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from specdec.common.errors import Unavailable
from specdec.common.rounds import Proposal
from specdec.common.sampling import SamplingParams, stream_seed
from specdec.coordinator.output import OutputTracker
from specdec.coordinator.gamma_policy_factory import defers_draft
from specdec.coordinator.request_tracing import span_context
from specdec.coordinator.round import RoundWorkers
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.draft_state import DraftPhase, DraftState
from specdec.coordinator.workers import TargetSession, WorkerInfo

if TYPE_CHECKING:
    from specdec.coordinator.engine import GenerationEngine

log = logging.getLogger("specdec.coordinator")
DEADLINE_MARGIN = 0.25  # seconds


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


def target_opening_window(
    config: CoordinatorConfig, forward_costs: list[tuple[int, float]], tokens: int, deadline: float | None
) -> tuple[float, float]:
    """How long one try at opening a target session on `tokens` may take, and until when (time.monotonic()) it is
    retried. A long prompt's prefill (in chunks, between the other sessions' rounds) may take far longer than a
    round: the opening gets the round deadline plus what the worker's measured cost says the prefill needs."""
    prefill = prefill_allowance(forward_costs, tokens)
    until = time.monotonic() + config.target_retry_window + prefill
    if deadline is not None:
        # Answer UNAVAILABLE a moment before the caller's own deadline, so it learns what failed.
        until = min(until, deadline - DEADLINE_MARGIN)
    return config.target_timeout + prefill, until


def draft_open_timeout(config: CoordinatorConfig, draft: WorkerInfo | None, tokens: int) -> float:
    """The draft's round deadline, plus what its measured cost says a prefill of `tokens` needs (a model draft
    prefills a long prompt in chunks; one slower than a round is not a failed worker)."""
    return config.draft_timeout + prefill_allowance(draft.forward_costs if draft else [], tokens)


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
        self.draft = DraftState()
        self.target_generation = 0
        self.reopened = 0  # target sessions reopened after a failure
        self.fallback_reason = ""
        self.cached_prompt_tokens = 0  # of the prompt, reused from the target's prefix cache at the first opening
        self.prompt_logprobs = []  # the first opening's, when the request asked for them

    @property
    def committed(self) -> list[int]:
        """The tokens the request has committed so far: what a reopened session is prefilled with after the prompt."""
        return self.output.token_ids

    @property
    def has_draft(self) -> bool:
        return self.draft.is_open

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
            if self.draft.is_open and isinstance(error, TimeoutError | Unavailable):
                # Only a worker that is gone or too slow is paused for every request; an error of this session
                # alone (its input, its numerics) must not turn speculation off for the others.
                self.engine.workers.failed(self.draft.session, detail)
        if self.draft.is_open:
            asyncio.ensure_future(close_all(self.draft.lose()))

    async def open_target(
        self, committed: list[int], parent: Context, first_error: BaseException | None = None, like: TargetSession | None = None
    ) -> None:
        """(Re)opens the target session on prompt + committed tokens, retrying with backoff within the time limit.
        like: the failed session it replaces (the new one runs the same model with the same numerics)."""
        tokens = len(self.params.prompt_token_ids) + len(committed)
        open_timeout, until = target_opening_window(self.config, self.engine.target.forward_costs, tokens, self.deadline)
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
        if use_draft and defers_draft(self.engine.draft, self.params):
            self.draft.defer()
            use_draft = False
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
                self.draft.opened(await asyncio.wait_for(draft_opening, self.draft_open_timeout([])))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
                self.fall_back("draft_open_failed", error)

    def begin_deferred_draft(self) -> None:
        """Starts opening the deferred draft session on the prompt and the tokens committed so far (once)."""
        if self.draft.phase is not DraftPhase.DEFERRED:
            return
        committed = list(self.committed)
        self.root.add_event("draft.open", {"specdec.committed_tokens": len(committed)})
        opening = asyncio.ensure_future(self.opening_draft(committed, self.params.sampling, self.root_context))
        self.draft.begin_opening(opening, len(committed))

    def take_opened_draft(self) -> list[int] | None:
        """The deferred draft session once its opening has finished: it becomes the request's draft, and the
        tokens committed since the opening began (what it has not heard of) are returned. None while it is still
        opening, or when it failed: the request then goes on without a draft, as after a failed opening with the
        target's (the draft's phase is then none)."""
        opening = self.draft.opening
        if opening is None or not opening.done():
            return None
        if opening.cancelled():  # its channel closed under it (a shutdown): a draft that failed to open
            self.draft.give_up()
            self.fall_back("draft_open_failed")
            return None
        try:
            session = opening.result()
        except Exception as error:  # noqa: BLE001 - a draft that cannot open only costs speed
            self.draft.give_up()
            self.fall_back("draft_open_failed", error)
            return None
        self.draft.opened(session)
        return self.committed[self.draft.opened_on :]

    def draft_open_timeout(self, committed: list[int]) -> float:
        return draft_open_timeout(self.config, self.engine.draft, len(self.params.prompt_token_ids) + len(committed))

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

    async def resume_draft(self) -> list[int] | None:
        """A draft session newly open, and the committed tokens it has not heard of: one whose deferred opening has
        finished, or one reopened after a failure (it holds every committed token). None when there is none."""
        if self.draft.waiting:
            return self.take_opened_draft()
        if self.draft.failed and await self.reopen_draft():
            return []
        return None

    async def reopen_draft(self) -> bool:
        """After a draft worker failed mid-request: a draft session on another healthy draft worker, prefilled with
        the prompt and every committed token, so that the request speculates again (a few tries per request)."""
        if self.draft.reopens >= self.config.max_draft_reopens or not self.engine.workers.draft_available():
            return False
        self.draft.reopening()
        sampling = replace(self.params.sampling, seed=derived_seed(self.params.sampling.seed, self.draft.reopens, "reopen-draft"))
        try:
            self.draft.opened(await self.opening_draft(self.committed, sampling, self.root_context))
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
                return await self.draft.session.step(num_accepted, committed, g, parent, assume_accepted)
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
        opening = self.draft.take_opening()
        late = []
        if opening is not None:
            opening.cancel()
            late = await asyncio.gather(opening, return_exceptions=True)  # a session that opened meanwhile
        await close_all(self.target, self.draft.session, *late)


async def close_all(*sessions) -> None:
    """Closes whichever of the sessions exist (exceptions, e.g. from a failed opening, are skipped)."""
    with contextlib.suppress(Exception):
        await asyncio.gather(
            *(s.close() for s in sessions if s is not None and not isinstance(s, BaseException)), return_exceptions=True
        )
