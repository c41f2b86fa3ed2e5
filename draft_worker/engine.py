"""Drafting: a small model (or prompt lookup) proposes gamma tokens per round with their q-distributions.

The engine knows nothing of gRPC; draft_worker.server translates protobuf to calls on it.
"""

import functools
import time
from dataclasses import dataclass, field

import torch

from opentelemetry.context import Context

from common.batched_forward import as_sampling_input
from common.batcher import run_alone
from common.cached_sequence import CachedSequence, elapsed_us, forward_batch
from common.config import DraftWorkerConfig
from common.model_runner import ModelRunner
from common.errors import FailedPrecondition, InvalidArgument
from common.models import LoadedModel
from common.rounds import Proposal
from common.sampling import (
    SamplingParams,
    SparseDistribution,
    logits_to_probs,
    make_generator,
    sample_sparse,
    truncate_probs,
)
from common.memory import kv_token_budget
from common.sessions import SessionRegistry, session_reservation
from common.telemetry import tracer
from common.worker_metrics import WorkerMetrics
from common.validation import check_count, check_prompt, check_sampling, check_token_ids
from common.wire_limits import MAX_Q_ENTRIES, MAX_STEP_TOKENS
from draft_worker.ngram import NgramIndex

CERTAIN = torch.ones(1)
# Prompt lookup has no model context; its index holds a few entries per token, so a session's length is bounded
# here (above every target's context the project serves) rather than by the 16 MiB message size.
NGRAM_MAX_CONTEXT = 131_072
# What a token costs prompt lookup's index: a few dictionary entries keyed by tuples (measured: 0.28 KB at max=3).
NGRAM_BYTES_PER_TOKEN = 512


class ModelDraftSession:
    """Per round.md: after proposing x1..xg the cache holds S + x1..x(g-1); a sync crops the rejected ones.

    The chain holds what the draft proposed (and, with overlap, assumed) since the last sync, in order; a sync
    keeps its first num_accepted tokens. A step is a few forward passes, driven one at a time by DraftEngine so
    that the passes of all sessions in a batch run together: next_feed() says what to feed, consume() takes the
    logits and samples.
    """

    def __init__(
        self, runner: ModelRunner, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int | None = None
    ):
        self.sequence = CachedSequence(runner, prompt, max_tokens)
        self.params = params
        self.generator = make_generator(params.seed, "draft")
        self.max_q_entries = max_q_entries
        self.chain: list[int] = []
        self.start_step(0, False)

    @property
    def tokens(self) -> list[int]:
        return self.sequence.tokens

    @property
    def num_committed(self) -> int:
        return len(self.sequence.tokens)

    @property
    def max_tokens(self) -> int:
        return self.sequence.max_tokens

    def prefill(self, max_tokens: int | None = None) -> bool:
        """The next chunk of the prompt (all of it without max_tokens); True once it is cached."""
        return self.sequence.prefill(max_tokens)

    @property
    def cached(self) -> int:
        return self.sequence.cache_len

    def sync(self, num_accepted: int, committed: list[int]) -> None:
        sequence = self.sequence
        sequence.rollback(len(sequence.tokens) + num_accepted)
        sequence.tokens += self.chain[:num_accepted] + committed
        self.chain = []

    def start_step(self, num_tokens: int, assume_accepted: bool) -> None:
        self.remaining = num_tokens
        self.guessing = assume_accepted and num_tokens > 0
        self.proposal = Proposal([], [])

    def next_feed(self) -> list[int] | None:
        """The tokens of the next forward pass (everything of S + chain not yet cached), or None when done."""
        if self.remaining == 0:
            return None
        return (self.sequence.tokens + self.chain)[self.sequence.cache_len :]

    def consume(self, logits: torch.Tensor) -> None:
        if self.guessing:
            # The target's bonus token is unknown while it verifies: stand in the draft's likeliest token.
            token = int(logits.argmax())
            self.proposal.assumed_token = token
            self.guessing = False
        else:
            q = truncate_probs(logits_to_probs(as_sampling_input(logits), self.params), self.max_q_entries)
            token = sample_sparse(q, self.generator)
            self.proposal.token_ids.append(token)
            self.proposal.distributions.append(q)
            self.remaining -= 1
        self.chain.append(token)


