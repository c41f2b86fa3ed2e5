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
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.errors import InvalidArgument
from common.rounds import Proposal
from common.sampling import SamplingParams
from common.telemetry import tracer
from common.tokenizer import Tokenizer
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import Delta, OutputTracker
from coordinator.workers import DraftSession, TargetSession, WorkerInfo, Workers
from specdec.v1 import generation_pb2

PROVIDER = "specdec"
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
    num_speculative_tokens: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    operation: str = "text_completion"  # GenAI operation name: "chat" for chat messages


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
    default_num_speculative_tokens: int | None = None  # None: 4 with a draft worker, 0 without
    max_num_speculative_tokens: int = 16
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_q_entries: int = 64
    num_p_entries: int = 0
    server_address: str = "localhost"
    server_port: int = 0


def elapsed_us(start: float, end: float) -> int:
    return int((end - start) * 1e6)


def round_split(proposal: Proposal | None, verdict, draft_rtt_us: int, verify_rtt_us: int, wall_us: int) -> TimeSplit:
    """A round's time by where it went: worker-reported compute and sync, the rest of each round trip is network."""
    draft_compute = proposal.compute_us if proposal else 0
    draft_sync = proposal.sync_us if proposal else 0
    return TimeSplit(
        draft_us=draft_compute,
        verify_us=verdict.compute_us,
        sync_us=draft_sync + verdict.sync_us,
        network_us=max(0, draft_rtt_us - draft_compute - draft_sync)
        + max(0, verify_rtt_us - verdict.compute_us - verdict.sync_us),
        coordinator_us=max(0, wall_us - draft_rtt_us - verify_rtt_us),
        total_us=wall_us,
    )


def span_context(span: trace.Span) -> Context:
    return trace.set_span_in_context(span)


