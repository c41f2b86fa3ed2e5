"""Verification on the target model: one forward pass per round, the acceptance test, and the cache rollback.

The rounds of all sessions that are ready run as one batched forward pass (verify_batch); each session's
verdict depends only on its own tokens and random stream, never on what it was batched with. The engine knows
nothing of gRPC; target_worker.server translates protobuf to calls on it.
"""

import time
from dataclasses import dataclass, field

import torch

from opentelemetry.context import Context

from common.batched_forward import use_ragged_attention
from common.cached_sequence import CachedSequence, elapsed_us, forward_batch
from common.cost_curve import cheapest_rows, measure_forward_costs
from common.errors import FailedPrecondition, InvalidArgument
from common.models import LoadedModel
from common.rounds import Verdict
from common.sampling import (
    SamplingParams,
    SparseDistribution,
    logits_to_probs,
    make_generator,
    top_entries,
    verify_draft,
)
from common.sessions import SessionRegistry
from common.telemetry import tracer
from common.worker_metrics import WorkerMetrics
from common.validation import check_distribution, check_prompt, check_sampling, check_token_ids


@dataclass
class TargetSession:
    session_id: str
    sequence: CachedSequence
    params: SamplingParams
    generator: torch.Generator
    num_p_entries: int
    last_active: float = field(default_factory=time.monotonic)


@dataclass
class VerifyCall:
    """One session's round in a batch: its draft tokens, their q, and the trace context it belongs to."""

    session: TargetSession
    draft_tokens: list[int]
    draft_dists: list[SparseDistribution]
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0


@dataclass
class SessionOpened:
    session_id: str
    cached_tokens: int
    compute_us: int


