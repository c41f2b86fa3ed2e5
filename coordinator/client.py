"""A small client of GenerationService for other Python services.

from coordinator.client import GenerationClient
with GenerationClient("localhost:50051") as client:
    print(client.generate("Hello", max_new_tokens=32, temperature=0).text)
    for delta in client.stream("Hello"):
        print(delta.text, end="")
"""

from collections.abc import Iterator

import grpc

from common.server import GRPC_OPTIONS
from coordinator.types import FINISH_REASON_NAMES
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
        "usage": {"prompt_tokens": response.usage.prompt_tokens, "completion_tokens": response.usage.completion_tokens},
        "speculation": {
            "rounds": spec.rounds,
            "drafted_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "acceptance_rate": spec.acceptance_rate,
            "mean_tokens_per_round": spec.mean_tokens_per_round,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "fallback_reason": spec.fallback_reason,
            "overlap": spec.overlap,
            "overlapped_rounds": spec.overlapped_rounds,
        },
        "time_split_us": {name: getattr(response.time_split, name) for name in TIME_SPLIT_FIELDS},
    }


class GenerationClient:
    """token: the coordinator's bearer token, if it requires one; tls_ca: the CA of its certificate (enables TLS)."""

    def __init__(
        self, endpoint: str = "localhost:50051", timeout: float | None = None, token: str | None = None, tls_ca: str | None = None
    ):
        if tls_ca:
            with open(tls_ca, "rb") as f:
                self.channel = grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(f.read()), options=GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def generate(self, prompt, **kwargs) -> generation_pb2.GenerateResponse:
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)

    def stream(self, prompt, **kwargs) -> Iterator[generation_pb2.GenerateStreamResponse]:
        """Yields GenerateStreamResponse messages: deltas (.delta) and finally the whole result (.final)."""
        yield from self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
