"""Server-sent events: the SSE body of a streamed completion, the response that sends it (ended by the client going
away or stalling), and the engine's event streams it reads (merged over choices, ended at the request's deadline)."""

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from specdec.common.errors import DeadlineExceeded
from specdec.coordinator.output import Delta
from specdec.coordinator.finish_reasons import FINISH_REASON_NAMES
from specdec.coordinator.tool_calls import CallStream
from specdec.coordinator.types import GenerationResult

from specdec.coordinator.http_errors import error_event
from specdec.coordinator.http_responses import Completion

log = logging.getLogger("specdec.coordinator")


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def release(events, slot: contextlib.ExitStack) -> None:
    """Closes the engine's generator (its sessions with it) and gives the request slot back, whatever happens."""
    try:
        if events is not None:
            await events.aclose()
    finally:
        slot.close()


class EventStream(StreamingResponse):
    """Server-sent events that end, however they end (the last event, an error, the client gone, the client not
    reading), with on_close: the engine's generator closes, freeing both sessions at once, and the request slot is
    given back.

    The client's disconnect is listened for whatever ASGI version the server speaks, so that it stops the request
    within a round rather than at the next event that fails to send. A client that stops reading leaves the
    connection open while the server's buffers fill and a send waits: after stall_timeout seconds of one send
    waiting, the stream is cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable, stall_timeout: float):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close
        self.stall_timeout = stall_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_unless_stalled(message) -> None:
            with anyio.fail_after(self.stall_timeout):
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send_unless_stalled)
                    except TimeoutError:
                        log.info("client stopped reading its stream for %.0f s: cancelled", self.stall_timeout)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.on_close()


async def merged(streams: list) -> AsyncIterator[tuple[int, Delta | GenerationResult]]:
    """The events of several choices' streams as they come, each as (choice index, event); the first error ends
    all of them. Every stream is closed when this generator is (its sessions with it)."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event, None))
            await queue.put((index, None, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, None, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                running -= 1
                continue
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def before_deadline(events, seconds: float):
    """The engine's events, ended by DeadlineExceeded once `seconds` have passed: an HTTP request has no gRPC
    deadline to cancel it, and a client that waits forever must not hold its sessions forever."""
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            limit = asyncio.timeout_at(deadline)
            try:
                async with limit:
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not limit.expired():
                    raise  # the engine's own, not this deadline
                raise DeadlineExceeded(f"the request ran past its deadline of {seconds:g} s (--http-request-timeout)") from None
            yield event
    finally:
        await events.aclose()


async def stream_events(first, events, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a chunk per committed delta, the finish reason, then usage if asked, then [DONE]. An error
    after the stream began is sent as an error event (the status line is gone by then)."""
    opened: set[int] = set()  # the choices whose first chunk went out
    results: dict[int, GenerationResult] = {}
    calls: dict[int, CallStream] = {}  # with tools, each choice's tool calls as they are generated
    index, event = first
    try:
        while True:
            if isinstance(event, Delta) and completion.tools is not None:
                stream = calls.setdefault(index, completion.call_stream())
                for chunk in completion.tool_chunks(index, stream.feed(event.text), index not in opened, event):
                    yield sse(chunk)
                    opened.add(index)
            elif isinstance(event, Delta):
                if event.text or event.logprobs or index not in opened:
                    chunk = completion.chunk(
                        index, event.text, first=index not in opened, delta=event, prompt_logprobs=event.prompt_logprobs
                    )
                    yield sse(chunk)
                    opened.add(index)
            else:
                finish = FINISH_REASON_NAMES.get(event.finish_reason)
                if completion.tools is not None:
                    stream = calls.setdefault(index, completion.call_stream())
                    for chunk in completion.tool_chunks(index, stream.end(), index not in opened):
                        yield sse(chunk)
                    yield sse(completion.last_tool_chunk(index, stream.calls_started, finish))
                else:
                    prompt = event.prompt_logprobs
                    yield sse(completion.chunk(index, "", finish, first=index not in opened, prompt_logprobs=prompt))
                opened.add(index)
                results[index] = event
            try:
                index, event = await anext(events)
            except StopAsyncIteration:
                break
        if include_usage:
            yield sse(completion.usage_chunk([results[i] for i in sorted(results)]))
    except Exception as error:  # noqa: BLE001 - reported in the stream
        yield sse(error_event(error))
    yield sse("[DONE]")
