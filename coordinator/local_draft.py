"""A model-free draft run in the coordinator's own process (`--local-draft ngram|suffix`), beside pools of target
workers.

Prompt lookup and suffix trees compute next to nothing (a look-up of microseconds), so a draft worker only adds an
exchange to each round: a message out and back before the target can verify, on the event loops of both ends.
Under load that exchange is what drafting still costs: rounds that draft reach the target later than those that do
not, so the target's batches form out of phase. Run here, a proposal is ready before the round's verify message
leaves (as vLLM runs its n-gram and suffix proposers in the scheduler). What the round needs of a draft is the same:
the same DraftEngine and proposers the draft worker serves, behind the session interface of coordinator.workers.
"""

import asyncio
import functools

from opentelemetry.context import Context

from specdec.common.sampling import SamplingParams
from specdec.coordinator.in_process import InProcessDraftSession
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.coordinator.workers import TargetSession, WorkerInfo
from specdec.draft_worker.engine import DraftEngine

# A prompt longer than this is indexed on a thread: a suffix tree costs about 0.15 ms a token (depth 24), which
# would hold up every other request on the event loop.
INLINE_PROMPT_TOKENS = 256


async def open_local_draft(
    engine: DraftEngine, prompt: list[int], params: SamplingParams, max_q_entries: int, parent: Context | None, max_tokens: int
) -> InProcessDraftSession:
    """A session on the local engine; a long prompt is indexed on a thread."""
    opening = functools.partial(InProcessDraftSession.open, engine, prompt, params, max_q_entries, parent, max_tokens)
    if len(prompt) <= INLINE_PROMPT_TOKENS:
        return opening()
    task = asyncio.ensure_future(asyncio.to_thread(opening))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # The thread cannot be stopped: the session it opens is closed as soon as it exists.
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else engine.close_session(t.result().handle))
        raise


class LocalDraftWorkers:
    """Target sessions on the pools of `workers`, draft sessions on the local engine (coordinator.workers.Workers)."""

    has_draft = True

    def __init__(self, workers: GrpcWorkers, draft: DraftEngine):
        self.workers, self.draft = workers, draft
        self.target_pool, self.draft_pool = workers.target_pool, None

    async def target_info(self, timeout: float | None = None) -> WorkerInfo:
        return await self.workers.target_info(timeout)

    async def draft_info(self, timeout: float | None = None) -> WorkerInfo:
        return WorkerInfo(**self.draft.info())

    def draft_available(self) -> bool:
        return True

    async def accept_tokenizer(self, fingerprint: str) -> None:
        await self.workers.accept_tokenizer(fingerprint)  # a model-free draft fits any tokenizer

    def failed(self, session, detail: str) -> None:
        self.workers.failed(session, detail)

    def status(self) -> list:
        return self.workers.status()

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
        return await self.workers.open_target(prompt, params, num_p_entries, parent, like, max_tokens, logprobs, prompt_logprobs)

    async def open_draft(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        parent: Context | None = None,
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> InProcessDraftSession:
        return await open_local_draft(self.draft, prompt, params, max_q_entries, parent, max_tokens)

    async def close(self) -> None:
        await self.workers.close()