class NgramDraftSession:
    """Model-free: proposals are deterministic, so each q is a point mass (q = 1) and the rejection rule stays exact."""

    def __init__(self, prompt: list[int], max_n: int, min_n: int, max_tokens: int = NGRAM_MAX_CONTEXT):
        self.index = NgramIndex(prompt, max_n, min_n)  # committed tokens, then the chain
        self.committed = len(prompt)
        self.max_tokens = max_tokens

    @property
    def chain(self) -> list[int]:
        """Tokens proposed (and assumed) since the last sync."""
        return self.index.tokens[self.committed :]

    @property
    def num_committed(self) -> int:
        return self.committed

    def prefill(self, max_tokens: int | None = None) -> bool:
        return True  # the index was built with the session

    cached = 0

    def sync(self, num_accepted: int, committed: list[int]) -> None:
        self.index.truncate(self.committed + num_accepted)
        self.index.extend(committed)
        self.committed = len(self.index.tokens)
        self.index.keep(self.committed)

    def propose(self, num_tokens: int, assume_accepted: bool) -> Proposal:
        """With assume_accepted the lookup's first token stands in for the target's bonus token."""
        found = self.index.continuation(num_tokens + assume_accepted)
        self.index.extend(found)
        proposal = Proposal([], [])
        if assume_accepted:
            if not found:
                return proposal
            proposal.assumed_token, found = found[0], found[1:]
        proposal.token_ids = found
        proposal.distributions = [point_mass(t) for t in found]
        return proposal


@functools.lru_cache(maxsize=1 << 16)
def point_mass(token: int) -> SparseDistribution:
    """q of a deterministic proposal. Cached: its tensors are never written, and a round then creates none."""
    return SparseDistribution(torch.tensor([token]), CERTAIN)


DraftSession = ModelDraftSession | NgramDraftSession


@dataclass
class DraftSessionHandle:
    session_id: str
    state: DraftSession
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


