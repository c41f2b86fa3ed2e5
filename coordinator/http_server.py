"""uvicorn for the HTTP API, hardened: a deadline on each request's headers, no signal handlers of its own (the
coordinator owns SIGTERM and the drain), the gRPC API's TLS."""

import asyncio
import contextlib
import logging
import socket
import ssl

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.common.lifecycle import FINAL_STOP_SECONDS
from specdec.common.tls import TlsFiles
from specdec.coordinator.config import HttpSettings


log = logging.getLogger("specdec.coordinator")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: uvicorn times out idle keep-alive
    connections but not a client that trickles its headers in (slowloris), which would hold a connection forever."""

    header_timeout = HttpSettings.http_header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            if self.header_timer is not None:
                self.header_timer.cancel()  # this request's headers are in
                self.header_timer = None
        elif self.header_timer is None and not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)  # awaiting the next

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.header_timer is None and not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)

    def headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("a client sent no complete request headers within %.0f s: connection closed", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})


class HttpServer(uvicorn.Server):
    """uvicorn in the coordinator's event loop: the coordinator owns SIGTERM and the drain (common.lifecycle), so
    uvicorn installs no signal handlers of its own; `stop()` ends it once the drain is over."""

    def capture_signals(self):
        return contextlib.nullcontext()

    async def stop(self, task: asyncio.Task) -> None:
        self.should_exit = True
        await task


def bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def tls_options(tls: TlsFiles | None) -> dict:
    """The gRPC API's TLS for the HTTP one: a certificate, and client certificates required with a CA."""
    if tls is None or not tls.enabled:
        return {}
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.ca:
        options.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def start_http(
    app: FastAPI, host: str, port: int, tls: TlsFiles | None = None, http: HttpSettings | None = None
) -> tuple[HttpServer, int, asyncio.Task]:
    """Binds host:port (0: any free port) and serves the app on it in this event loop; returns the port bound."""
    http = http or HttpSettings()
    sock = bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,  # the process's logging, as configured by common.lifecycle.configure_logging
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=int(FINAL_STOP_SECONDS) or 1,
        http=protocol_with_header_timeout(http.http_header_timeout),
        timeout_keep_alive=http.http_keep_alive,
        limit_concurrency=http.http_max_connections,
        **tls_options(tls),
    )
    server = HttpServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        sock.close()
        task.result()  # raises what stopped it
        raise OSError(f"the HTTP API did not start on {host}:{port}")
    task.add_done_callback(report_stop)
    return server, sock.getsockname()[1], task


def report_stop(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP API stopped", exc_info=task.exception())