class GenerationEngine:
    def __init__(
        self, workers: Workers, tokenizer: Tokenizer, target: WorkerInfo, draft: WorkerInfo | None, config: CoordinatorConfig
    ):
        self.workers = workers
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.config = config
        self.metrics = CoordinatorMetrics()

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

    async def open_sessions(self, params: GenerationParams, parent: Context) -> tuple[TargetSession, DraftSession | None]:
        """Opens (and prefills) both sessions concurrently; a failure closes whichever opened."""
        opening = [self.workers.open_target(params.prompt_token_ids, params.sampling, self.config.num_p_entries, parent)]
        if params.num_speculative_tokens > 0 and self.draft is not None:
            opening.append(self.workers.open_draft(params.prompt_token_ids, params.sampling, self.config.max_q_entries, parent))
        results = await asyncio.gather(*opening, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(r.close() for r in results if not isinstance(r, BaseException)), return_exceptions=True)
            raise errors[0]
        return results[0], (results[1] if len(results) > 1 else None)

    async def generate(self, params: GenerationParams, parent: Context | None = None) -> AsyncIterator[Delta | GenerationResult]:
        """Yields deltas as rounds commit tokens, then the GenerationResult."""
        started = time.perf_counter()
        self.check(params)
        root = tracer().start_span(
            f"{params.operation} {self.target.model_name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=self.root_attributes(params),
        )
        root_context = span_context(root)
        try:
            async for event in self.run_rounds(params, root, root_context, started):
                yield event
        except BaseException as error:
            root.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            root.set_attribute("error.type", type(error).__name__)
            raise
        finally:
            root.end()

    async def run_rounds(self, params: GenerationParams, root: trace.Span, root_context: Context, started: float):
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
        totals = TimeSplit()
        prefill_span = tracer().start_span("prefill", context=root_context)
        opened = time.perf_counter()
        try:
            target, draft = await self.open_sessions(params, span_context(prefill_span))
        finally:
            prefill_span.end()
        totals.prefill_us = elapsed_us(opened, time.perf_counter())
        if params.num_speculative_tokens > 0 and draft is None:
            self.metrics.record_fallback("no_draft_worker")
        gamma = params.num_speculative_tokens if draft else 0
        rounds: list[RoundRecord] = []
        first_token_at = None
        try:
            # The verdict the draft has not heard of yet: accepted count of its last proposal, then committed tokens.
            unsent_accepted, unsent_committed = 0, []
            round_start = time.perf_counter()
            while not output.finished:
                g = min(gamma, output.remaining - 1)
                round_span = tracer().start_span("speculate", context=root_context, attributes={"specdec.gamma": g})
                round_context = span_context(round_span)
                proposal = None
                t0 = time.perf_counter()
                if draft is not None and g > 0:
                    draft_span = tracer().start_span("draft", context=round_context)
                    try:
                        proposal = await draft.step(unsent_accepted, unsent_committed, g, span_context(draft_span))
                    finally:
                        draft_span.end()
                    unsent_accepted, unsent_committed = 0, []
                t1 = time.perf_counter()
                drafted = proposal.token_ids if proposal else []
                verify_span = tracer().start_span("verify", context=round_context)
                try:
                    verdict = await target.verify(drafted, proposal.distributions if proposal else [], span_context(verify_span))
                finally:
                    verify_span.end()
                t2 = time.perf_counter()
                committed = drafted[: verdict.num_accepted] + [verdict.next_token]
                if proposal is not None:
                    unsent_accepted, unsent_committed = verdict.num_accepted, [verdict.next_token]
                else:
                    unsent_committed = unsent_committed + committed
                delta = output.add(committed)
                if delta.token_ids or delta.text:
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    yield delta
                # A round ends where the next begins, so the time spent streaming its delta counts in it.
                round_end = time.perf_counter()
                record = RoundRecord(
                    gamma=g,
                    drafted=len(drafted),
                    accepted=verdict.num_accepted,
                    committed=len(committed),
                    time_split=round_split(
                        proposal, verdict, elapsed_us(t0, t1), elapsed_us(t1, t2), elapsed_us(round_start, round_end)
                    ),
                    bytes_sent=(proposal.bytes_sent if proposal else 0) + verdict.bytes_sent,
                    bytes_received=(proposal.bytes_received if proposal else 0) + verdict.bytes_received,
                )
                round_start = round_end
                rounds.append(record)
                totals.add(record.time_split)
                round_span.set_attributes(round_attributes(record))
                round_span.end()
        finally:
            closing = time.perf_counter()
            await asyncio.shield(close_all(target, draft))
            totals.coordinator_us += elapsed_us(closing, time.perf_counter())
        finished = time.perf_counter()
        totals.total_us = elapsed_us(started, finished)
        totals.coordinator_us += elapsed_us(started, opened)
        result = GenerationResult(
            text=output.text,
            token_ids=output.token_ids,
            finish_reason=output.finish_reason,
            prompt_tokens=len(params.prompt_token_ids),
            num_speculative_tokens=gamma,
            rounds=rounds,
            time_split=totals,
        )
        root.set_attributes(
            {
                "gen_ai.usage.output_tokens": len(output.token_ids),
                "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES.get(output.finish_reason, "unknown")],
                "gen_ai.response.model": self.target.model_name,
                "specdec.rounds": len(rounds),
                "specdec.drafted_tokens": result.drafted_tokens,
                "specdec.accepted_tokens": result.accepted_tokens,
                **totals.attributes("specdec.time"),
            }
        )
        self.metrics.record_request(params, result, self.target.model_name, first_token_at, started, finished)
        yield result

    async def generate_all(self, params: GenerationParams, parent: Context | None = None) -> GenerationResult:
        async for event in self.generate(params, parent):
            if isinstance(event, GenerationResult):
                return event
        raise RuntimeError("generation ended without a result")


def round_attributes(record: RoundRecord) -> dict:
    return {
        "specdec.gamma": record.gamma,
        "specdec.drafted": record.drafted,
        "specdec.accepted": record.accepted,
        "specdec.rollback": record.rollback,
        "specdec.committed": record.committed,
        "specdec.bytes_sent": record.bytes_sent,
        "specdec.bytes_received": record.bytes_received,
        **record.time_split.attributes("specdec.time"),
    }


async def close_all(*sessions) -> None:
    with contextlib.suppress(Exception):
        await asyncio.gather(*(s.close() for s in sessions if s is not None), return_exceptions=True)
