"""A service process's life: its logging, and draining on SIGTERM (new calls refused while the in-flight ones
finish, then the server stops)."""

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc

from specdec.common import errors
from specdec.common.grpc_server import set_serving

# After a drain, what calls still running get before the server stops (the drain already waited --grace-period).
FINAL_STOP_SECONDS = 1.0

log = logging.getLogger("specdec")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
