"""Greedy generation through the coordinator's gRPC stub, on prompts the equivalence tests share."""

from specdec.coordinator.client import build_request


PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "def add(a, b):\n    return a + b\n\ndef"]


async def generate_ids(
    stub, prompt: str, gamma: int, max_new_tokens: int = 40, adjust: dict | None = None, **options
) -> tuple[list[int], object]:
    """adjust: GenerateRequest's logit adjustments (penalties, logit_bias) to set."""
    request = build_request(
        prompt, max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, num_speculative_tokens=gamma, **options
    )
    for name, value in (adjust or {}).items():
        if name == "logit_bias":
            request.logit_bias.update(value)
        else:
            setattr(request, name, value)
    response = await stub.Generate(request)
    return list(response.token_ids), response.speculation
