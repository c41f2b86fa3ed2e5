"""The real pair: Qwen2.5-Coder-1.5B verified by its 0.5B sibling, served through the gRPC services, on the torch
engine (packed linear layers, the draft int8) and on the gguf engine. Greedy speculative output is token for token
the target-only output."""

import asyncio

import pytest

from specdec.common.models import load_model
from specdec.coordinator.client import build_request
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.services import running_services

pytestmark = pytest.mark.slow  # loads the 1.5B pair (minutes)

TARGET = "qwen2.5-coder-1.5b"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Fix the bug: def mean(xs): return sum(xs) / len(x)",
]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real_pair():
    draft_spec = "qwen2.5-coder-0.5b#int8"
    return load_model(TARGET), load_model(draft_spec), draft_spec


async def generate(stub, prompt: str, gamma: int):
    request = build_request(
        [{"role": "user", "content": prompt}],
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0,
        ignore_eos=True,
        num_speculative_tokens=gamma,
    )
    response = await stub.Generate(request)
    return list(response.token_ids), response.speculation


def assert_speculation_is_exact_and_accepted(target, draft, draft_spec: str) -> None:
    async def run():
        target_engine = TargetEngine(target, calibrate=False)
        draft_engine = DraftEngine(ModelProposer(draft, calibrate=False), draft_spec)
        async with running_services(target_engine, draft_engine) as services:
            for prompt in PROMPTS:
                reference, _ = await generate(services.stub, prompt, gamma=0)
                assert len(reference) == MAX_NEW_TOKENS
                ids, stats = await generate(services.stub, prompt, gamma=4)
                assert ids == reference, f"speculative output diverged from target-only on {prompt!r}"
                # A real sibling draft is accepted most of the time on code; a broken one would be rejected.
                assert stats.acceptance_rate > 0.3 and stats.rounds < MAX_NEW_TOKENS / 2 and not stats.fallback_reason

    asyncio.run(run())


def test_greedy_output_matches_target_only_on_the_real_pair(real_pair):
    target, draft, draft_spec = real_pair
    assert_speculation_is_exact_and_accepted(target, draft, draft_spec)


def test_greedy_output_matches_target_only_on_the_real_pair_on_the_gguf_engine():
    """The pair on its own Q4_K/Q6_K/Q5_0/Q8_0 blocks (the CPU default): the same guarantee, on the new kernels."""
    target = load_model(TARGET, engine="gguf")
    draft = load_model("qwen2.5-coder-0.5b", engine="gguf")
    assert target.engine == draft.engine == "gguf"

    assert_speculation_is_exact_and_accepted(target, draft, "qwen2.5-coder-0.5b")
