"""Worker ports bound every field they parse, and one session's failure stays that session's.

Each oversized field is sent straight to a worker port, as a client that bypasses the coordinator would; the
worker answers INVALID_ARGUMENT naming the field and goes on serving. A session whose sampling fails fails alone:
its batch-mates get their proposals, and the coordinator keeps speculating for the next request.
"""

import asyncio

import grpc
import pytest

from specdec.common.errors import InvalidArgument
from specdec.common.rounds import Proposal
from specdec.common.sampling import SamplingParams
from specdec.common.wire_limits import MAX_P_ENTRIES, MAX_Q_ENTRIES, MAX_STEP_TOKENS
from specdec.coordinator.client import build_request
from specdec.draft_worker.engine import DraftCall, DraftEngine
from specdec.draft_worker.proposer import MODEL_FREE_MAX_CONTEXT
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.server import start_draft_server
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc, worker_pb2
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server
from tests.support.services import draft_engine_for, draft_spec, running_services

GREEDY = worker_pb2.SamplingParams(temperature=0, top_p=1.0)


def target_start(**fields) -> target_pb2.VerifyRequest:
    start = dict(prompt_token_ids=[1, 2, 3], sampling=GREEDY) | fields
    return target_pb2.VerifyRequest(start=target_pb2.VerifySessionStart(**start))


def target_step(tokens: list[int], entries: int = 1) -> target_pb2.VerifyRequest:
    dists = [
        worker_pb2.SparseDistribution(token_ids=[t, *range(100, 99 + entries)], probs=[1.0] + [0.0] * (entries - 1))
        for t in tokens
    ]
    return target_pb2.VerifyRequest(step=target_pb2.VerifyStep(draft_token_ids=tokens, draft_distributions=dists))


def draft_start(**fields) -> draft_pb2.DraftRequest:
    start = dict(prompt_token_ids=[1, 2, 3], sampling=GREEDY) | fields
    return draft_pb2.DraftRequest(start=draft_pb2.DraftSessionStart(**start))


def draft_step(num_tokens: int) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(step=draft_pb2.DraftStep(num_tokens=num_tokens))


async def refused_field(stub_method, messages) -> str:
    """Sends the messages on one stream; returns the details of the INVALID_ARGUMENT it ends with."""
    call = stub_method()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        for message in messages:
            await call.write(message)
        while await call.read() is not grpc.aio.EOF:
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return error.value.details()


TARGET_CASES = {
    "start.num_p_entries": [target_start(num_p_entries=MAX_P_ENTRIES + 1)],
    "step.draft_token_ids": [target_start(), target_step([5] * (MAX_STEP_TOKENS + 1))],
    "step.draft_distributions[0].token_ids": [target_start(), target_step([5], entries=MAX_Q_ENTRIES + 1)],
}


