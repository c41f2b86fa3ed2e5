"""A small client of GenerationService for other Python services.

from specdec.coordinator.client import GenerationClient
with GenerationClient("localhost:50051") as client:  # or ["host-a:50051", "host-b:50051"], or "dns:///name:50051"
    print(client.generate("Hello", max_new_tokens=32, temperature=0).text)
    for delta in client.stream("Hello"):
        print(delta.text, end="")
"""

import itertools
import json
from collections.abc import Iterator

import grpc

from specdec.common.grpc_options import GRPC_OPTIONS
from specdec.coordinator.addresses import parse_addresses
from specdec.coordinator.finish_reasons import FINISH_REASON_NAMES
from specdec.v1 import generation_pb2, generation_pb2_grpc


def build_request(
    prompt: str | list[int] | list[dict[str, str]],
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    num_speculative_tokens: int | None = None,
    include_rounds: bool = False,
    gamma_schedule: str | None = None,
    overlap: bool | None = None,
) -> generation_pb2.GenerateRequest:
    """A request from a prompt string, a list of token ids, or chat messages ({"role", "content"} dicts)."""
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "num_speculative_tokens": num_speculative_tokens,
        "overlap": overlap,
    }
    request = generation_pb2.GenerateRequest(
        gamma_schedule=f"GAMMA_SCHEDULE_{gamma_schedule.upper()}" if gamma_schedule else "GAMMA_SCHEDULE_UNSPECIFIED",
        stop=stop or [],
        ignore_eos=ignore_eos,
        include_rounds=include_rounds,
        **{k: v for k, v in optional.items() if v is not None},
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.messages.messages.extend(generation_pb2.ChatMessage(**m) for m in prompt)
    else:
        request.prompt_token_ids.token_ids.extend(prompt)
    return request


TIME_SPLIT_FIELDS = [f.name for f in generation_pb2.TimeSplit.DESCRIPTOR.fields]


def response_to_dict(response: generation_pb2.GenerateResponse) -> dict:
    spec = response.speculation
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": FINISH_REASON_NAMES.get(response.finish_reason, "unspecified"),
        "usage": {
            "prompt_tokens": response.usage.prompt_tokens,
            "completion_tokens": response.usage.completion_tokens,
            "cached_prompt_tokens": response.usage.cached_prompt_tokens,
        },
        "speculation": {field.name: getattr(spec, field.name) for field in spec.DESCRIPTOR.fields},
        "time_split_us": {name: getattr(response.time_split, name) for name in TIME_SPLIT_FIELDS},
    }


# Requests are spread over the addresses a name resolves to (a dns:/// target: several coordinators behind a
# headless Service), and one refused with UNAVAILABLE before it produced anything (a coordinator draining on
# SIGTERM) is retried, by gRPC itself, on the next.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": "specdec.v1.GenerationService"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
        # Retries stop when more than half of recent calls failed (a coordinator pool that is down, not draining).
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
)
CLIENT_OPTIONS = [*GRPC_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]


def for_another(error: grpc.RpcError) -> bool:
    """A refusal that another coordinator may not give: UNAVAILABLE, unless the coordinator says that it already
    retried (see common.grpc_errors.NO_RETRY)."""
    pushback = dict(error.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    return error.code() == grpc.StatusCode.UNAVAILABLE and pushback != "-1"


class GenerationClient:
    """endpoint: a coordinator's address, several (a list or comma-separated: requests rotate over them, and one
    refused as UNAVAILABLE before any answer goes to the next), or a dns:///name:port target (round_robin over the
    addresses it resolves to). token: the coordinator's bearer token, if it requires one; tls_ca: the CA of its
    certificate (enables TLS)."""

    def __init__(
        self,
        endpoint: str | list[str] = "localhost:50051",
        timeout: float | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
    ):
        credentials = None
        if tls_ca:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        self.channels = [
            grpc.secure_channel(address, credentials, options=CLIENT_OPTIONS)
            if credentials
            else grpc.insecure_channel(address, options=CLIENT_OPTIONS)
            for address in parse_addresses(endpoint)
        ]
        self.stubs = [generation_pb2_grpc.GenerationServiceStub(channel) for channel in self.channels]
        self.turn = itertools.count()
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    @property
    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        return self.stubs[0]

    def rotation(self) -> list[generation_pb2_grpc.GenerationServiceStub]:
        """The stubs in the order this call tries them: each call starts at the next one."""
        first = next(self.turn) % len(self.stubs)
        return self.stubs[first:] + self.stubs[:first]

    def generate(self, prompt, **kwargs) -> generation_pb2.GenerateResponse:
        request = build_request(prompt, **kwargs)
        stubs = self.rotation()
        for i, stub in enumerate(stubs):
            try:
                return stub.Generate(request, timeout=self.timeout, metadata=self.metadata)
            except grpc.RpcError as error:
                if not for_another(error) or i == len(stubs) - 1:
                    raise
        raise AssertionError("unreachable")

    def stream(self, prompt, **kwargs) -> Iterator[generation_pb2.GenerateStreamResponse]:
        """Yields GenerateStreamResponse messages: deltas (.delta) and finally the whole result (.final)."""
        request = build_request(prompt, **kwargs)
        stubs = self.rotation()
        for i, stub in enumerate(stubs):
            started = False
            try:
                for message in stub.GenerateStream(request, timeout=self.timeout, metadata=self.metadata):
                    started = True
                    yield message
                return
            except grpc.RpcError as error:
                if started or not for_another(error) or i == len(stubs) - 1:
                    raise

    def status(self) -> generation_pb2.GetStatusResponse:
        return self.stub.GetStatus(generation_pb2.GetStatusRequest(), timeout=self.timeout or 10, metadata=self.metadata)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
