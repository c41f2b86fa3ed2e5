"""Continuous batching for a worker: engine calls that arrive while the compute thread is busy run together.

Nothing waits on purpose: a call that finds the worker idle runs at once, alone; calls that arrive during a
forward pass queue up and form the next batch. Under load every pass therefore serves every ready session, and
a lone session pays no batching delay.
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor


class Batcher:
    def __init__(self, executor: Executor, run_batch: Callable[[list], list], max_batch: int = 64):
        self.executor = executor
        self.run_batch = run_batch  # calls -> one result (or exception) per call, in order
        self.max_batch = max_batch
        self.queue: list[tuple[object, asyncio.Future]] = []
        self.draining: asyncio.Task | None = None

    async def submit(self, call):
        """The call's result, once a batch containing it has run; its exception is raised here."""
        future = asyncio.get_running_loop().create_future()
        self.queue.append((call, future))
        if self.draining is None or self.draining.done():
            self.draining = asyncio.ensure_future(self.drain())
        return await future

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.queue:
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [call for call, _ in batch])
            except Exception as error:  # noqa: BLE001 - handed to every caller of the batch
                results = [error] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # the caller went away (its stream was cancelled)
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