def test_each_oversized_target_field_is_refused_by_name_and_the_worker_serves_on(target_model):
    async def run():
        engine = TargetEngine(target_model)
        server, port = await start_target_server(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                for field, messages in TARGET_CASES.items():
                    assert (await refused_field(stub.Verify, messages)).startswith(field + ":"), field
                # At the limits themselves the worker answers.
                call = stub.Verify()
                await call.write(target_start(num_p_entries=MAX_P_ENTRIES))
                assert (await call.read()).HasField("started")
                await call.write(target_step([5] * MAX_STEP_TOKENS))
                result = (await call.read()).result
                assert len(result.distributions) == MAX_STEP_TOKENS + 1
                assert all(len(d.token_ids) == MAX_P_ENTRIES for d in result.distributions)
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
        finally:
            await server.stop(0)
        assert len(engine.sessions) == 0

    asyncio.run(run())


def test_each_oversized_draft_field_is_refused_by_name_and_the_worker_serves_on(draft_models):
    async def run():
        for engine in (draft_engine_for(draft_models, 0.1), draft_engine_for(draft_models, "ngram")):
            server, port = await start_draft_server(engine)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = draft_pb2_grpc.DraftServiceStub(channel)
                    cases = {
                        "start.max_q_entries": [draft_start(max_q_entries=MAX_Q_ENTRIES + 1)],
                        "step.num_tokens": [draft_start(), draft_step(MAX_STEP_TOKENS + 1)],
                    }
                    if not engine.proposer.vocab_size:
                        cases["start.prompt_token_ids"] = [draft_start(prompt_token_ids=[1, 2] * (MODEL_FREE_MAX_CONTEXT // 2))]
                    for field, messages in cases.items():
                        assert (await refused_field(stub.Draft, messages)).startswith(field + ":"), (engine.name, field)
                    call = stub.Draft()
                    await call.write(draft_start(prompt_token_ids=[1, 2, 3, 1, 2]))
                    assert (await call.read()).HasField("started")
                    await call.write(draft_step(MAX_STEP_TOKENS))
                    proposal = (await call.read()).proposal
                    if engine.proposer.vocab_size:
                        assert len(proposal.token_ids) == MAX_STEP_TOKENS
                    else:
                        assert list(proposal.token_ids) == [3, 1, 2]  # what followed the earlier "1 2"
                    await call.done_writing()
                    assert await call.code() == grpc.StatusCode.OK
            finally:
                await server.stop(0)
            assert len(engine.sessions) == 0

    asyncio.run(run())


def test_a_session_whose_sampling_fails_fails_alone_in_its_draft_batch(draft_models):
    engine = DraftEngine(ModelProposer(draft_models[0.1]), draft_spec(0.1))
    params = SamplingParams(temperature=1.0, seed=3)
    failing, _, _ = engine.open_session([4, 5, 6], params)
    fine, _, _ = engine.open_session([7, 8, 9], params)
    alone, _, _ = engine.open_session([7, 8, 9], params)

    def broken(logits):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    failing.state.consume = broken
    results = engine.run_batch([DraftCall(failing, 0, [], 4), DraftCall(fine, 0, [], 4)])
    assert isinstance(results[0], RuntimeError)
    assert isinstance(results[1], Proposal) and len(results[1].token_ids) == 4
    solo = engine.step(alone, 0, [], 4)
    assert results[1].token_ids == solo.token_ids  # its proposal is what it proposes alone


class PickyDraftEngine(DraftEngine):
    """A draft worker that refuses the steps of one request (prompts starting with token 42): an error of that
    session alone, as a NaN in its sampling would be."""

    def check_step(self, call):
        if call.handle.state.tokens[0] == 42:
            raise InvalidArgument("step.num_tokens", "refused for this session")
        super().check_step(call)


@pytest.mark.parametrize("temperature", [1e-40, None])
def test_one_requests_failure_on_the_draft_leaves_speculation_on_for_the_next(target_model, draft_models, temperature):
    # The reproduced hole: temperature 1e-40 overflowed to NaN in the draft's batched step, failed the request
    # and paused the draft worker, so the next ordinary request ran without speculation. Now such a temperature
    # is greedy; and a session-level draft error (the picky engine) only turns speculation off for its own request.
    async def run():
        draft = (
            draft_engine_for(draft_models, 0.1)
            if temperature is not None
            else PickyDraftEngine(ModelProposer(draft_models[0.1]), draft_spec(0.1))
        )
        async with running_services(TargetEngine(target_model), draft) as services:
            greedy = build_request([5, 6, 7], max_new_tokens=24, ignore_eos=True, temperature=0, num_speculative_tokens=3)
            if temperature is not None:
                tiny = build_request(
                    [5, 6, 7], max_new_tokens=24, ignore_eos=True, temperature=temperature, num_speculative_tokens=3
                )
                first = await services.stub.Generate(tiny)
                assert first.token_ids == (await services.stub.Generate(greedy)).token_ids  # greedy
            else:
                refused = build_request([42, 6, 7], max_new_tokens=24, ignore_eos=True, temperature=0, num_speculative_tokens=3)
                first = await services.stub.Generate(refused)
                assert first.speculation.fallback_reason == "draft_failed" and first.usage.completion_tokens == 24
            ordinary = await services.stub.Generate(
                build_request([9, 10, 11], max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=5, num_speculative_tokens=3)
            )
            assert ordinary.speculation.drafted_tokens > 0 and not ordinary.speculation.fallback_reason

    asyncio.run(run())
