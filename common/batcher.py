"""Continuous batching for a worker: the steps of all open sessions run together in one forward pass.

A step that finds the worker idle and no other session open runs at once. Otherwise the batcher waits a little
for the steps of the other open sessions: each comes back a few milliseconds after its previous step (the round
trip through the coordinator), and without the wait sessions fall out of phase (one runs alone while the others
wait, then they run while it waits) and every pass serves only part of them. The wait is bounded by a fraction
of the last pass's duration, so it never costs more than a fraction of what joining the batch saves.
"""

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor

from specdec.common.timing import elapsed_us


class Continue:
    """A batch method's result for a call that is not finished (a prefill with prompt chunks still to run): the
    call goes into the next batch, beside the other sessions' steps, and its caller keeps waiting."""


CONTINUE = Continue()


def run_alone(run_batch: Callable[[list], list], call):
    """One call through a batch method (batches of one until it finishes): its result, or its error raised."""
    while True:
        result = run_batch([call])[0]
        if result is not CONTINUE:
            break
    if isinstance(result, Exception):
        raise result
    return result


WAIT_FRACTION = 0.25  # of the last pass's duration
MAX_WAIT = 0.02  # seconds


class Batcher:
    def __init__(
        self,
        executor: Executor,
        run_batch: Callable[[list], list] | None,
        open_sessions: Callable[[], int] = lambda: 1,
        max_batch: int = 64,
    ):
        self.executor = executor
        self.run_batch = run_batch  # calls -> one result (or exception) per call, in order; set before a submit
        self.open_sessions = open_sessions  # how many steps a full batch would hold
        self.max_batch = max_batch
        self.queue: list[tuple[object, asyncio.Future]] = []  # calls that arrived
        self.continuing: list[tuple[object, asyncio.Future]] = []  # unfinished calls, run first in the next batch
        self.arrived = asyncio.Event()
        self.draining: asyncio.Task | None = None
        self.last_pass = 0.0  # seconds

    async def submit(self, call):
        """The call's result, once a batch containing it has run; its exception is raised here. The time the call
        waited for its batch is set on it as queue_us, when it has that attribute."""
        return await self.enqueue(call)

    def enqueue(self, call) -> asyncio.Future:
        """submit() without waiting: the call is queued before this returns, so that its batch can start while
        the caller goes on (a decode ahead, queued before the verdict it follows is sent). Cancelling the future
        takes the call out of a batch that has not run yet."""
        future = asyncio.get_running_loop().create_future()
        call.queued_at = time.perf_counter()
        self.queue.append((call, future))
        self.arrived.set()
        if self.draining is None or self.draining.done():
            self.draining = asyncio.ensure_future(self.drain())
        return future

    async def gather(self) -> None:
        """Waits (briefly) until every open session has a step queued."""
        deadline = time.monotonic() + min(MAX_WAIT, WAIT_FRACTION * self.last_pass)
        while len(self.queue) < min(self.open_sessions(), self.max_batch):  # noqa: ASYNC110 - woken by submit()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                return

    async def drain(self) -> None:
        while self.queue or self.continuing:
            batch = []
            try:
                await self.gather()
                waiting, self.continuing = [*self.continuing, *self.queue], []
                batch, self.queue = waiting[: self.max_batch], waiting[self.max_batch :]
                batch = [(call, future) for call, future in batch if not future.done()]  # callers gone while waiting
                if batch:
                    await self.run(batch)
            except Exception as error:  # noqa: BLE001 - never leave a caller waiting
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)

    async def run(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        start = time.perf_counter()
        calls = [call for call, _ in batch]
        for call in calls:
            call.queue_us = elapsed_us(call.queued_at, start)
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.executor, self.run_batch, calls)
        except Exception as error:  # noqa: BLE001 - handed to every caller of the batch
            results = [error] * len(batch)
        self.last_pass = time.perf_counter() - start
        for (call, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller went away (its stream was cancelled)
                continue
            if result is CONTINUE:
                # Its next chunk runs in the next pass, with the steps gather() waits for: those of the sessions
                # that arrive meanwhile (an unfinished call is not one of them).
                self.continuing.append((call, future))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
