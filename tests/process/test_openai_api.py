"""The OpenAI-compatible HTTP API, driven by the official `openai` package against a real cluster (three service
processes on loopback, tiny random models), and its error cases against an in-process coordinator."""

import json
import threading
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from specdec.common.model_specs import TINY_RANDOM_CONTEXT
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port
from specdec.v1 import worker_pb2, worker_pb2_grpc  # noqa: F401 - GetInfo of the workers below
from tests.support.waiting import wait_until
from tests.support.openai_service import in_process_coordinator

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
DRAFT = f"{TARGET},noise=0.1"
TOKEN = "http-token"
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(
        TARGET,
        DRAFT,
        free_port(),
        ["--gamma", "4", "--auth-token", TOKEN],
        http_port=free_port(),
        log_dir=tmp_path_factory.mktemp("openai"),
    ) as running:
        yield running


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=TOKEN, max_retries=0) as api:
        yield api


def grpc_generate(cluster, prompt, **options):
    with GenerationClient(cluster.address, token=TOKEN) as client:
        return client.generate(prompt, ignore_eos=True, temperature=0, **options)


def worker_sessions(address: str, stub_class) -> int:
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5).active_sessions


def open_sessions(cluster) -> tuple[int, int]:
    from specdec.v1 import draft_pb2_grpc, target_pb2_grpc

    return (
        worker_sessions(cluster.target_address, target_pb2_grpc.TargetServiceStub),
        worker_sessions(cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
    )


def test_models_lists_the_target_model(client):
    assert [m.id for m in client.models.list().data] == [TARGET]


def test_greedy_completion_equals_the_grpc_api_and_counts_usage(client, cluster):
    completion = client.completions.create(model=TARGET, prompt="The pool of workers", **GREEDY)
    reference = grpc_generate(cluster, "The pool of workers", max_new_tokens=24)
    (choice,) = completion.choices
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == reference.usage.prompt_tokens
    assert completion.usage.completion_tokens == 24 == len(reference.token_ids)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 24
    speculation = completion.model_extra["speculation"]
    assert speculation["drafted_tokens"] > 0 and 0 <= speculation["accepted_tokens"] <= speculation["drafted_tokens"]
    assert speculation["rounds"] == reference.speculation.rounds


def test_greedy_chat_equals_the_grpc_api_streaming_or_not(client, cluster):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    reference = grpc_generate(cluster, messages, max_new_tokens=24)
    whole = client.chat.completions.create(model=TARGET, messages=messages, **GREEDY)
    assert whole.choices[0].message.content == reference.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == reference.usage.prompt_tokens and whole.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model=TARGET, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.model_extra["speculation"]["rounds"] == reference.speculation.rounds


def test_streamed_completion_adds_up_to_the_whole_one(client):
    whole = client.completions.create(model=TARGET, prompt="streams add up", **GREEDY)
    chunks = list(client.completions.create(model=TARGET, prompt="streams add up", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_stop_strings_end_the_text_before_them(client):
    free = client.completions.create(model=TARGET, prompt="stop me", **GREEDY).choices[0].text
    stop = free[5:7]
    assert len(stop) == 2 and stop not in free[:5]
    stopped = client.completions.create(model=TARGET, prompt="stop me", stop=[stop], **GREEDY).choices[0]
    assert stopped.text == free[: free.index(stop)] and stopped.finish_reason == "stop"


def test_the_same_seed_gives_the_same_sample(client):
    def sample(seed):
        body = {"temperature": 0.9, "max_tokens": 24, "seed": seed, "extra_body": {"ignore_eos": True}}
        return client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "roll"}], **body)

    first, again, other = sample(7), sample(7), sample(8)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


