"""Property-based fuzzing: random GenerateRequest fields and raw malformed bytes sent to every service. Each
call ends in a result or a clear error (never INTERNAL or UNKNOWN), and the services stay healthy."""

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.client import build_request
from specdec.v1 import generation_pb2
from target_worker.engine import TargetEngine
from tests.conftest import BackgroundServices, draft_engine_for

CLEAR_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
METHODS = {
    "/specdec.v1.GenerationService/Generate": "unary",
    "/specdec.v1.GenerationService/GenerateStream": "server_stream",
    "/specdec.v1.TargetService/Verify": "bidi",
    "/specdec.v1.DraftService/Draft": "bidi",
    "/specdec.v1.TargetService/GetInfo": "unary",
    "/specdec.v1.DraftService/GetInfo": "unary",
}
counts = {"requests": 0, "raw": 0}


@pytest.fixture(scope="module")
def services(target_model, draft_models):
    background = BackgroundServices(TargetEngine(target_model), draft_engine_for(draft_models, 0.5))
    yield background.services
    background.stop()


@pytest.fixture(scope="module")
def channels(services):
    opened = {
        name: grpc.insecure_channel(address)
        for name, address in [
            ("coordinator", services.coordinator_address),
            ("target", services.target_address),
            ("draft", services.draft_address),
        ]
    }
    yield opened
    for channel in opened.values():
        channel.close()


def floats():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, math.nan, -1.0]))


prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=12),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot", ""]), "content": st.text(max_size=20)}
        ),
        max_size=3,
    ),
)


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    optional = st.none() | st.integers(min_value=-(2**31), max_value=2**31 - 1)
    return build_request(
        draw(prompts),
        max_new_tokens=draw(st.none() | st.integers(min_value=-3, max_value=12) | st.just(10**7)),
        temperature=draw(st.none() | floats()),
        top_p=draw(st.none() | floats()),
        top_k=draw(optional),
        seed=draw(st.none() | st.integers(min_value=0, max_value=2**64 - 1)),
        stop=draw(st.lists(st.text(max_size=4), max_size=3)),
        ignore_eos=draw(st.booleans()),
        num_speculative_tokens=draw(st.none() | st.integers(min_value=-5, max_value=20)),
    )


def assert_healthy(channels, services) -> None:
    for channel in channels.values():
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@FUZZ
@given(request=generate_requests(), stream=st.booleans())
def test_any_generate_request_gets_a_result_or_a_clear_error(channels, request, stream):
    counts["requests"] += 1
    stub_method = "/specdec.v1.GenerationService/GenerateStream" if stream else "/specdec.v1.GenerationService/Generate"
    channel = channels["coordinator"]
    try:
        if stream:
            call = channel.unary_stream(
                stub_method,
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=generation_pb2.GenerateStreamResponse.FromString,
            )
            messages = list(call(request, timeout=30))
            assert messages[-1].HasField("final")
        else:
            call = channel.unary_unary(
                stub_method,
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            response = call(request, timeout=30)
            assert response.usage.completion_tokens >= 1
    except grpc.RpcError as error:
        assert error.code() in CLEAR_ERRORS, (error.code(), error.details())
        assert error.details()


def call_raw(channel, method: str, kind: str, payloads: list[bytes]):
    identity = dict(request_serializer=None, response_deserializer=None)
    if kind == "unary":
        return [channel.unary_unary(method, **identity)(payloads[0], timeout=10)]
    if kind == "server_stream":
        return list(channel.unary_stream(method, **identity)(payloads[0], timeout=10))
    return list(channel.stream_stream(method, **identity)(iter(payloads), timeout=10))


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_raw_malformed_bytes_get_a_clear_error_and_break_nothing(channels, services, method, payloads):
    counts["raw"] += 1
    channel = channels["coordinator" if "Generation" in method else ("target" if "Target" in method else "draft")]
    try:
        call_raw(channel, method, METHODS[method], payloads)
    except grpc.RpcError as error:
        assert error.code() in CLEAR_ERRORS, (method, payloads, error.code(), error.details())


def test_invalid_utf8_names_its_field(channels):
    prompt = generation_pb2.GenerateRequest(prompt="x").SerializeToString().replace(b"x", b"\xff")
    with pytest.raises(grpc.RpcError) as error:
        channels["coordinator"].unary_unary("/specdec.v1.GenerationService/Generate")(prompt, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("prompt:")
    chat = build_request([{"role": "user", "content": "y"}]).SerializeToString().replace(b"y", b"\xc3")
    with pytest.raises(grpc.RpcError) as error:
        channels["coordinator"].unary_unary("/specdec.v1.GenerationService/Generate")(chat, timeout=10)
    assert error.value.details().startswith("messages.messages[0].content:")


def test_services_are_healthy_and_hold_no_sessions_after_fuzzing(channels, services):
    assert_healthy(channels, services)
    assert len(services.target.sessions) == 0 and len(services.draft.sessions) == 0
    print(f"\nfuzz cases: {counts['requests']} GenerateRequests, {counts['raw']} raw byte payloads")
