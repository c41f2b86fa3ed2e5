"""Drafting: a proposer (draft_worker.proposer) proposes gamma tokens per round with their q-distributions for
every session of the worker; the engine holds the sessions, checks each step, and runs steps in batches.

The engine knows nothing of gRPC; draft_worker.server translates protobuf to calls on it.
"""

import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from specdec.common.batcher import run_alone
from specdec.common.config import DraftWorkerConfig
from specdec.common.errors import InvalidArgument
from specdec.common.memory import kv_token_budget
from specdec.common.protocol import worker_info
from specdec.common.rounds import Proposal, WorkerTiming
from specdec.common.sampling import SamplingParams
from specdec.common.sessions import SessionRegistry, session_reservation
from specdec.common.telemetry import tracer
from specdec.common.timing import elapsed_us
from specdec.common.validation import MAX_TOKEN_ID, check_count, check_sampling, check_sampling_tokens
from specdec.common.wire_limits import MAX_Q_ENTRIES, MAX_STEP_TOKENS
from specdec.common.worker_engine import WorkerEngine
from specdec.draft_worker.proposer import DraftState, Proposer


@dataclass
class DraftSessionHandle:
    session_id: str
    state: DraftState
    last_active: float = field(default_factory=time.monotonic)
    prefill_us: int = 0  # the opening's compute, over its chunks


@dataclass
class DraftCall:
    """One session's step in a batch, per DraftStep (see draft.proto)."""

    handle: DraftSessionHandle
    num_accepted: int
    committed: list[int]
    num_tokens: int
    assume_accepted: bool = False
    parent: Context | None = None
    sync_us: int = 0
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0