def test_speculation_by_position_is_returned_when_asked(client):
    completion = client.completions.create(
        model=TARGET, prompt="positions", max_tokens=24, temperature=0, extra_body={"speculation_by_position": True}
    )
    positions = completion.model_extra["speculation"]["by_position"]
    assert [p["position"] for p in positions] == list(range(1, 5))
    assert positions[0]["drafted"] >= positions[-1]["drafted"] > 0
    assert all(p["accepted"] <= p["drafted"] for p in positions)


def test_bad_input_gets_400_naming_the_field(client):
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
        # Beyond the cap, and beyond what the context leaves after the prompt (vLLM's 400, never a silent clamp):
        # both name the field the caller sent, in the message too.
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_tokens": TINY_RANDOM_CONTEXT}, "max_tokens"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["ok", "x" * 257]}, "stop[1]"),
    ]
    for options, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=TARGET, prompt="bad", **options)
        assert error.value.status_code == 400 and error.value.body["param"] == param, options
        assert error.value.body["message"].startswith(param + ":"), error.value.body
    # Left unset, max_tokens means up to the context: a chat request without it is served.
    unset = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert unset.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=TARGET, messages=[{"role": "robot", "content": "hi"}])
    assert error.value.body["param"] == "messages[0].role"


def test_bad_sampling_and_logprobs_fields_get_400_naming_the_callers_field(client, cluster):
    sessions_before = open_sessions(cluster)
    completions = [
        ({"n": 0}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"256": 1}}, "logit_bias"),  # the vocabulary is [0, 256)
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),  # 0 tokens only to score the prompt (echo and logprobs)
    ]
    for options, param in completions:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=TARGET, prompt="bad", **options)
        assert error.value.body["param"] == param and error.value.body["message"].startswith(param + ":"), (
            options,
            error.value.body,
        )
    chat = [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"), ({"n": 17}, "n")]
    for options, param in chat:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}], **options)
        assert error.value.body["param"] == param, (options, error.value.body)
    assert open_sessions(cluster) == sessions_before


