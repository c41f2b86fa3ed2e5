"""Slow and silent HTTP clients cannot hold the coordinator's resources: a request's overall deadline, a stream whose
client stops reading, headers sent too slowly, and a cap on connections."""

import asyncio
import contextlib
import json

import pytest

from specdec.common.config import ServerOptions
from specdec.coordinator.config import CoordinatorConfig, HttpSettings
from specdec.coordinator.server import build_engine, launch
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server
from tests.support.services import TARGET
from tests.support.waiting import wait_until


@contextlib.asynccontextmanager
async def http_coordinator(target_model, http: HttpSettings):
    """An in-process coordinator with the HTTP API, over a target worker whose rounds take `delay` seconds."""
    engine = TargetEngine(target_model)
    target, port = await start_target_server(engine)
    workers = GrpcWorkers(f"127.0.0.1:{port}", None)
    coordinator_engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
    coordinator = await launch(coordinator_engine, ServerOptions(host="127.0.0.1"), http_port=0, http=http)
    try:
        yield coordinator.http_port, engine
    finally:
        await coordinator.stop()
        await workers.close()
        await target.stop(0)


def completion_request(port: int, stream: bool, max_tokens: int = 4000) -> bytes:
    body = json.dumps(
        {"model": TARGET, "prompt": "go on", "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": True}
    ).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


class SlowTarget(TargetEngine):
    """Each round takes 50 ms more: a long answer outlives a short deadline."""

    def run_batch(self, calls):
        import time

        time.sleep(0.05)
        return super().run_batch(calls)


def test_an_http_request_past_its_deadline_gets_504_and_frees_its_session(target_model):
    async def run():
        import httpx2

        engine = SlowTarget(target_model)
        target, port = await start_target_server(engine)
        workers = GrpcWorkers(f"127.0.0.1:{port}", None)
        coordinator_engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        http = HttpSettings(http_request_timeout=1.0)
        coordinator = await launch(coordinator_engine, ServerOptions(host="127.0.0.1"), http_port=0, http=http)
        try:
            async with httpx2.AsyncClient(timeout=30) as client:
                body = {"model": TARGET, "prompt": "go on", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
                response = await client.post(f"http://127.0.0.1:{coordinator.http_port}/v1/completions", json=body)
            assert response.status_code == 504, response.text
            assert "--http-request-timeout" in response.json()["error"]["message"]
            await wait_until(lambda: len(engine.sessions) == 0, 5)
        finally:
            await coordinator.stop()
            await workers.close()
            await target.stop(0)

    asyncio.run(run())


def test_a_stream_whose_client_stops_reading_is_cancelled_and_closes_its_generation():
    # A client that stops reading leaves its connection open; once the server's buffers are full, uvicorn's send
    # waits (its flow control) for as long as the client does not read. Here the send blocks after the headers,
    # as it would then, and the client never disconnects: after the stall timeout the stream ends, and its
    # generation (the engine's generator, whose closing frees the sessions) is closed with it.
    from specdec.coordinator.http_streaming import EventStream

    async def run():
        generation_closed, on_close_called = asyncio.Event(), asyncio.Event()

        async def events():
            try:
                while True:
                    yield "data: {}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                generation_closed.set()

        async def close():
            await generation.aclose()
            on_close_called.set()

        async def send(message):
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()  # the client reads nothing: a send never completes

        async def receive():
            await asyncio.Event().wait()  # and never disconnects
            return {}

        generation = events()
        stream = EventStream(generation, close, stall_timeout=0.5)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(stream(scope, receive, send), 5)
        assert on_close_called.is_set() and generation_closed.is_set()

    asyncio.run(run())


def test_a_connection_that_trickles_its_headers_is_closed(target_model):
    async def run():
        async with http_coordinator(target_model, HttpSettings(http_header_timeout=1.0)) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                await writer.drain()
                for _ in range(20):  # a header line every 0.2 s, never the blank line that ends them
                    writer.write(b"X-Slow: 1\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    if reader.at_eof():
                        break
                closed = await asyncio.wait_for(reader.read(), 5)
                assert reader.at_eof() and b"200" not in closed
            finally:
                writer.close()
            # A client that sends its request promptly is served on a fresh connection.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(completion_request(port, stream=False, max_tokens=2))
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 30)
            writer.close()
            assert status.startswith(b"HTTP/1.1 200"), status

    asyncio.run(run())


@pytest.mark.parametrize("limit", [2])
def test_connections_beyond_the_limit_get_503(target_model, limit):
    async def run():
        async with http_coordinator(target_model, HttpSettings(http_max_connections=limit)) as (port, _):
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(limit)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(completion_request(port, stream=False, max_tokens=2))
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 503"), status
            for _, w in [*held, (reader, writer)]:
                w.close()

    asyncio.run(run())