class DraftEngine:
    """Serves a draft model, or the prompt-lookup proposer when loaded is None."""

    def __init__(
        self,
        loaded: LoadedModel | None,
        name: str,
        ngram: tuple[int, int] = (3, 1),
        max_sessions: int = DraftWorkerConfig.max_sessions,
        default_max_q_entries: int = DraftWorkerConfig.max_q_entries,
        calibrate: bool = True,
        max_kv_tokens: int | None = DraftWorkerConfig.max_kv_tokens,
        max_prefill_tokens: int = DraftWorkerConfig.max_prefill_tokens_per_pass,
    ):
        self.loaded = loaded
        self.max_prefill_tokens = max_prefill_tokens
        self.forward_costs = loaded.runner.cost_curve(loaded.vocab_size) if loaded and calibrate else []
        self.name = name
        self.ngram = ngram
        self.default_max_q_entries = default_max_q_entries
        per_token = loaded.runner.kv_bytes_per_token if loaded else NGRAM_BYTES_PER_TOKEN
        budget = max_kv_tokens or kv_token_budget(per_token, str(loaded.device) if loaded else "cpu")
        self.sessions: SessionRegistry[DraftSessionHandle] = SessionRegistry(max_sessions, budget)
        self.metrics = WorkerMetrics("draft", self.sessions)

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size if self.loaded else 0

    @property
    def max_context_length(self) -> int:
        return self.loaded.max_context_length if self.loaded else NGRAM_MAX_CONTEXT

    def begin_session(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int = 0, max_tokens: int = 0
    ) -> DraftSessionHandle:
        """Checks the opening and reserves the session (and its max_tokens of the KV budget); its prompt is then
        prefilled by prefill_chunk, a chunk at a time, and the session added by finish_opening."""
        if self.loaded:
            check_prompt(prompt, self.vocab_size, self.max_context_length, "start.prompt_token_ids")
        elif not prompt:
            raise InvalidArgument("start.prompt_token_ids", "must not be empty")
        elif len(prompt) >= NGRAM_MAX_CONTEXT:
            raise InvalidArgument(
                "start.prompt_token_ids", f"{len(prompt)} tokens: prompt lookup holds at most {NGRAM_MAX_CONTEXT}"
            )
        check_sampling(params, "start.sampling")
        check_count(max_q_entries, MAX_Q_ENTRIES, "start.max_q_entries")
        reservation = session_reservation(max_tokens, len(prompt), self.max_context_length)
        session_id = self.sessions.reserve(reservation)
        try:
            if self.loaded:
                q_entries = max_q_entries or self.default_max_q_entries
                state = ModelDraftSession(self.loaded.runner, prompt, params, q_entries, reservation)
            else:
                state = NgramDraftSession(prompt, *self.ngram, reservation)
        except BaseException:
            self.sessions.release(session_id)
            raise
        return DraftSessionHandle(session_id, state)

    def prefill_chunk(self, handle: DraftSessionHandle) -> bool:
        """Prefills the next max_prefill_tokens of the session's prompt (a pass of its own, between the batched
        steps of the other sessions: a long prompt delays each of their steps by one chunk at most); True once the
        whole prompt is cached."""
        start = time.perf_counter()
        state = handle.state
        with tracer().start_as_current_span(
            "prefill", attributes={"specdec.worker": "draft", "specdec.prompt_tokens": state.num_committed}
        ):
            done = state.prefill(self.max_prefill_tokens)
        handle.prefill_us += elapsed_us(start)
        self.metrics.record_forward("prefill", time.perf_counter() - start)
        return done

    def finish_opening(self, handle: DraftSessionHandle) -> None:
        """Adds the prefilled session; FailedPrecondition when its reservation was released meanwhile."""
        if not self.sessions.add(handle.session_id, handle):
            raise FailedPrecondition("the opening was abandoned")

    def abandon(self, handle: DraftSessionHandle) -> None:
        """Frees a session whose opening failed or was cancelled, prefilled or not."""
        self.sessions.release(handle.session_id)

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
        return run_alone(self.step_batch, DraftCall(handle, num_accepted, committed, num_tokens, assume_accepted))

    def check_step(self, call: "DraftCall") -> None:
        handle, state = call.handle, call.handle.state
        if handle.session_id not in self.sessions.sessions:
            raise FailedPrecondition("the session is closed")
        if not 0 <= call.num_accepted <= len(state.chain):
            raise InvalidArgument("step.num_accepted", f"must be in [0, {len(state.chain)}], got {call.num_accepted}")
        if call.num_accepted and not call.committed:
            raise InvalidArgument("step.num_accepted", "must be 0 when no committed_token_ids come with it")
        check_count(call.num_tokens, MAX_STEP_TOKENS, "step.num_tokens")
        if self.loaded:
            check_token_ids(call.committed, self.vocab_size, "step.committed_token_ids")
        limit = state.max_tokens
        kept = call.num_accepted + len(call.committed) if call.committed else len(state.chain)
        if state.num_committed + kept + call.num_tokens + call.assume_accepted > limit:
            raise InvalidArgument(
                "step.num_tokens", f"the sequence would exceed the session's {limit} tokens (start.max_tokens, the context)"
            )

    def step_batch(self, calls: list["DraftCall"]) -> list[Proposal | Exception]:
        """Applies each session's previous outcome (crop the rejected drafts, append committed), then proposes for
        all of them: the k-th forward pass of every model session runs as one batch. A call that fails its checks
        gets its error; the others still run."""
        results: list[Proposal | Exception | None] = [None] * len(calls)
        ready = []
        for i, call in enumerate(calls):
            try:
                self.check_step(call)
                ready.append(i)
            except Exception as error:  # noqa: BLE001 - one bad message fails its own stream only
                results[i] = error
        spans = {}
        for i in ready:
            call = calls[i]
            call.handle.last_active = time.monotonic()
            with tracer().start_as_current_span(
                "kv.rollback", context=call.parent, attributes={"specdec.worker": "draft", "specdec.accepted": call.num_accepted}
            ):
                sync_start = time.perf_counter()
                if call.committed:  # else no verdict to apply: keep building on the chain
                    call.handle.state.sync(call.num_accepted, call.committed)
                call.sync_us = elapsed_us(sync_start)
            self.metrics.record_rollback(call.sync_us / 1e6)
            spans[i] = tracer().start_span(
                "draft.propose",
                context=call.parent,
                attributes={"specdec.gamma": call.num_tokens, "specdec.assume_accepted": call.assume_accepted},
            )
        start = time.perf_counter()
        if self.loaded:
            states = [calls[i].handle.state for i in ready]
            for state, i in zip(states, ready, strict=True):
                state.start_step(calls[i].num_tokens, calls[i].assume_accepted)
            failed = self.run_model_steps(states)
            proposals = [failed.get(n, state.proposal) for n, state in enumerate(states)]
        else:
            proposals = [calls[i].handle.state.propose(calls[i].num_tokens, calls[i].assume_accepted) for i in ready]
        compute_us = elapsed_us(start)
        for i, proposal in zip(ready, proposals, strict=True):
            if isinstance(proposal, Exception):
                spans[i].record_exception(proposal)
                spans[i].end()
                results[i] = proposal
                continue
            proposal.compute_us, proposal.sync_us, proposal.batch_size = compute_us, calls[i].sync_us, len(ready)
            proposal.queue_us = calls[i].queue_us
            spans[i].set_attributes({"specdec.drafted": len(proposal.token_ids), "specdec.batch_size": len(ready)})
            spans[i].end()
            results[i] = proposal
        if ready:
            self.metrics.record_forward("propose", compute_us / 1e6)
        return results

    def run_model_steps(self, states: list[ModelDraftSession]) -> dict[int, Exception]:
        """Forward passes until every session has proposed its tokens; each pass batches all unfinished sessions.
        A session whose sampling fails drops out with its error (by index in states); the others go on."""
        failed: dict[int, Exception] = {}
        while True:
            feeds = [(n, state.next_feed()) for n, state in enumerate(states) if n not in failed]
            feeds = [(n, feed) for n, feed in feeds if feed is not None]
            if not feeds:
                return failed
            logits = forward_batch([states[n].sequence for n, _ in feeds], [f for _, f in feeds], [1] * len(feeds))
            for (n, _), rows in zip(feeds, logits, strict=True):
                try:
                    states[n].consume(rows[-1])
                except Exception as error:  # noqa: BLE001 - fails this session's stream (and frees it), not the batch
                    failed[n] = error

    def close_session(self, handle: DraftSessionHandle) -> None:
        self.sessions.remove(handle.session_id)

    def info(self) -> dict:
        loaded = self.loaded
        return {
            "model_name": self.name,
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": loaded.tokenizer.fingerprint if loaded else "",
            "device": str(loaded.device) if loaded else "cpu",
            "dtype": str(loaded.dtype).removeprefix("torch.") if loaded else "",
            "max_context_length": self.max_context_length,
            "active_sessions": len(self.sessions),
            "max_sessions": self.sessions.max_sessions,
            "max_kv_tokens": self.sessions.max_kv_tokens or 0,
            "reserved_kv_tokens": self.sessions.reserved_kv_tokens,
            "eos_token_ids": loaded.tokenizer.eos_token_ids if loaded else [],
            "forward_costs": self.forward_costs,
            "engine": loaded.engine if loaded else "",
        }