def test_n_choices_differ_with_their_own_seeds_and_repeat_with_the_same_seed(client):
    def choices(n, seed, stream=False):
        options = {"model": TARGET, "prompt": "Once", "max_tokens": 12, "temperature": 1.0, "n": n, "seed": seed}
        if not stream:
            return [c.text for c in sorted(client.completions.create(**options).choices, key=lambda c: c.index)]
        texts = [""] * n
        for chunk in client.completions.create(**options, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        return texts

    four = choices(4, seed=7)
    assert len(set(four)) == 4, four
    assert choices(4, seed=7) == four and choices(4, seed=7, stream=True) == four
    assert choices(1, seed=7) == four[:1]  # the first choice is the request's own seed
    assert choices(4, seed=8) != four
    response = client.completions.create(
        model=TARGET, prompt="Once", max_tokens=5, n=3, **{k: v for k, v in GREEDY.items() if k != "max_tokens"}
    )
    assert response.usage.completion_tokens == 15 and response.speculation["drafted_tokens"] > 0


def test_chat_logprobs_give_each_tokens_logprob_and_its_likeliest_alternatives(client):
    messages = [{"role": "user", "content": "Count: one two three"}]
    response = client.chat.completions.create(model=TARGET, messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 24
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == response.choices[0].message.content
    for entry in content:
        alternatives = [a.logprob for a in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == alternatives[0]  # greedy: every token is its position's likeliest
    streamed = []
    for chunk in client.chat.completions.create(
        model=TARGET, messages=messages, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_with_logprobs_scores_the_prompt_as_an_eval_harness_asks(client):
    prompt = [1 + b for b in b"Hello w"]  # token ids (of the byte-level tokenizer), as lm-evaluation-harness sends them
    scored = client.completions.create(model=TARGET, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == "Hello w" and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.tokens == list("Hello w") and logprobs.text_offset == list(range(7))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(logprobs.tokens[i] in logprobs.top_logprobs[i] for i in range(1, 7))
    # One token more: the same prompt numbers, then the answer's.
    more = client.completions.create(model=TARGET, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert more.choices[0].logprobs.token_logprobs[:7] == logprobs.token_logprobs
    assert len(more.choices[0].logprobs.tokens) == 8 and more.choices[0].text.startswith("Hello w")
    # Streamed, the first chunk echoes the prompt with its numbers; the chunks add up to the whole response.
    for whole in (scored, more):
        tokens, token_logprobs, offsets, text = [], [], [], ""
        options = {"max_tokens": len(whole.choices[0].logprobs.tokens) - 7, "echo": True, "logprobs": 1, "temperature": 0}
        for chunk in client.completions.create(model=TARGET, prompt=prompt, stream=True, **options):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs:
                    tokens += choice.logprobs.tokens
                    token_logprobs += choice.logprobs.token_logprobs
                    offsets += choice.logprobs.text_offset
        expected = whole.choices[0]
        assert text == expected.text and tokens == expected.logprobs.tokens
        assert token_logprobs == expected.logprobs.token_logprobs and offsets == expected.logprobs.text_offset


class Answer(BaseModel):
    # Compact JSON (llguidance's option): with bounded values the grammar ends, so a random model's answer ends.
    model_config = ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})
    ok: bool
    n: int = Field(ge=0, le=99)
    tag: Literal["red", "green", "blue"]


def test_parse_with_a_pydantic_model_gives_target_only_output_under_speculation(client):
    def parse(**options):
        messages = [{"role": "user", "content": "answer in JSON"}]
        return client.chat.completions.parse(
            model=TARGET, messages=messages, response_format=Answer, temperature=0, max_tokens=60, **options
        )

    speculated, alone = parse(), parse(extra_body={"num_speculative_tokens": 0})
    (choice,) = speculated.choices
    assert isinstance(choice.message.parsed, Answer) and choice.finish_reason == "stop"
    assert choice.message.content == alone.choices[0].message.content
    assert speculated.model_extra["speculation"]["drafted_tokens"] > 0 == alone.model_extra["speculation"]["drafted_tokens"]


def test_a_schema_penalties_bias_and_logprobs_together_give_target_only_output_under_speculation(client):
    def parse(**options):
        messages = [{"role": "user", "content": "answer in JSON"}]
        return client.chat.completions.parse(
            model=TARGET,
            messages=messages,
            response_format=Answer,
            temperature=0,
            max_tokens=60,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias={"34": 5.0, "101": -3.0},
            logprobs=True,
            top_logprobs=3,
            **options,
        )

    speculated, alone = parse(), parse(extra_body={"num_speculative_tokens": 0})
    (choice,) = speculated.choices
    assert isinstance(choice.message.parsed, Answer)
    assert choice.message.content == alone.choices[0].message.content
    assert speculated.model_extra["speculation"]["drafted_tokens"] > 0
    ours, theirs = choice.logprobs.content, alone.choices[0].logprobs.content
    assert [e.token for e in ours] == [e.token for e in theirs] and len(ours) == speculated.usage.completion_tokens
    # The torch runner's rows may differ in their last bits with the pass's row count (the gguf engine's never do:
    # test_gguf_engine checks those bit for bit).
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(ours, theirs, strict=True))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_call_parses_against_its_schema_streamed_or_not_and_speculation_keeps_it(client):
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    body = {"model": TARGET, "messages": messages, "tools": [WEATHER], "tool_choice": NAMED, "parallel_tool_calls": False}
    body.update(temperature=0, max_tokens=120)
    speculated = client.chat.completions.create(**body)
    alone = client.chat.completions.create(**body, extra_body={"num_speculative_tokens": 0})
    (choice,) = speculated.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert alone.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert speculated.model_extra["speculation"]["drafted_tokens"] > 0
    # Streamed as OpenAI streams calls: a first delta with the call's index, id, type and name, then the arguments
    # in pieces as they are generated (index and function.arguments only), then finish_reason tool_calls.
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 5, "the arguments come in pieces as they are generated"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[0].choices[0].delta.role == "assistant" and not any(c.choices[0].delta.content for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    # With logprobs, every token's entry rides on the stream, as in the whole response.
    whole = client.chat.completions.create(**body, logprobs=True)
    chunks = list(client.chat.completions.create(**body, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens
    # The call and its result go back in the history; the next turn is served.
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    history = [*messages, choice.message.model_dump(exclude_none=True), result]
    follow_up = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert follow_up.choices[0].finish_reason in ("length", "stop", "tool_calls")


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_the_sdks_stream_helper_accumulates_a_strict_tool_call_piece_by_piece(client):
    """The official SDK's chat.completions.stream() with a strict tool (pydantic_function_tool): its events give
    the arguments as they grow, each piece parsed partially, and the final completion holds the call parsed into
    the Pydantic model, as the whole response's."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    body = {"model": TARGET, "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": [tool]}
    body.update(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120)
    whole = client.chat.completions.parse(**body)
    (call,) = whole.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)
    pieces, done = [], []
    with client.chat.completions.stream(**body) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
                assert event.name == "get_weather" and event.arguments == "".join(pieces)
            elif event.type == "tool_calls.function.arguments.done":
                done.append(event)
        final = stream.get_final_completion()
    assert len(pieces) > 5 and "".join(pieces) == call.function.arguments
    assert [(e.name, e.parsed_arguments) for e in done] == [("get_weather", call.function.parsed_arguments)]
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.arguments == call.function.arguments and streamed.id.startswith("call_")
    assert streamed.function.parsed_arguments == call.function.parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_json_object_gives_target_only_output_under_speculation(client):
    def create(**options):
        messages = [{"role": "system", "content": "answer in JSON"}, {"role": "user", "content": "a colour"}]
        return client.chat.completions.create(
            model=TARGET, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=40, **options
        )

    speculated, alone = create(), create(extra_body={"num_speculative_tokens": 0})
    content = speculated.choices[0].message.content
    assert content.startswith("{") and content == alone.choices[0].message.content
    if speculated.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    assert speculated.model_extra["speculation"]["drafted_tokens"] > 0 == alone.model_extra["speculation"]["drafted_tokens"]


def test_chat_n_choices_differ_with_their_own_seeds_and_repeat_with_the_same_streamed_or_not(client):
    def choices(seed, stream=False, **options):
        body = {"model": TARGET, "messages": [{"role": "user", "content": "roll"}], "n": 3, "seed": seed}
        body.update(temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True, **options})
        if not stream:
            response = client.chat.completions.create(**body)
            return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)], response
        texts = [""] * 3
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts, None

    three, response = choices(11)
    assert len(set(three)) == 3, three
    assert response.usage.completion_tokens == 36 and response.model_extra["speculation"]["drafted_tokens"] > 0
    assert choices(11)[0] == three and choices(11, stream=True)[0] == three
    assert choices(12)[0] != three


def test_bad_constraints_and_tool_choices_get_400_naming_the_callers_field(client):
    user = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}, "strict": True}}
    cases = [
        ({"response_format": bad_schema}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"grammar": "start: x\nx: y"}}, "grammar"),  # y is never defined
        ({"extra_body": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(9000))}}, "grammar"),  # too big
        ({"response_format": {"type": "json_object"}, "extra_body": {"grammar": 'start: "a"'}}, "grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"},
            "tools",
        ),
    ]
    for options, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=TARGET, messages=user, max_tokens=4, **options)
        assert error.value.status_code == 400 and error.value.body["param"] == param, (options, error.value.body)
        assert error.value.body["message"].startswith(param + ":"), error.value.body
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=TARGET, prompt="hi", max_tokens=4, extra_body={"tools": [WEATHER]})
    assert error.value.body["param"] == "tools"


def test_a_missing_or_wrong_token_gets_401(cluster):
    import httpx2

    with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="wrong", max_retries=0) as api:
        with pytest.raises(openai.AuthenticationError) as error:
            api.completions.create(model=TARGET, prompt="who am I", max_tokens=2)
        assert error.value.status_code == 401 and error.value.body["type"] == "authentication_error"
    body = {"model": TARGET, "prompt": "no token", "max_tokens": 2}
    response = httpx2.post(f"http://127.0.0.1:{cluster.http_port}/v1/completions", json=body, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_the_model_list_needs_the_token_too(cluster):
    import httpx2

    response = httpx2.get(f"http://127.0.0.1:{cluster.http_port}/v1/models", timeout=10)
    assert response.status_code == 401


def test_null_fields_take_their_defaults_and_other_sdks_fields_are_refused_or_ignored(client):
    import httpx2

    url = f"http://127.0.0.1:{client.base_url.port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": TARGET, "messages": [{"role": "developer", "content": "brief"}, {"role": "user", "content": "hi"}]}
    nulls = {"n": None, "stream": None, "frequency_penalty": None, "presence_penalty": None, "seed": -1, "max_tokens": 3}
    response = httpx2.post(url, json={**body, **nulls, "unknown_field": 1}, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3
    refused = [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": 5}, "stop"),
    ]
    for extra, param in refused:
        response = httpx2.post(url, json={**body, **extra}, headers=headers, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (extra, response.text)


def test_an_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 404 and error.value.body["code"] == "model_not_found"


def test_a_client_that_disconnects_mid_stream_frees_both_sessions(client, cluster):
    wait_until(lambda: open_sessions(cluster) == (0, 0), 5, interval=0.05, message="sessions of earlier tests are open")
    # 4,096 tokens take the tiny models several seconds: only the disconnect can free the sessions within one.
    stream = client.completions.create(
        model=TARGET, prompt="a long answer", max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert open_sessions(cluster) == (1, 1), "the request holds a session on each worker while it streams"
    stream.close()
    freed = "the sessions of the abandoned stream were not freed"
    wait_until(lambda: open_sessions(cluster) == (0, 0), 1.0, interval=0.05, message=freed)


def test_sixteen_concurrent_streaming_clients_all_complete_with_their_solo_output(client, cluster):
    prompts = [f"client {i} streams" for i in range(16)]
    solo = {p: client.completions.create(model=TARGET, prompt=p, **GREEDY).choices[0].text for p in prompts}
    texts, errors = {}, []

    def stream(prompt):
        try:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=TOKEN, max_retries=0) as api:
                chunks = api.completions.create(model=TARGET, prompt=prompt, stream=True, **GREEDY)
                texts[prompt] = "".join(c.choices[0].text for c in chunks)
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == [] and texts == solo


# Error statuses that need a coordinator in a given state: in this process, over a real target worker.


def test_a_full_coordinator_answers_429():
    async def scenario(client, target):
        body = {"model": TARGET, "prompt": "hold", "max_tokens": 2000, "temperature": 0, "extra_body": {"ignore_eos": True}}
        holding = await client.completions.create(stream=True, **body)
        await anext(aiter(holding))
        with pytest.raises(openai.RateLimitError) as error:
            await client.completions.create(model=TARGET, prompt="one more", max_tokens=2)
        assert error.value.status_code == 429 and error.value.response.headers["retry-after"]
        await holding.close()

    in_process_coordinator(scenario, max_concurrent_requests=1)


def test_an_unavailable_target_answers_503():
    async def scenario(client, target):
        await target.stop(0)
        with pytest.raises(openai.InternalServerError) as error:
            await client.completions.create(model=TARGET, prompt="nobody home", max_tokens=2)
        assert error.value.status_code == 503 and "target worker unavailable" in error.value.body["message"]
        # The coordinator already retried the workers: the SDK is told not to retry.
        assert error.value.response.headers["x-should-retry"] == "false"

    in_process_coordinator(scenario, retry_window=1.0)
