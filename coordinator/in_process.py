"""Workers as in-process engines: the speculation loop without gRPC, to isolate the cost of the split."""

from opentelemetry.context import Context

from specdec.common.rounds import Proposal, Verdict
from specdec.common.sampling import SamplingParams, SparseDistribution
from specdec.common.telemetry import call_in_context
from specdec.coordinator.workers import DraftSession, TargetSession, WorkerInfo
from specdec.draft_worker.engine import DraftEngine, DraftSessionHandle
from specdec.target_worker.engine import TargetEngine


class InProcessTargetSession:
    def __init__(
        self,
        engine: TargetEngine,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int,
        parent: Context | None,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ):
        self.engine = engine
        self.session, opened = call_in_context(
            parent, engine.open_session, prompt, params, num_p_entries, max_tokens, logprobs, prompt_logprobs
        )
        self.prefill_us = opened.compute_us
        self.reused_tokens = opened.reused_tokens
        self.prompt_logprobs = opened.prompt_logprobs
        self.opening_overhead_us = 0  # no transport
        self.decodes_ahead = False  # in process there is no exchange for a pass to hide behind

    async def verify(
        self,
        draft_tokens: list[int],
        draft_dists: list[SparseDistribution],
        parent: Context | None = None,
        decode_ahead: bool = False,
    ) -> Verdict:
        return call_in_context(parent, self.engine.verify, self.session, draft_tokens, draft_dists)

    async def close(self) -> None:
        self.engine.close_session(self.session)


class InProcessDraftSession:
    member = None  # not on a pool: a failure pauses no worker

    def __init__(self, engine: DraftEngine, handle: DraftSessionHandle, prefill_us: int):
        self.engine, self.handle, self.prefill_us = engine, handle, prefill_us

    @classmethod
    def open(
        cls,
        engine: DraftEngine,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        parent: Context | None,
        max_tokens: int = 0,
    ) -> "InProcessDraftSession":
        handle, _, prefill_us = call_in_context(parent, engine.open_session, prompt, params, max_q_entries, max_tokens)
        return cls(engine, handle, prefill_us)

    async def step(
        self,
        num_accepted: int,
        committed: list[int],
        num_tokens: int,
        parent: Context | None = None,
        assume_accepted: bool = False,
    ) -> Proposal:
        return call_in_context(parent, self.engine.step, self.handle, num_accepted, committed, num_tokens, assume_accepted)

    async def close(self) -> None:
        self.engine.close_session(self.handle)


class InProcessWorkers:
    def __init__(self, target: TargetEngine, draft: DraftEngine | None):
        self.target = target
        self.draft = draft
        self.has_draft = draft is not None

    async def target_info(self) -> WorkerInfo:
        return WorkerInfo(**self.target.info())

    async def draft_info(self) -> WorkerInfo | None:
        return WorkerInfo(**self.draft.info()) if self.draft else None

    def draft_available(self) -> bool:
        return self.has_draft

    async def accept_tokenizer(self, fingerprint: str) -> None:
        pass

    def failed(self, session, detail: str) -> None:
        pass

    def status(self) -> list:
        return []

    async def open_target(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int,
        parent: Context | None = None,
        like: TargetSession | None = None,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> TargetSession:
        return InProcessTargetSession(self.target, prompt, params, num_p_entries, parent, max_tokens, logprobs, prompt_logprobs)

    async def open_draft(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        parent: Context | None = None,
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> DraftSession:
        return InProcessDraftSession.open(self.draft, prompt, params, max_q_entries, parent, max_tokens)

    async def close(self) -> None:
        pass
