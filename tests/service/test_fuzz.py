"""Property-based fuzzing: random GenerateRequest fields and raw malformed bytes sent to every service. Each
call ends in a result or a clear error (never INTERNAL or UNKNOWN), and the services stay healthy."""

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.coordinator.client import build_request
from specdec.v1 import draft_pb2, generation_pb2, target_pb2, worker_pb2
from specdec.target_worker.engine import TargetEngine
from tests.support.services import BackgroundServices, draft_engine_for

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
counts = {"requests": 0, "raw": 0, "worker": 0}


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
        # Up to and past the limits (16 strings of 256 characters).
        stop=draw(st.lists(st.text(max_size=4), max_size=3) | st.lists(st.text(min_size=250, max_size=260), max_size=17)),
        ignore_eos=draw(st.booleans()),
        num_speculative_tokens=draw(st.none() | st.integers(min_value=-5, max_value=20)),
    )


def assert_healthy(channels, services) -> None:
    for channel in channels.values():
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
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


def large_binary():
    """Random bytes up to the message limit's neighbourhood (1 MiB here, 16 MiB for one case), drawn from a seed:
    hypothesis itself builds small binaries only."""
    import random

    sizes = st.sampled_from([1000, 65_536, 1 << 20, 16 * (1 << 20) - 64])
    return st.tuples(st.integers(0, 2**32), sizes).map(lambda seed_size: random.Random(seed_size[0]).randbytes(seed_size[1]))


@FUZZ
@given(
    method=st.sampled_from(sorted(METHODS)),
    payloads=st.lists(st.binary(max_size=64) | large_binary(), min_size=1, max_size=3),
)
def test_raw_malformed_bytes_get_a_clear_error_and_break_nothing(channels, services, method, payloads):
    counts["raw"] += 1
    channel = channels["coordinator" if "Generation" in method else ("target" if "Target" in method else "draft")]
    try:
        call_raw(channel, method, METHODS[method], payloads)
    except grpc.RpcError as error:
        assert error.code() in CLEAR_ERRORS, (method, payloads, error.code(), error.details())


def sparse(draw, vocab: int):
    entries = draw(st.integers(min_value=0, max_value=1100))
    token_ids = draw(st.lists(st.integers(min_value=-1, max_value=vocab), min_size=entries, max_size=entries))
    return worker_pb2.SparseDistribution(token_ids=token_ids, probs=[1.0 / max(1, entries)] * entries)


@st.composite
def worker_streams(draw):
    """A session stream sent straight to a worker port: a start with any limits, then a few steps of any size."""
    sampling = worker_pb2.SamplingParams(
        temperature=draw(floats() | st.sampled_from([1e-40, 1e-6, 1e30])),
        top_k=draw(st.integers(-2, 10**6)),
        top_p=draw(floats()),
    )
    prompt = draw(st.lists(st.integers(min_value=-1, max_value=300), min_size=0, max_size=40))
    max_tokens = draw(st.integers(min_value=-5, max_value=10**6))
    if draw(st.booleans()):
        start = target_pb2.VerifySessionStart(
            prompt_token_ids=prompt, sampling=sampling, num_p_entries=draw(st.integers(-2, 100)), max_tokens=max_tokens
        )
        messages = [target_pb2.VerifyRequest(start=start)]
        for _ in range(draw(st.integers(0, 3))):
            tokens = draw(st.lists(st.integers(min_value=-1, max_value=300), max_size=40))
            dists = [sparse(draw, 300) for _ in range(draw(st.integers(0, min(len(tokens) + 1, 3))))]
            step = target_pb2.VerifyStep(draft_token_ids=tokens, draft_distributions=dists)
            messages.append(target_pb2.VerifyRequest(step=step))
        return "/specdec.v1.TargetService/Verify", messages
    start = draft_pb2.DraftSessionStart(
        prompt_token_ids=prompt, sampling=sampling, max_q_entries=draw(st.integers(-2, 2000)), max_tokens=max_tokens
    )
    messages = [draft_pb2.DraftRequest(start=start)]
    for _ in range(draw(st.integers(0, 3))):
        step = draft_pb2.DraftStep(
            num_accepted=draw(st.integers(-2, 5)),
            committed_token_ids=draw(st.lists(st.integers(min_value=-1, max_value=300), max_size=5)),
            num_tokens=draw(st.integers(-2, 40)),
            assume_accepted=draw(st.booleans()),
        )
        messages.append(draft_pb2.DraftRequest(step=step))
    return "/specdec.v1.DraftService/Draft", messages


@settings(FUZZ, max_examples=150)
@given(stream=worker_streams())
def test_any_worker_stream_up_to_and_past_the_limits_gets_answers_or_a_clear_error(channels, services, stream):
    method, messages = stream
    counts["worker"] += 1
    channel = channels["target" if "Target" in method else "draft"]
    call = channel.stream_stream(method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None)
    try:
        assert len(list(call(iter(messages), timeout=30))) <= len(messages)
    except grpc.RpcError as error:
        assert error.code() in CLEAR_ERRORS, (error.code(), error.details())
        assert error.details()


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
    requests, raw, worker = counts["requests"], counts["raw"], counts["worker"]
    print(f"\nfuzz cases: {requests} GenerateRequests, {raw} raw byte payloads, {worker} worker streams")