class DraftEngine(WorkerEngine[DraftSessionHandle]):
    """Serves one proposer (a draft model, prompt lookup, suffix trees, or a hybrid) to many sessions."""

    def __init__(
        self,
        proposer: Proposer,
        name: str,
        max_sessions: int = DraftWorkerConfig.max_sessions,
        default_max_q_entries: int = DraftWorkerConfig.max_q_entries,
        max_kv_tokens: int | None = DraftWorkerConfig.max_kv_tokens,
        max_prefill_tokens: int = DraftWorkerConfig.max_prefill_tokens_per_pass,
    ):
        self.proposer = proposer
        self.max_prefill_tokens = max_prefill_tokens
        self.name = name
        self.default_max_q_entries = default_max_q_entries
        budget = max_kv_tokens or kv_token_budget(proposer.kv_bytes_per_token, proposer.device)
        super().__init__("draft", SessionRegistry(max_sessions, budget, proposer.prefixes))

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        return self.proposer.forward_costs

    def begin_session(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int = 0, max_tokens: int = 0
    ) -> DraftSessionHandle:
        """Checks the opening and reserves the session (and its max_tokens of the KV budget); its prompt is then
        prefilled by prefill_chunk, a chunk at a time, and the session added by finish_opening."""
        self.proposer.check_prompt(prompt)
        check_sampling(params, "start.sampling")
        check_sampling_tokens(params, prompt, self.proposer.vocab_size or MAX_TOKEN_ID, "start.sampling")
        check_count(max_q_entries, MAX_Q_ENTRIES, "start.max_q_entries")
        reservation = session_reservation(max_tokens, len(prompt), self.proposer.max_context_length)
        return self.reserve(
            reservation,
            lambda session_id: DraftSessionHandle(
                session_id, self.proposer.open(prompt, params, max_q_entries or self.default_max_q_entries, reservation)
            ),
        )

    def prefill_chunk(self, handle: DraftSessionHandle) -> bool:
        """Prefills the next max_prefill_tokens of the session's prompt (a pass of its own, between the batched
        steps of the other sessions: a long prompt delays each of their steps by one chunk at most); True once the
        whole prompt is cached."""
        start = time.perf_counter()
        state = handle.state
        with tracer().start_as_current_span(
            "prefill", attributes={"specdec.worker": "draft", "specdec.prompt_tokens": state.num_committed}
        ):
            done = self.proposer.prefill(state, self.max_prefill_tokens)
        handle.prefill_us += elapsed_us(start)
        self.metrics.record_forward("prefill", time.perf_counter() - start)
        return done

    def open_session(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int = 0, max_tokens: int = 0
    ) -> tuple[DraftSessionHandle, int, int]:
        """Opens and prefills one session at once; returns the session, the number of tokens prefilled, and the
        time it took (us)."""
        handle = self.begin_session(prompt, params, max_q_entries, max_tokens)
        try:
            while not self.prefill_chunk(handle):
                pass
            self.finish_opening(handle)
        except BaseException:
            self.abandon(handle)
            raise
        return handle, handle.state.cached, handle.prefill_us

    def step(
        self, handle: DraftSessionHandle, num_accepted: int, committed: list[int], num_tokens: int, assume_accepted: bool = False
    ) -> Proposal:
        """One session's step on its own (a batch of one)."""
        return run_alone(self.run_batch, DraftCall(handle, num_accepted, committed, num_tokens, assume_accepted))

    def check_call(self, call: "DraftCall") -> None:
        self.check_step(call)

    def check_step(self, call: "DraftCall") -> None:
        state = call.handle.state
        self.require_open(call.handle)
        if not 0 <= call.num_accepted <= len(state.chain):
            raise InvalidArgument("step.num_accepted", f"must be in [0, {len(state.chain)}], got {call.num_accepted}")
        if call.num_accepted and not call.committed:
            raise InvalidArgument("step.num_accepted", "must be 0 when no committed_token_ids come with it")
        check_count(call.num_tokens, MAX_STEP_TOKENS, "step.num_tokens")
        self.proposer.check_tokens(call.committed, "step.committed_token_ids")
        limit = state.max_tokens
        kept = call.num_accepted + len(call.committed) if call.committed else len(state.chain)
        if state.num_committed + kept + call.num_tokens + call.assume_accepted > limit:
            raise InvalidArgument(
                "step.num_tokens", f"the sequence would exceed the session's {limit} tokens (start.max_tokens, the context)"
            )

    def run_ready(self, calls: list["DraftCall"], ready: list[int], results: list) -> None:
        """The proposals of the calls that passed their checks (run_batch, by their indices in ready), into results:
        each session's previous outcome applied (crop the rejected drafts, append committed), then the k-th forward
        pass of every model session runs as one batch."""
        spans = {i: self.observed(calls[i]) for i in ready}
        start = time.perf_counter()
        states = [calls[i].handle.state for i in ready]
        proposals = self.proposer.propose(states, [(calls[i].num_tokens, calls[i].assume_accepted) for i in ready])
        compute_us = elapsed_us(start)
        for i, proposal in zip(ready, proposals, strict=True):
            if isinstance(proposal, Exception):
                spans[i].record_exception(proposal)
                spans[i].end()
                results[i] = proposal
                continue
            proposal.timing = WorkerTiming(compute_us, calls[i].sync_us, len(ready), queue_us=calls[i].queue_us)
            spans[i].set_attributes(
                {
                    "specdec.drafted": len(proposal.token_ids),
                    "specdec.batch_size": len(ready),
                    "specdec.draft_source": str(proposal.source),
                }
            )
            spans[i].end()
            results[i] = proposal
        self.metrics.record_forward("propose", compute_us / 1e6)

    def observed(self, call: "DraftCall"):
        """Applies the call's previous outcome to its session (the rollback); the span of its proposal, started."""
        call.handle.last_active = time.monotonic()
        with tracer().start_as_current_span(
            "kv.rollback", context=call.parent, attributes={"specdec.worker": "draft", "specdec.accepted": call.num_accepted}
        ):
            sync_start = time.perf_counter()
            if call.committed:  # else no verdict to apply: keep building on the chain
                self.proposer.observe(call.handle.state, call.num_accepted, call.committed)
            call.sync_us = elapsed_us(sync_start)
        self.metrics.record_rollback(call.sync_us / 1e6)
        return tracer().start_span(
            "draft.propose",
            context=call.parent,
            attributes={"specdec.gamma": call.num_tokens, "specdec.assume_accepted": call.assume_accepted},
        )

    def closed(self, handle: DraftSessionHandle) -> None:
        self.proposer.close(handle.state)

    def info(self) -> dict:
        proposer = self.proposer
        return worker_info(
            self.name,
            proposer.vocab_size,
            proposer.device,
            proposer.max_context_length,
            self.sessions,
            proposer.forward_costs,
            proposer.describe(),
        )
