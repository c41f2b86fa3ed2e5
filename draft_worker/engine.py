"""Drafting: a small model (or prompt lookup) proposes gamma tokens per round with their q-distributions.

The engine knows nothing of gRPC; draft_worker.server translates protobuf to calls on it.
"""

import time
from dataclasses import dataclass, field

import torch

from common.cached_sequence import CachedSequence, elapsed_us
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
from common.sessions import SessionRegistry
from common.telemetry import tracer
from common.worker_metrics import WorkerMetrics
from common.validation import check_prompt, check_sampling, check_token_ids
from draft_worker.ngram import find_continuation

DEFAULT_MAX_Q_ENTRIES = 64
CERTAIN = torch.ones(1)


class ModelDraftSession:
    """Per round.md: after proposing x1..xg the cache holds S + x1..x(g-1); a sync crops the rejected ones."""

    def __init__(self, model: torch.nn.Module, prompt: list[int], params: SamplingParams, max_q_entries: int):
        self.sequence = CachedSequence(model, prompt)
        self.params = params
        self.generator = make_generator(params.seed, "draft")
        self.max_q_entries = max_q_entries
        self.proposal: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self.sequence.tokens

    def prefill(self) -> int:
        self.sequence.prefill()
        return self.sequence.cache_len

    def sync(self, num_accepted: int, committed: list[int]) -> None:
        sequence = self.sequence
        sequence.rollback(len(sequence.tokens) + num_accepted)
        sequence.tokens += self.proposal[:num_accepted] + committed
        self.proposal = []

    def propose(self, num_tokens: int) -> Proposal:
        tokens, dists = [], []
        feed = self.sequence.pending()
        for _ in range(num_tokens):
            logits = self.sequence.forward(feed, 1)[-1]
            q = truncate_probs(logits_to_probs(logits, self.params), self.max_q_entries)
            token = sample_sparse(q, self.generator)
            tokens.append(token)
            dists.append(q)
            feed = [token]
        self.proposal = tokens
        return Proposal(tokens, dists)


class NgramDraftSession:
    """Model-free: proposals are deterministic, so each q is a point mass (q = 1) and the rejection rule stays exact."""

    def __init__(self, prompt: list[int], max_n: int, min_n: int):
        self.tokens = list(prompt)
        self.max_n, self.min_n = max_n, min_n
        self.proposal: list[int] = []

    def prefill(self) -> int:
        return 0

    def sync(self, num_accepted: int, committed: list[int]) -> None:
        self.tokens += self.proposal[:num_accepted] + committed
        self.proposal = []

    def propose(self, num_tokens: int) -> Proposal:
        self.proposal = find_continuation(self.tokens, num_tokens, self.max_n, self.min_n)
        dists = [SparseDistribution(torch.tensor([t]), CERTAIN) for t in self.proposal]
        return Proposal(list(self.proposal), dists)


DraftSession = ModelDraftSession | NgramDraftSession


@dataclass
class DraftSessionHandle:
    session_id: str
    state: DraftSession
    last_active: float = field(default_factory=time.monotonic)


class DraftEngine:
    """Serves a draft model, or the prompt-lookup proposer when loaded is None."""

    def __init__(
        self,
        loaded: LoadedModel | None,
        name: str,
        ngram: tuple[int, int] = (3, 1),
        max_sessions: int = 64,
        default_max_q_entries: int = DEFAULT_MAX_Q_ENTRIES,
    ):
        self.loaded = loaded
        self.name = name
        self.ngram = ngram
        self.default_max_q_entries = default_max_q_entries
        self.sessions: SessionRegistry[DraftSessionHandle] = SessionRegistry(max_sessions)
        self.metrics = WorkerMetrics("draft", self.sessions)

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size if self.loaded else 0

    @property
    def max_context_length(self) -> int:
        return self.loaded.max_context_length if self.loaded else 0

    def open_session(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int = 0
    ) -> tuple[DraftSessionHandle, int, int]:
        """Returns the session, the number of tokens prefilled, and the time it took (us)."""
        if self.loaded:
            check_prompt(prompt, self.vocab_size, self.max_context_length, "start.prompt_token_ids")
        elif not prompt:
            raise InvalidArgument("start.prompt_token_ids", "must not be empty")
        check_sampling(params, "start.sampling")
        if max_q_entries < 0:
            raise InvalidArgument("start.max_q_entries", f"must be >= 0, got {max_q_entries}")
        session_id = self.sessions.reserve()
        start = time.perf_counter()
        if self.loaded:
            state = ModelDraftSession(self.loaded.model, prompt, params, max_q_entries or self.default_max_q_entries)
        else:
            state = NgramDraftSession(prompt, *self.ngram)
        with tracer().start_as_current_span(
            "prefill", attributes={"specdec.worker": "draft", "specdec.prompt_tokens": len(prompt)}
        ):
            cached = state.prefill()
        self.metrics.record_forward("prefill", time.perf_counter() - start)
        handle = DraftSessionHandle(session_id, state)
        self.sessions.add(session_id, handle)
        return handle, cached, elapsed_us(start)

    def step(self, handle: DraftSessionHandle, num_accepted: int, committed: list[int], num_tokens: int) -> Proposal:
        """Applies the previous round's outcome (crop the rejected drafts, append committed), then proposes."""
        if handle.session_id not in self.sessions.sessions:
            raise FailedPrecondition("the session is closed")
        state = handle.state
        if not 0 <= num_accepted <= len(state.proposal):
            raise InvalidArgument("step.num_accepted", f"must be in [0, {len(state.proposal)}], got {num_accepted}")
        if num_tokens < 0:
            raise InvalidArgument("step.num_tokens", f"must be >= 0, got {num_tokens}")
        if self.loaded:
            check_token_ids(committed, self.vocab_size, "step.committed_token_ids")
            limit = self.max_context_length
            if limit and len(state.tokens) + num_accepted + len(committed) + num_tokens > limit:
                raise InvalidArgument("step.num_tokens", f"the sequence would exceed the draft's context of {limit} tokens")
        handle.last_active = time.monotonic()
        with tracer().start_as_current_span(
            "kv.rollback", attributes={"specdec.worker": "draft", "specdec.accepted": num_accepted}
        ):
            sync_start = time.perf_counter()
            state.sync(num_accepted, committed)
            sync_us = elapsed_us(sync_start)
        self.metrics.record_rollback(sync_us / 1e6)
        start = time.perf_counter()
        with tracer().start_as_current_span("draft.propose", attributes={"specdec.gamma": num_tokens}) as span:
            proposal = state.propose(num_tokens) if num_tokens else Proposal([], [])
            span.set_attribute("specdec.drafted", len(proposal.token_ids))
        proposal.compute_us, proposal.sync_us = elapsed_us(start), sync_us
        self.metrics.record_forward("propose", proposal.compute_us / 1e6)
        return proposal

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
            "eos_token_ids": loaded.tokenizer.eos_token_ids if loaded else [],
        }
