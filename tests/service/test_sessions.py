"""A finished, failed or cancelled request leaves no session behind on either worker."""

import asyncio
import time

import grpc
import pytest

from specdec.coordinator.client import build_request
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2_grpc, worker_pb2
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for, running_services
from tests.support.waiting import wait_until

PROMPT = "Sessions are freed when a stream ends, whatever ends it."


async def active_sessions(services) -> tuple[int, int]:
    """Read through the workers' own GetInfo RPCs, as an operator would."""
    async with grpc.aio.insecure_channel(services.target_address) as t, grpc.aio.insecure_channel(services.draft_address) as d:
        target = await target_pb2_grpc.TargetServiceStub(t).GetInfo(worker_pb2.GetInfoRequest())
        draft = await draft_pb2_grpc.DraftServiceStub(d).GetInfo(worker_pb2.GetInfoRequest())
    return target.active_sessions, draft.active_sessions


def no_sessions(services) -> bool:
    return len(services.target.sessions) == 0 and len(services.draft.sessions) == 0


def test_finished_requests_free_both_sessions(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            await asyncio.gather(*(services.stub.Generate(build_request(PROMPT, max_new_tokens=20, seed=i)) for i in range(8)))
            await wait_until(lambda: no_sessions(services))
            assert await active_sessions(services) == (0, 0)

    asyncio.run(run())


def test_cancelled_stream_frees_both_sessions(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            # A fixed gamma opens the draft session with the target's (under auto a model draft opens when first
            # wanted: tests/service/test_deferred_draft.py frees one cancelled while it opens).
            request = build_request(PROMPT, max_new_tokens=2000, ignore_eos=True, temperature=0, num_speculative_tokens=4)
            call = services.stub.GenerateStream(request)
            await call.read()
            assert len(services.target.sessions) == 1 and len(services.draft.sessions) == 1
            call.cancel()
            await wait_until(lambda: no_sessions(services), timeout=5)

    asyncio.run(run())


def test_client_deadline_frees_both_sessions(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            request = build_request(PROMPT, max_new_tokens=4000, ignore_eos=True, temperature=0)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await services.stub.Generate(request, timeout=0.3)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: no_sessions(services), timeout=5)

    asyncio.run(run())


class FailingTargetEngine(TargetEngine):
    """A target worker whose engine breaks on its third round: a fault injected to fail the request."""

    def decide(self, call, logits, span):
        call.session.steps = getattr(call.session, "steps", 0) + 1
        if call.session.steps == 3:
            raise RuntimeError("injected target fault")
        return super().decide(call, logits, span)


def test_failed_request_frees_both_sessions(target_model, draft_models):
    async def run():
        async with running_services(FailingTargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await services.stub.Generate(build_request(PROMPT, max_new_tokens=50, ignore_eos=True))
            assert error.value.code() == grpc.StatusCode.INTERNAL
            assert "target worker failed" in error.value.details()
            # The client learns an incident id; the exception's own text stays in the worker's log.
            assert "incident" in error.value.details() and "injected target fault" not in error.value.details()
            await wait_until(lambda: no_sessions(services), timeout=5)
            assert await active_sessions(services) == (0, 0)

    asyncio.run(run())


def test_a_stream_the_worker_already_ended_reports_unavailable(target_model):
    """A write after the worker's end of the stream is gone (a crashed target) is a retryable Unavailable."""
    from specdec.common.errors import Unavailable
    from specdec.common.sampling import SamplingParams
    from specdec.coordinator.worker_clients import GrpcWorkers
    from specdec.target_worker.server import start_target_server

    async def run():
        server, port = await start_target_server(TargetEngine(target_model))
        workers = GrpcWorkers(f"127.0.0.1:{port}", None)
        try:
            session = await workers.open_target([1, 2, 3], SamplingParams(temperature=0), 0)
            await server.stop(0)
            await wait_until(session.call.done)
            with pytest.raises(Unavailable, match="target worker"):
                await session.verify([], [])
        finally:
            await workers.close()

    asyncio.run(run())


async def open_and_cancel_draft_stream(address: str, draft) -> None:
    """Opens a draft session straight on the worker's port and cancels the stream once the draft's slow step of the
    opening has begun (on the compute thread)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = draft_pb2_grpc.DraftServiceStub(channel).Draft()
        start = draft_pb2.DraftSessionStart(prompt_token_ids=[1, 2, 3], sampling=worker_pb2.SamplingParams(top_p=1.0))
        await call.write(draft_pb2.DraftRequest(start=start))
        await wait_until(lambda: draft.entered == 1)
        call.cancel()


class SlowPrefillDraftEngine(DraftEngine):
    entered = 0  # prefills begun
    opened = 0  # prefills run to their end

    def prefill_chunk(self, handle):
        self.entered += 1
        time.sleep(0.3)
        done = super().prefill_chunk(handle)
        self.opened += done
        return done


def test_a_stream_cancelled_during_its_prefill_frees_the_session_opened_after_it(target_model, draft_models):
    """The prefill runs on the compute thread and finishes after the cancellation; its session must not leak."""

    async def run():
        draft = SlowPrefillDraftEngine(ModelProposer(draft_models[0.5], calibrate=False), "draft")
        async with running_services(TargetEngine(target_model), draft) as services:
            await open_and_cancel_draft_stream(services.draft_address, draft)
            await wait_until(lambda: draft.opened == 1)
            await wait_until(lambda: len(services.draft.sessions) == 0)

    asyncio.run(run())


class SlowBeginDraftEngine(DraftEngine):
    entered = 0
    begun = 0

    def begin_session(self, *args):
        self.entered += 1
        time.sleep(0.3)
        handle = super().begin_session(*args)
        self.begun += 1
        return handle


def test_a_stream_cancelled_while_its_session_is_reserved_frees_the_reservation(target_model, draft_models):
    """The reservation is made on the compute thread, after the cancellation; it must not leak."""

    async def run():
        draft = SlowBeginDraftEngine(ModelProposer(draft_models[0.5], calibrate=False), "draft")
        async with running_services(TargetEngine(target_model), draft) as services:
            await open_and_cancel_draft_stream(services.draft_address, draft)
            await wait_until(lambda: draft.begun == 1)
            await wait_until(lambda: draft.sessions.reserved_kv_tokens == 0 and not draft.sessions.reserved)

    asyncio.run(run())


def test_a_cancellation_swallowed_by_wait_for_still_stops_the_request(target_model, draft_models, monkeypatch):
    """Python 3.11's asyncio.wait_for can return a result although its task was cancelled (the cancellation arrives
    as its awaitable completes, and is swallowed); the speculation loop checks the task's cancellation count each
    round, so the request ends cancelled after that round, and frees its sessions, instead of running on to its
    last token after its caller left."""
    import specdec.coordinator.request_run
    from specdec.common.sampling import SamplingParams
    from specdec.coordinator.config import CoordinatorConfig
    from specdec.coordinator.in_process import InProcessWorkers
    from specdec.coordinator.server import build_engine
    from specdec.coordinator.types import GenerationParams

    real_round, rounds = specdec.coordinator.request_run.speculation_round, []

    async def round_that_swallows_a_cancellation(*args, **kwargs):
        result = await real_round(*args, **kwargs)
        rounds.append(result)
        if len(rounds) == 3:  # the caller leaves now: its cancellation lands as the round's last await completes
            asyncio.current_task().cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass  # what wait_for does when its awaitable completes in the same step
        return result

    monkeypatch.setattr(specdec.coordinator.request_run, "speculation_round", round_that_swallows_a_cancellation)

    async def run():
        target, draft = TargetEngine(target_model, calibrate=False), draft_engine_for(draft_models, 0.5)
        engine = await build_engine(InProcessWorkers(target, draft), CoordinatorConfig(), tokenizer=target_model.tokenizer)
        params = GenerationParams([1, 2, 3], SamplingParams(temperature=0), 500, 4, ignore_eos=True)
        request = asyncio.ensure_future(engine.generate_all(params))
        with pytest.raises(asyncio.CancelledError):
            await request
        assert request.cancelled(), "the request ran on to a result after its cancellation"
        assert len(rounds) == 3, "a round ran after the swallowed cancellation"
        assert engine.running == 0 and len(target.sessions) == 0 and len(draft.sessions) == 0

    asyncio.run(run())
