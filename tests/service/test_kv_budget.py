"""Admission by KV tokens: each session reserves what it may hold, the reservations never exceed the worker's
budget, and a cache never grows past its reservation."""

import asyncio

import grpc
import pytest

from specdec.common.errors import ResourceExhausted
from specdec.common.sampling import SamplingParams
from specdec.draft_worker.proposer import point_mass
from specdec.common.sessions import SessionRegistry
from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.target_worker.engine import PrefillCall, TargetEngine, VerifyCall
from tests.support.services import draft_engine_for, running_services

GREEDY = SamplingParams(temperature=0)


def cache_capacity(session) -> int:
    """Tokens the session's cache buffers have room for (every layer alike)."""
    return max(layer.key_buffer.shape[-2] for layer in session.sequence.cache.layers)


def test_a_cache_never_grows_past_its_sessions_reservation(target_model):
    engine = TargetEngine(target_model, calibrate=False)
    prompt = list(range(1, 71))
    session = engine.begin_session(prompt, GREEDY, max_tokens=100)
    engine.run_batch([PrefillCall(session)])
    for _ in range(6):  # rounds of 4 drafted tokens on the 69 cached: the buffer doubles, 69 to 138 uncapped
        verdict = engine.run_batch([VerifyCall(session, [5, 6, 7, 8], [point_mass(t) for t in (5, 6, 7, 8)])])[0]
        assert not isinstance(verdict, Exception), verdict
    assert len(session.sequence.tokens) >= 76 and 69 < cache_capacity(session) <= 100
    refused = engine.run_batch([VerifyCall(session, [5] * 30, [point_mass(5)] * 30)])[0]  # beyond the reservation: refused
    assert "start.max_tokens" in str(refused)
    assert engine.sessions.reserved_kv_tokens == 100
    engine.close_session(session)
    assert engine.sessions.reserved_kv_tokens == 0


def test_reservations_never_exceed_the_budget_and_are_freed_with_their_sessions():
    registry = SessionRegistry(max_sessions=8, max_kv_tokens=1000)
    first, second = registry.reserve(600), registry.reserve(400)
    with pytest.raises(ResourceExhausted, match="0 of this worker's 1000 are free; retry later"):
        registry.reserve(1)
    with pytest.raises(ResourceExhausted, match="can never fit"):
        registry.reserve(1001)
    registry.release(first)
    assert registry.reserved_kv_tokens == 400 and registry.reserve(600)
    registry.release(second)


class TrackedTarget(TargetEngine):
    """Keeps every session it opens, to add up the bytes their caches hold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.opened = []

    def begin_session(self, *args, **kwargs):
        session = super().begin_session(*args, **kwargs)
        self.opened.append(session)
        return session

    def cache_bytes(self) -> int:
        """Bytes of key and value buffers of the sessions that hold a reservation now (open or prefilling)."""
        held = [s for s in self.opened if s.session_id in self.sessions.kv_tokens]
        return sum(
            layer.key_buffer.nbytes + layer.value_buffer.nbytes
            for s in held
            for layer in s.sequence.cache.layers
            if getattr(layer, "key_buffer", None) is not None
        )


def test_concurrent_long_prompts_beyond_the_budget_are_refused_by_name_and_the_rest_match_their_solo_output(
    target_model, draft_models
):
    # A budget of 3 long requests' worth: 8 sent at once. The worker stays up, its reservations stay within the
    # budget, the refused requests get RESOURCE_EXHAUSTED saying why, and every served one equals its output alone.
    prompt_tokens, new_tokens = 600, 16
    per_request = prompt_tokens + new_tokens + 4 + 2  # prompt, answer, gamma and the pending/assumed tokens
    target = TrackedTarget(target_model, max_kv_tokens=3 * per_request)
    config = CoordinatorConfig(default_num_speculative_tokens=4)

    def request(i: int):
        prompt = [(7 * i + j) % 250 + 1 for j in range(prompt_tokens)]
        return build_request(prompt, max_new_tokens=new_tokens, ignore_eos=True, temperature=0)

    async def run():
        async with running_services(target, draft_engine_for(draft_models, 0.1), config) as services:
            solo = [(await services.stub.Generate(request(i))).token_ids for i in range(8)]
            peak = 0

            peak_bytes = 0

            async def watch():
                nonlocal peak, peak_bytes
                while True:
                    peak = max(peak, target.sessions.reserved_kv_tokens)
                    peak_bytes = max(peak_bytes, target.cache_bytes())
                    await asyncio.sleep(0.001)

            watcher = asyncio.ensure_future(watch())
            results = await asyncio.gather(*(services.stub.Generate(request(i)) for i in range(8)), return_exceptions=True)
            watcher.cancel()
            served = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
            refused = [r for r in results if isinstance(r, Exception)]
            assert served and refused, results
            for error in refused:
                assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "KV tokens" in error.details()
            for i in served:
                assert list(results[i].token_ids) == list(solo[i])
            assert 0 < peak <= 3 * per_request
            # The memory the caches took, not only what was booked: within the budget's bytes.
            assert 0 < peak_bytes <= 3 * per_request * target.runner.kv_bytes_per_token, (peak_bytes, per_request)
            ok = await services.stub.Generate(request(0))  # still serving, budget all free again
            assert list(ok.token_ids) == list(solo[0]) and target.sessions.reserved_kv_tokens == 0

    asyncio.run(run())


def test_a_request_that_can_never_fit_is_refused_at_once(target_model):
    async def run():
        async with running_services(TargetEngine(target_model, max_kv_tokens=100), None) as services:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await services.stub.Generate(build_request(list(range(1, 90)), max_new_tokens=50, temperature=0))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never fit" in error.value.details()
            fits = await services.stub.Generate(build_request(list(range(1, 20)), max_new_tokens=10, temperature=0))
            assert fits.usage.completion_tokens >= 1

    asyncio.run(run())


def test_a_prompt_longer_than_the_limit_is_refused_before_tokenizing(target_model):
    async def run():
        config = CoordinatorConfig(max_prompt_chars=1000)
        async with running_services(TargetEngine(target_model), None, config) as services:
            for request, field in [
                (build_request("x" * 1001), "prompt"),
                (build_request([{"role": "user", "content": "x" * 600}] * 2), "messages"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await services.stub.Generate(request)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith(f"{field}: "), error.value.details()

    asyncio.run(run())