class TargetEngine:
    def __init__(self, loaded: LoadedModel, max_sessions: int = 64, calibrate: bool = True):
        self.loaded = loaded
        use_ragged_attention(loaded.model)
        self.sessions: SessionRegistry[TargetSession] = SessionRegistry(max_sessions)
        self.metrics = WorkerMetrics("target", self.sessions)
        self.forward_costs = measure_forward_costs(loaded.model, loaded.vocab_size) if calibrate else []

    def open_session(
        self, prompt: list[int], params: SamplingParams, num_p_entries: int = 0
    ) -> tuple[TargetSession, SessionOpened]:
        check_prompt(prompt, self.loaded.vocab_size, self.loaded.max_context_length, "start.prompt_token_ids")
        check_sampling(params, "start.sampling")
        if num_p_entries < 0:
            raise InvalidArgument("start.num_p_entries", f"must be >= 0, got {num_p_entries}")
        session_id = self.sessions.reserve()
        start = time.perf_counter()
        sequence = CachedSequence(self.loaded.model, prompt)
        with tracer().start_as_current_span(
            "prefill", attributes={"specdec.worker": "target", "specdec.prompt_tokens": len(prompt)}
        ):
            sequence.prefill()
        self.metrics.record_forward("prefill", time.perf_counter() - start)
        session = TargetSession(session_id, sequence, params, make_generator(params.seed, "target"), num_p_entries)
        self.sessions.add(session_id, session)
        return session, SessionOpened(session_id, sequence.cache_len, elapsed_us(start))

    def check_step(self, session: TargetSession, draft_tokens: list[int], draft_dists: list[SparseDistribution]) -> None:
        vocab = self.loaded.vocab_size
        check_token_ids(draft_tokens, vocab, "step.draft_token_ids")
        if len(draft_dists) != len(draft_tokens):
            raise InvalidArgument(
                "step.draft_distributions", f"need one per drafted token ({len(draft_tokens)}), got {len(draft_dists)}"
            )
        for i, (token, dist) in enumerate(zip(draft_tokens, draft_dists, strict=True)):
            check_distribution(dist, token, vocab, f"step.draft_distributions[{i}]")
        limit = self.loaded.max_context_length
        if limit and len(session.sequence.tokens) + len(draft_tokens) + 1 > limit:
            raise InvalidArgument("step.draft_token_ids", f"the sequence would exceed the model's context of {limit} tokens")

    def verify(self, session: TargetSession, draft_tokens: list[int], draft_dists: list[SparseDistribution]) -> Verdict:
        """One session's round on its own (a batch of one)."""
        verdict = self.verify_batch([VerifyCall(session, draft_tokens, draft_dists)])[0]
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verdict | Exception]:
        """Scores every session's [pending, x1..xg] in one forward pass, then per session accepts a prefix and crops
        the rejected tail off its cache. A call that fails its checks gets its error; the others still run."""
        results: list[Verdict | Exception | None] = [None] * len(calls)
        ready = []
        for i, call in enumerate(calls):
            try:
                if call.session.session_id not in self.sessions.sessions:
                    raise FailedPrecondition("the session is closed")
                self.check_step(call.session, call.draft_tokens, call.draft_dists)
                ready.append(i)
            except Exception as error:  # noqa: BLE001 - one bad message fails its own stream only
                results[i] = error
        if not ready:
            return results
        feeds = [calls[i].session.sequence.pending() + calls[i].draft_tokens for i in ready]
        batch_tokens = sum(len(f) for f in feeds)
        start = time.perf_counter()
        spans = [
            tracer().start_span(
                "target.verify",
                context=calls[i].parent,
                attributes={
                    "specdec.gamma": len(calls[i].draft_tokens),
                    "specdec.batch_size": len(ready),
                    "specdec.batch_tokens": batch_tokens,
                },
            )
            for i in ready
        ]
        sequences = [calls[i].session.sequence for i in ready]
        keep = [len(calls[i].draft_tokens) + 1 for i in ready]
        padding = self.padding(batch_tokens)
        if padding:
            # More rows are cheaper than these on this device: pad with a throwaway sequence of its own.
            sequences, feeds, keep = [*sequences, CachedSequence(self.loaded.model, [])], [*feeds, [0] * padding], [*keep, 1]
        try:
            logits = forward_batch(sequences, feeds, keep)
        except BaseException:
            for span in spans:
                span.end()
            raise
        forward_us = elapsed_us(start)
        for i, span, rows in zip(ready, spans, logits, strict=False):
            try:
                verdict = self.decide(calls[i], rows, span)
            except Exception as error:  # noqa: BLE001 - fails this session's stream (and frees it), not the batch
                results[i] = error
                continue
            verdict.batch_size, verdict.batch_tokens = len(ready), batch_tokens
            verdict.compute_us += forward_us
            verdict.queue_us = calls[i].queue_us
            results[i] = verdict
        self.metrics.record_forward("verify", elapsed_us(start) / 1e6)
        return results

    def padding(self, tokens: int) -> int:
        if not getattr(self.loaded.model, "batch_invariant", True):
            return 0  # its sessions run one pass each: padding would be a pass of its own
        return cheapest_rows(self.forward_costs, tokens) - tokens

    def decide(self, call: VerifyCall, logits: torch.Tensor, span) -> Verdict:
        """The acceptance test on one session's scored rows, and the rollback of what it rejected."""
        session, draft_tokens = call.session, call.draft_tokens
        session.last_active = time.monotonic()
        start = time.perf_counter()
        gamma = len(draft_tokens)
        try:
            probs = logits_to_probs(logits, session.params)
            num_accepted, next_token = verify_draft(probs, draft_tokens, call.draft_dists, session.params, session.generator)
            draft_token_probs = probs[torch.arange(gamma), torch.tensor(draft_tokens, dtype=torch.long)].tolist()
            distributions = top_entries(probs, session.num_p_entries) if session.num_p_entries else []
            span.set_attributes({"specdec.accepted": num_accepted, "specdec.rollback": gamma - num_accepted})
        finally:
            span.end()
        compute_us = elapsed_us(start)
        sequence = session.sequence
        with tracer().start_as_current_span(
            "kv.rollback",
            context=call.parent,
            attributes={"specdec.worker": "target", "specdec.rollback": gamma - num_accepted},
        ):
            sync_start = time.perf_counter()
            sequence.rollback(len(sequence.tokens) + num_accepted)
            sync_us = elapsed_us(sync_start)
        self.metrics.record_rollback(sync_us / 1e6)
        sequence.tokens += draft_tokens[:num_accepted] + [next_token]
        return Verdict(num_accepted, next_token, gamma - num_accepted, draft_token_probs, distributions, compute_us, sync_us)

    def close_session(self, session: TargetSession) -> None:
        self.sessions.remove(session.session_id)

    def info(self) -> dict:
        loaded = self.loaded
        return {
            "model_name": loaded.name,
            "vocab_size": loaded.vocab_size,
            "tokenizer_fingerprint": loaded.tokenizer.fingerprint,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "max_context_length": loaded.max_context_length,
            "active_sessions": len(self.sessions),
            "max_sessions": self.sessions.max_sessions,
            "eos_token_ids": loaded.tokenizer.eos_token_ids,
            "forward_costs": self.forward_costs,
        }
