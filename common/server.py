"""What every specdec gRPC server has: message size limits, health, reflection, and a compute thread."""

import asyncio
import concurrent.futures
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# One speculation round carries at most a few hundred sparse entries; prompts are the largest messages.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

log = logging.getLogger("specdec")


async def create_server(
    service_names: list[str], port: int, host: str = "0.0.0.0"
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A server with health (NOT_SERVING until the caller says otherwise) and reflection, bound to port (0: any)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # grpc's health servicer starts with the overall status SERVING; ours is SERVING only once a model is loaded.
    await set_serving(health_servicer, service_names, False)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    return server, health_servicer, bound


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def compute_executor() -> concurrent.futures.ThreadPoolExecutor:
    """One thread runs every model call of a worker: forward passes are serialised, the event loop stays free."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


async def run_until_signalled(
    server: grpc.aio.Server, on_stop: Callable[[], Awaitable[None]] | None = None, grace: float = 5.0
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if on_stop:
        await on_stop()
    await server.stop(grace)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def status_code_of(error: Exception) -> grpc.StatusCode:
    from common import errors

    return {
        errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
        errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    }.get(type(error), grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Ends the call with the status that fits the engine's error; unexpected errors are logged as INTERNAL."""
    code = status_code_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=error)
    await context.abort(code, str(error) or type(error).__name__)


def require_loaded(engine: object) -> None:
    from common.errors import Unavailable

    if engine is None:
        raise Unavailable("the model is still loading; wait for the health check to report SERVING")
