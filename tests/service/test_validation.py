"""Every bad request gets INVALID_ARGUMENT naming its field, and the services keep serving."""

import asyncio
import math

import grpc
import pytest

from specdec.coordinator.client import build_request
from specdec.v1 import generation_pb2
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for, running_services

BAD_REQUESTS = {
    "input": generation_pb2.GenerateRequest(),
    "prompt": build_request(""),
    "messages[0].role": build_request([{"role": "wizard", "content": "hi"}]),
    "temperature": build_request("hi", temperature=-1.0),
    "temperature ": build_request("hi", temperature=math.nan),
    "top_p": build_request("hi", top_p=0.0),
    "top_p ": build_request("hi", top_p=1.5),
    "top_k": build_request("hi", top_k=-1),
    "max_new_tokens": build_request("hi", max_new_tokens=0),
    "max_new_tokens ": build_request("hi", max_new_tokens=10**6),
    "num_speculative_tokens": build_request("hi", num_speculative_tokens=17),
    "num_speculative_tokens ": build_request("hi", num_speculative_tokens=-3),
    "prompt_token_ids": build_request([1, 2, 999]),
    "stop": build_request("hi", stop=[""]),
    "stop ": build_request("hi", stop=["a"] * 17),
    "stop[1]": build_request("hi", stop=["a", "b" * 257]),
    "messages": build_request([{"role": "user", "content": "hi"}] * 1025),
    # Asked for explicitly, max_new_tokens must fit the context after the prompt (4096 for the tiny model).
    "max_new_tokens  ": build_request("hi", max_new_tokens=4095),
    "prompt  ": build_request("x" * 5000),
}


def test_bad_fields_get_invalid_argument_naming_the_field(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            for field, request in BAD_REQUESTS.items():
                for method in (services.stub.Generate, lambda r: services.stub.GenerateStream(r).read()):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await method(request)
                    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                    assert error.value.details().startswith(field.strip()), (field, error.value.details())
            ok = await services.stub.Generate(build_request("still serving", max_new_tokens=5))
            assert ok.usage.completion_tokens >= 1
            assert len(services.target.sessions) == 0 and len(services.draft.sessions) == 0

    asyncio.run(run())


def test_chat_messages_are_rendered_with_the_template(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.5)) as services:
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            response = await services.stub.Generate(build_request(messages, max_new_tokens=5))
            expected = len(target_model.tokenizer.render_chat(messages))
            assert response.usage.prompt_tokens == expected

    asyncio.run(run())
