"""The speculate-verify loop of one request: one generation request is one session on each worker.

Per round (docs/design/round.md): the draft syncs the previous verdict and proposes g tokens with their q; the
target scores them in one pass and returns n accepted plus the next token; the committed tokens go through the
output tracker (EOS, stop strings, max_new_tokens) before anything is streamed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from opentelemetry import trace

from specdec.common.telemetry import tracer
from specdec.common.timing import elapsed_us
from specdec.coordinator.output import Delta, OutputTracker
from specdec.coordinator.request_tracing import child_span, finished_attributes, phases_under, span_context
from specdec.coordinator.request_workers import RequestWorkers
from specdec.coordinator.round import (
    DraftSync,
    RoundResult,
    handling,
    raise_if_cancelled,
    round_stats,
    speculation_round,
    truncated,
)
from specdec.coordinator.types import GenerationParams, GenerationResult, RoundStats, TimeSplit
from specdec.v1 import generation_pb2

if TYPE_CHECKING:
    from specdec.coordinator.engine import GenerationEngine


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
        self.overlap = self.behind_only = False
        self.sync, self.ready = DraftSync(), None  # what the draft has not heard of; a proposal drafted last round
        self.scored_ahead = False  # the round under way asked the target to score the next one's first token

    @property
    def speculating(self) -> bool:
        """Whether the request speculates: it has a draft, or may have one again (see DraftState)."""
        return self.workers.draft.speculating

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
        self.policy = self.engine.policy_for(self.engine, self.params, self.workers.target.opening_overhead_us / 1e3)
        self.overlap = self.params.overlap and self.speculating
        # With overlap a model draft drafts only behind verification: after a discarded pre-draft the target
        # verifies the pending token alone while the draft pre-drafts again (a model-free draft costs nothing
        # to ask, so it still drafts up front).
        self.behind_only = self.overlap and bool(self.engine.draft and self.engine.draft.forward_costs)

    async def prepare_round(self) -> int:
        """Readies the next round: a new draft session where the draft failed or its deferred opening finished, the
        proposal drafted last round cut to the room left; returns how many tokens to draft up front (0: none, or
        `ready` is the proposal)."""
        unheard = await self.workers.resume_draft()
        if unheard is not None:  # a new draft session: it hears of what it missed with its first step
            self.sync, self.ready = DraftSync(), None
            self.sync.commit_unheard(unheard)
        room = self.output.remaining - 1
        if self.ready is not None:
            self.ready = truncated(self.ready, room)
        draft = self.workers.draft
        if draft.waiting:
            # Not open yet: the first round the policy would draft opens it; rounds run target-only meanwhile.
            if self.policy.ask(room) > 0:
                self.workers.begin_deferred_draft()
            return 0
        drafts_up_front = draft.is_open and not self.behind_only and self.ready is None
        return self.policy.ask(room) if drafts_up_front else 0

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
        self.policy.learn(result)
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
        self.root.set_attributes(finished_attributes(result, self.engine.target.model_name, self.workers.reopened))
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


def exchange_costs(result: RoundResult, stats: RoundStats) -> tuple[int, int | None]:
    """What the round paid beyond the target's work (its exchange and the coordinator), and what asking the draft
    cost beyond drafting (None when the round did not ask it): a round without drafting skips the second."""
    verify_work, _ = handling(result.verdict.timing)
    beyond_verify = max(0, result.verify_rtt_us - verify_work)
    beyond_verify += max(0, result.pre_rtt_us - result.verify_rtt_us)  # a pre-draft that outlasted verification
    draft_exchange = result.draft_rtt_us - result.exposed.timing.compute_us if result.exposed is not None else None
    return beyond_verify + stats.time_split.coordinator_us, draft_exchange
