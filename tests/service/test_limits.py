"""Capacity limits answer RESOURCE_EXHAUSTED instead of running out of memory; idle sessions are reclaimed."""

import asyncio

import grpc
import pytest

from specdec.common.config import ServerOptions
from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.server import build_engine, launch
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc, worker_pb2
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server
from tests.support.services import draft_engine_for, running_services
from tests.support.waiting import wait_until

LONG = build_request("hold the line", max_new_tokens=3000, temperature=0, ignore_eos=True)


def test_a_full_worker_answers_resource_exhausted(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model, max_sessions=1), draft_engine_for(draft_models, 0.5)) as services:
            first = services.stub.GenerateStream(LONG)
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await services.stub.Generate(build_request("second", max_new_tokens=2))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "maximum of 1 sessions" in error.value.details()
            first.cancel()
            await wait_until(lambda: len(services.target.sessions) == 0 and len(services.draft.sessions) == 0)

    asyncio.run(run())


def test_the_coordinator_caps_concurrent_requests(target_model, draft_models):
    async def run():
        target_server, target_port = await start_target_server(TargetEngine(target_model))
        workers = GrpcWorkers(f"127.0.0.1:{target_port}", None)
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        coordinator = await launch(engine, ServerOptions(host="127.0.0.1"), max_concurrent_requests=1)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                first = stub.GenerateStream(LONG)
                await first.read()
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Generate(build_request("second", max_new_tokens=2))
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "maximum of 1 concurrent requests" in error.value.details()
                first.cancel()
                await wait_until(lambda: coordinator.admission.active == 0, message="the cancelled request's slot is freed")
                assert (
                    await stub.Generate(build_request("third", max_new_tokens=2, ignore_eos=True))
                ).usage.completion_tokens == 2
        finally:
            await workers.close()
            await coordinator.server.stop(0)
            await target_server.stop(0)

    asyncio.run(run())


def test_idle_sessions_are_reclaimed(target_model):
    async def run():
        engine = TargetEngine(target_model)
        server, port = await start_target_server(engine, ServerOptions(host="127.0.0.1", session_idle_timeout=0.5))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = target_pb2_grpc.TargetServiceStub(channel).Verify()
                start = target_pb2.VerifySessionStart(
                    prompt_token_ids=[1, 2, 3], sampling=worker_pb2.SamplingParams(temperature=0, top_p=1.0)
                )
                await call.write(target_pb2.VerifyRequest(start=start))
                await call.read()
                assert len(engine.sessions) == 1
                await wait_until(lambda: len(engine.sessions) == 0, timeout=5)
                assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "idle" in await call.details()
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_messages_over_the_size_limit_are_refused(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await services.stub.Generate(build_request("x" * (17 * 1024 * 1024)))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                await services.stub.Generate(build_request("fine", max_new_tokens=2, ignore_eos=True))
            ).usage.completion_tokens == 2

    asyncio.run(run())
