"""What every specdec gRPC server has: message size limits, TLS, health, reflection, graceful shutdown, the
mapping of engine errors to status codes, and (for the workers) one stream = one session."""

import asyncio
import concurrent.futures
import logging
import signal
import time
import uuid
from collections.abc import Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import errors
from common.auth import BearerTokenInterceptor
from common.protocol import info_to_proto
from common.batcher import Batcher
from common.config import ServerOptions
from common.services import add_service, check_parsed
from common.telemetry import context_from, run_traced
from common.tls import server_credentials
from specdec.v1 import worker_pb2

# One speculation round carries at most a few hundred sparse entries; prompts are the largest messages. 16 MiB
# holds a prompt of millions of tokens while keeping one request from exhausting a worker's memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# What a server accepts of its clients' keepalive pings on a connection without calls: clients ping every 30 s
# (GRPC_OPTIONS), while gRPC servers by default take one ping per 5 minutes there and answer the third early one
# with GOAWAY too_many_pings, dropping an idle client's connection (seen with the bench's idle clients).
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 20_000)]
# A restarted worker is found again within a second, not after gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# After a drain, what calls still running get before the server stops (the drain already waited --grace-period).
FINAL_STOP_SECONDS = 1.0

log = logging.getLogger("specdec")

STATUS_CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.WorkerFailed: grpc.StatusCode.INTERNAL,
}


async def create_server(
    service: ServiceDescriptor, servicer, options: ServerOptions, channel_options: tuple = (), token: str | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A server with the servicer, health (NOT_SERVING until the caller says otherwise) and reflection;
    channel_options: gRPC options beyond GRPC_OPTIONS; token: every call but health checks must carry it."""
    interceptors = [BearerTokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        options=[*SERVER_OPTIONS, *channel_options],
        interceptors=interceptors,
        maximum_concurrent_rpcs=options.max_concurrent_rpcs,
    )
    add_service(server, servicer, service)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # grpc's health servicer starts with the overall status SERVING; ours is SERVING only once a model is loaded.
    await set_serving(health_servicer, [service.full_name], False)
    address = f"{options.host}:{options.port}"
    if options.tls.enabled:
        bound = server.add_secure_port(address, server_credentials(options.tls))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    if options.unix_socket:
        local = f"unix:{options.unix_socket}"
        credentials = server_credentials(options.tls) if options.tls.enabled else None
        if not (server.add_secure_port(local, credentials) if credentials else server.add_insecure_port(local)):
            raise OSError(f"could not bind {local}")
    return server, health_servicer, bound


async def start_serving(
    service: ServiceDescriptor, servicer, options: ServerOptions, channel_options: tuple = (), token: str | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started server that reports SERVING at once: its engine is ready (tests, benchmarks, the coordinator)."""
    server, health_servicer, bound = await create_server(service, servicer, options, channel_options, token)
    await server.start()
    await set_serving(health_servicer, [service.full_name], True)
    return server, health_servicer, bound


async def serve_worker(
    service: ServiceDescriptor,
    servicer: "SessionStreamServicer",
    load_engine,
    model: str,
    options: ServerOptions,
    token: str | None = None,
) -> None:
    """Runs a worker until SIGTERM: listening (NOT_SERVING) while load_engine() loads the model, then SERVING.
    token: the worker token every call must carry (--worker-auth-token)."""
    server, health_servicer, bound = await create_server(service, servicer, options, token=token)
    await server.start()
    log.info("%s listening on port %d, loading %s", service.name, bound, model)
    # On the compute thread, which runs every forward pass after it: the thread that loads (and packs and times)
    # the weights is the one whose passes are fast. Measured on SmolLM2, 2-core CPU: a verification took 46 ms on
    # the loading thread and 80 ms on another one.
    servicer.engine = await asyncio.get_running_loop().run_in_executor(servicer.executor, load_engine)
    await set_serving(health_servicer, [service.full_name], True)
    log.info("%s serving %s", service.name, model)
    await run_until_signalled(server, health_servicer, [service.full_name], options.grace_period, servicer.lifecycle)


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def compute_executor() -> concurrent.futures.ThreadPoolExecutor:
    """One thread runs every model call of a worker: forward passes are serialised, the event loop stays free."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


class Lifecycle:
    """Draining on SIGTERM: new calls are refused while the in-flight ones finish."""

    def __init__(self, in_flight: Callable[[], int] = lambda: 0):
        self.in_flight = in_flight
        self.draining = False

    def admit(self) -> None:
        if self.draining:
            raise errors.Unavailable("shutting down: not accepting new requests; retry on another instance")


async def run_until_signalled(
    server: grpc.aio.Server, health_servicer, service_names: list[str], grace: float, lifecycle: Lifecycle
) -> None:
    """Serves until SIGTERM or SIGINT; then reports NOT_SERVING, refuses new calls, lets in-flight ones finish for
    up to `grace` seconds, and stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    lifecycle.draining = True
    await set_serving(health_servicer, service_names, False)
    log.info("stopping: NOT_SERVING, %d in flight, waiting up to %.0f s for them", lifecycle.in_flight(), grace)
    deadline = loop.time() + grace
    while lifecycle.in_flight() > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(FINAL_STOP_SECONDS)
    log.info("stopped")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# Clients with a retry policy retry UNAVAILABLE (the Python client's does, on the next coordinator). A server that
# already spent its own retries on a request sends this with its final UNAVAILABLE: gRPC does not retry a call
# whose server pushes back by a negative delay.
NO_RETRY = (("grpc-retry-pushback-ms", "-1"),)


def internal_error_message(error: BaseException) -> str:
    """What a caller is told of an unexpected error: a fixed text and an incident id; the detail (an exception's
    text, which may quote a library's internals or another session's data) goes to the log under that id."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error, incident %s", incident, exc_info=error)
    return f"internal error (incident {incident}: details in the server's log)"


async def abort_with(context: grpc.aio.ServicerContext, error: Exception, trailing_metadata=()) -> None:
    """Ends the call with the status that fits the engine's error; an unexpected one is INTERNAL with
    internal_error_message. WorkerFailed carries what a worker told (its own incident id) and is passed on."""
    code = STATUS_CODES.get(type(error), grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, errors.WorkerFailed):
        message = internal_error_message(error)
    else:
        message = str(error) or type(error).__name__
    await context.abort(code, message, trailing_metadata)


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
        self.engine = engine  # None while the model loads: calls are answered UNAVAILABLE
        self.idle_timeout = idle_timeout
        self.executor = compute_executor()
        self.batcher = Batcher(self.executor, self.run_batch, self.stepping_sessions)
        self.lifecycle = Lifecycle(lambda: len(self.engine.sessions) if self.engine else 0)

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

    def run_batch(self, calls: list) -> list:
        """Runs one batch of steps on the engine (on the compute thread)."""
        raise NotImplementedError

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

    async def GetInfo(self, request, context):
        try:
            require_loaded(self.engine)
            return info_to_proto(self.role, self.engine.info())
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)

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
                    self.timing(response).handling_us = int((time.perf_counter() - received) * 1e6)
                    yield response
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)
        finally:
            if session is not None:
                self.close(session)
