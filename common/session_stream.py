"""The workers' gRPC protocol: one bidirectional stream is one session (SessionStreamServicer), and a worker's
server, listening while its model loads (serve_worker)."""

import asyncio
import concurrent.futures
import logging
import time

from google.protobuf.descriptor import ServiceDescriptor

from specdec.common import errors, startup_turn
from specdec.common.batcher import Batcher
from specdec.common.config import ServerOptions
from specdec.common.grpc_errors import reports_errors
from specdec.common.grpc_server import create_server, set_serving
from specdec.common.lifecycle import Lifecycle, run_until_signalled
from specdec.common.protocol import info_to_proto
from specdec.common.services import check_parsed
from specdec.common.telemetry import context_from, run_traced
from specdec.common.timing import elapsed_us
from specdec.v1 import worker_pb2

log = logging.getLogger("specdec")


async def serve_worker(
    service: ServiceDescriptor,
    servicer: "SessionStreamServicer",
    load_engine,
    model: str,
    options: ServerOptions,
    token: str | None = None,
) -> None:
    """Runs a worker until SIGTERM: listening (NOT_SERVING) while load_engine() loads the model, then SERVING.
    token: the worker token every call must carry (--worker-auth-token). The machine's start-up lock
    (common.startup_turn, shared by `specdec serve` before its imports) is held until the model is loaded and its cost
    curve measured."""
    server, health_servicer, bound = await create_server(service, servicer, options, token=token)
    await server.start()
    log.info("%s listening on port %d, loading %s", service.name, bound, model)

    def load_in_turn():
        startup_turn.begin(options.startup_lock)
        try:
            return load_engine()
        finally:
            startup_turn.end()

    # On the compute thread, which runs every forward pass after it: the thread that loads (and packs and times)
    # the weights is the one whose passes are fast. Measured on SmolLM2, 2-core CPU: a verification took 46 ms on
    # the loading thread and 80 ms on another one.
    try:
        servicer.engine = await asyncio.get_running_loop().run_in_executor(servicer.executor, load_in_turn)
    except BaseException:
        # Stopped here, in its loop: a server left running when asyncio.run closes the loop prints event-loop noise
        # after the error (the start-up error is the command's one line, cli/serve.py).
        await server.stop(None)
        raise
    await set_serving(health_servicer, [service.full_name], True)
    log.info("%s serving %s", service.name, model)
    await run_until_signalled(server, health_servicer, [service.full_name], options.grace_period, servicer.lifecycle)


def compute_executor() -> concurrent.futures.ThreadPoolExecutor:
    """One thread runs every model call of a worker: forward passes are serialised, the event loop stays free."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


def require_loaded(engine: object) -> None:
    if engine is None:
        raise errors.Unavailable("the model is still loading; wait for the health check to report SERVING")


async def messages_until_idle(request_iterator, idle_timeout: float):
    """The stream's messages; a stream silent for idle_timeout seconds is ended so that its session is reclaimed."""
    iterator = request_iterator.__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout):  # unlike wait_for, no task per message
                message = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise errors.DeadlineExceeded(f"session idle for {idle_timeout:.0f} s; its cache was freed") from None
        yield message


class SessionStreamServicer:
    """One bidirectional stream is one session: the first message opens it, each later one is a step, and the
    session is freed when the stream ends for any reason (finished, failed, cancelled, idle)."""

    role: int  # worker_pb2.WorkerRole reported by GetInfo

    def __init__(self, engine=None, idle_timeout: float = ServerOptions.session_idle_timeout):
        self.idle_timeout = idle_timeout
        self.executor = compute_executor()
        self.batcher = Batcher(self.executor, None, self.stepping_sessions)
        self.engine = engine  # None while the model loads: calls are answered UNAVAILABLE
        self.lifecycle = Lifecycle(lambda: len(self.engine.sessions) if self.engine else 0)

    @property
    def engine(self):
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        """The engine (a common.worker_engine.WorkerEngine) whose run_batch the batcher calls on the compute thread."""
        self._engine = engine
        self.batcher.run_batch = engine.run_batch if engine is not None else None

    async def run(self, request, fn, *args):
        """Runs an engine call on the compute thread, under the trace context the message carried."""
        return await run_traced(self.executor, request.trace_context, fn, *args)

    def stepping_sessions(self) -> int:
        """Sessions that took a step in the last second, or in the last two passes when a pass takes longer (a
        prefill chunk): the ones a batch should wait for, so that a long prompt's next chunk does not run before
        the rounds its last chunk delayed (an open session whose request skips this worker, e.g. a round without
        drafting, is not waited for)."""
        window = max(1.0, 2 * self.batcher.last_pass)
        return self.engine.sessions.recently_active(window) if self.engine else 0

    @staticmethod
    def parent(request):
        return context_from(request.trace_context) if request.trace_context else None

    async def open(self, request):
        """Opens a session from a start message; returns (session, response)."""
        raise NotImplementedError

    async def step(self, session, request):
        raise NotImplementedError

    def close(self, session) -> None:
        raise NotImplementedError

    @staticmethod
    def timing(response) -> worker_pb2.WorkerTiming:
        """The timing part of a step's response, where the handling time is written."""
        raise NotImplementedError

    async def open_or_free(self, request):
        """open(), except that a stream cancelled during the prefill still frees its session: the opening is
        cancelled too (a chunked prefill stops after its current chunk, which the compute thread cannot interrupt,
        and the engine then refuses to add the session), and one that finished meanwhile is closed."""
        opening = asyncio.ensure_future(self.open(request))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.cancel()
            opening.add_done_callback(self.free_opened)
            raise

    def free_opened(self, opening: asyncio.Future) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.close(opening.result()[0])

    @reports_errors
    async def GetInfo(self, request, context):
        require_loaded(self.engine)
        return info_to_proto(self.role, self.engine.info())

    @reports_errors
    async def session_stream(self, request_iterator, context):
        session = None
        try:
            require_loaded(self.engine)
            async for request in messages_until_idle(request_iterator, self.idle_timeout):
                received = time.perf_counter()
                check_parsed(request)
                kind = request.WhichOneof("kind")
                if session is None:
                    if kind != "start":
                        raise errors.InvalidArgument("start", "the first message of a stream must open the session")
                    self.lifecycle.admit()
                    session, response = await self.open_or_free(request)
                    yield response
                elif kind != "step":
                    raise errors.InvalidArgument("step", "the session is already open; send steps")
                else:
                    response = await self.step(session, request)
                    self.timing(response).handling_us = elapsed_us(received)
                    yield response
        finally:
            if session is not None:
                self.close(session)
