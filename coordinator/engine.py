"""The speculate-verify loop: one generation request is one session on each worker.

Per round (../design/round.md): the draft syncs the previous verdict and proposes g tokens with their q; the
target scores them in one pass and returns n accepted plus the next token; the committed tokens go through the
output tracker (EOS, stop strings, max_new_tokens) before anything is streamed. The engine knows nothing of
gRPC's server side; coordinator.server translates protobuf to calls on it.
"""

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator

from common.errors import InvalidArgument
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from coordinator.output import Delta, OutputTracker
from coordinator.workers import DraftSession, TargetSession, WorkerInfo, Workers


@dataclass
class GenerationParams:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class RoundRecord:
    """What one round did and where its time went (microseconds)."""

    gamma: int
    drafted: int
    accepted: int
    committed: int
    draft_us: int  # round trip to the draft worker
    verify_us: int  # round trip to the target worker
    draft_compute_us: int
    verify_compute_us: int
    sync_us: int  # cache rollback on both workers


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: int
    prompt_tokens: int
    num_speculative_tokens: int
    rounds: list[RoundRecord]
    prefill_us: int
    wall_us: int

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
    default_num_speculative_tokens: int | None = None  # None: 2 for prompt lookup, 4 for a model draft
    max_num_speculative_tokens: int = 16
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_q_entries: int = 64
    num_p_entries: int = 0


class GenerationEngine:
    def __init__(
        self, workers: Workers, tokenizer: Tokenizer, target: WorkerInfo, draft: WorkerInfo | None, config: CoordinatorConfig
    ):
        self.workers = workers
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.config = config

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

    async def open_sessions(self, params: GenerationParams) -> tuple[TargetSession, DraftSession | None]:
        """Opens (and prefills) both sessions concurrently; a failure closes whichever opened."""
        opening = [self.workers.open_target(params.prompt_token_ids, params.sampling, self.config.num_p_entries)]
        if params.num_speculative_tokens > 0 and self.draft is not None:
            opening.append(self.workers.open_draft(params.prompt_token_ids, params.sampling, self.config.max_q_entries))
        results = await asyncio.gather(*opening, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(r.close() for r in results if not isinstance(r, BaseException)), return_exceptions=True)
            raise errors[0]
        return results[0], (results[1] if len(results) > 1 else None)

    async def generate(self, params: GenerationParams) -> AsyncIterator[Delta | GenerationResult]:
        """Yields deltas as rounds commit tokens, then the GenerationResult."""
        self.check(params)
        started = time.perf_counter()
        context_room = (
            self.max_context_length - len(params.prompt_token_ids) if self.max_context_length else params.max_new_tokens
        )
        output = OutputTracker(
            self.tokenizer,
            max_new_tokens=min(params.max_new_tokens, context_room),
            stop=params.stop,
            eos_token_ids=self.target.eos_token_ids,
            ignore_eos=params.ignore_eos,
        )
        target, draft = await self.open_sessions(params)
        gamma = params.num_speculative_tokens if draft else 0
        rounds: list[RoundRecord] = []
        try:
            prefill_us = max(target.prefill_us, draft.prefill_us if draft else 0)
            # The verdict the draft has not heard of yet: accepted count of its last proposal, then committed tokens.
            unsent_accepted, unsent_committed = 0, []
            while not output.finished:
                g = min(gamma, output.remaining - 1)
                t0 = time.perf_counter()
                if draft is not None and g > 0:
                    proposal = await draft.step(unsent_accepted, unsent_committed, g)
                    unsent_accepted, unsent_committed = 0, []
                else:
                    proposal = None
                t1 = time.perf_counter()
                drafted = proposal.token_ids if proposal else []
                verdict = await target.verify(drafted, proposal.distributions if proposal else [])
                t2 = time.perf_counter()
                committed = drafted[: verdict.num_accepted] + [verdict.next_token]
                if proposal is not None:
                    unsent_accepted, unsent_committed = verdict.num_accepted, [verdict.next_token]
                else:
                    unsent_committed = unsent_committed + committed
                rounds.append(
                    RoundRecord(
                        gamma=g,
                        drafted=len(drafted),
                        accepted=verdict.num_accepted,
                        committed=len(committed),
                        draft_us=int((t1 - t0) * 1e6),
                        verify_us=int((t2 - t1) * 1e6),
                        draft_compute_us=proposal.compute_us if proposal else 0,
                        verify_compute_us=verdict.compute_us,
                        sync_us=verdict.sync_us + (proposal.sync_us if proposal else 0),
                    )
                )
                delta = output.add(committed)
                if delta.token_ids or delta.text:
                    yield delta
        finally:
            await asyncio.shield(close_all(target, draft))
        yield GenerationResult(
            text=output.text,
            token_ids=output.token_ids,
            finish_reason=output.finish_reason,
            prompt_tokens=len(params.prompt_token_ids),
            num_speculative_tokens=gamma,
            rounds=rounds,
            prefill_us=prefill_us,
            wall_us=int((time.perf_counter() - started) * 1e6),
        )

    async def generate_all(self, params: GenerationParams) -> GenerationResult:
        async for event in self.generate(params):
            if isinstance(event, GenerationResult):
                return event
        raise RuntimeError("generation ended without a result")


async def close_all(*sessions) -> None:
    with contextlib.suppress(Exception):
        await asyncio.gather(*(s.close() for s in sessions if s is not None), return_exceptions=True)
