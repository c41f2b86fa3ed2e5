"""How the coordinator talks to the two workers: one open session per worker and request.

Each call takes the trace context (parent) of the coordinator span it belongs to, so that the worker's spans
join the request's trace under the right round.

Two implementations share one interface: gRPC streams to the worker services (coordinator.worker_clients), and
direct calls on in-process engines (coordinator.in_process), which runs the same speculation loop without
the network for tests and benchmarks.
"""

from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry.context import Context

from specdec.common.rounds import Proposal, Verdict
from specdec.common.sampling import SamplingParams, SparseDistribution


class IncompatibleWorkers(Exception):
    """The workers cannot work together (their tokenizers differ)."""


@dataclass
class WorkerInfo:
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    device: str
    dtype: str
    max_context_length: int
    active_sessions: int
    max_sessions: int
    eos_token_ids: list[int] = field(default_factory=list)
    forward_costs: list[tuple[int, float]] = field(default_factory=list)  # (tokens, ms), see worker.proto
    engine: str = ""  # "gguf" or "torch" (see worker.proto)
    max_kv_tokens: int = 0  # the KV-token budget of all its sessions (see worker.proto)
    reserved_kv_tokens: int = 0
    decodes_ahead: bool = False  # a target that takes decode_ahead (see worker.proto)
    prefix_cache_tokens: int = 0  # the most its prefix cache keeps (see worker.proto)
    prefix_cache_held_tokens: int = 0


class DraftSession(Protocol):
    prefill_us: int

    async def step(
        self,
        num_accepted: int,
        committed: list[int],
        num_tokens: int,
        parent: Context | None = None,
        assume_accepted: bool = False,
    ) -> Proposal: ...

    async def close(self) -> None: ...


class TargetSession(Protocol):
    prefill_us: int
    reused_tokens: int  # of the prompt, from the target's prefix cache (SessionStarted.reused_tokens)
    prompt_logprobs: list  # SessionStarted.prompt_logprobs (common.sampling.TokenLogprob)
    opening_overhead_us: int  # the opening's round trip beyond the worker's work and waiting
    # Its worker takes decode_ahead (GetInfoResponse.decodes_ahead). Asked of the session, not the deployment: a
    # pool may hold workers of other engines for a while (a rolling update), and one that refuses the flag would
    # fail the step.
    decodes_ahead: bool

    async def verify(
        self,
        draft_tokens: list[int],
        draft_dists: list[SparseDistribution],
        parent: Context | None = None,
        decode_ahead: bool = False,
    ) -> Verdict:
        """The target's verdict; decode_ahead: it then scores the next token at once (VerifyStep.decode_ahead)."""

    async def close(self) -> None: ...


class Workers(Protocol):
    has_draft: bool  # a draft worker is configured (it may still be down)

    async def target_info(self) -> WorkerInfo: ...

    async def draft_info(self) -> WorkerInfo | None: ...

    def draft_available(self) -> bool:
        """A draft worker can take a session now (one is healthy and not backing off after a failure)."""

    async def accept_tokenizer(self, fingerprint: str) -> None:
        """Only workers with this tokenizer get sessions; raises IncompatibleWorkers when none fits."""

    def failed(self, session, detail: str) -> None:
        """The session's worker failed it (an error, a missed deadline): it gets no new sessions for a while."""

    def status(self) -> list:
        """The worker pools (coordinator.pool.WorkerPool), for the status API and metrics."""

    async def open_target(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int,
        parent: Context | None = None,
        like: TargetSession | None = None,  # a failed session this one replaces: same model, same numerics
        max_tokens: int = 0,  # most tokens the session will hold, reserved on the worker (0: its context)
        logprobs: int | None = None,  # the committed tokens' log-probabilities, with this many alternatives
        prompt_logprobs: bool = False,  # the prompt's too (the session's prompt_logprobs)
    ) -> TargetSession: ...

    async def open_draft(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        parent: Context | None = None,
        timeout: float | None = None,  # per draft worker tried
        max_tokens: int = 0,  # as for open_target
    ) -> DraftSession: ...

    async def close(self) -> None: ...
