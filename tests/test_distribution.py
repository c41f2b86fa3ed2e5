"""Lossless, proven statistically: the first tokens generated with speculation follow the target's exact
distribution (computed by enumerating every continuation), for plain temperature sampling, top-k and top-p.

The runs go through the coordinator's real speculation loop and the real worker engines, in one process so that
thousands of requests fit in seconds; the gRPC layer carries these values unchanged (float32 both ends).
"""

import asyncio
import itertools
from dataclasses import replace

import pytest
import torch
from scipy import stats

from common.models import load_model
from common.sampling import SamplingParams, adjusted_logits, logits_to_probs
from coordinator.config import CoordinatorConfig
from coordinator.types import GenerationParams
from coordinator.in_process import InProcessWorkers
from coordinator.server import build_engine
from draft_worker.engine import DraftEngine
from draft_worker.model_proposer import ModelProposer
from draft_worker.proposer import Proposer
from target_worker.engine import TargetEngine

VOCAB = 6
TOKENS = 3
SAMPLES = 3000
TARGET = f"tiny-random:seed=3,vocab={VOCAB},layers=1,hidden=16"
DRAFT = f"{TARGET},noise=1.5"
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def models():
    return load_model(TARGET), load_model(DRAFT)


def enumerate_sequences(
    model, params: SamplingParams, tokens: int = TOKENS, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    """P(first `tokens` tokens) under target-only sampling, by scoring every prefix without any cache (and adjusting
    each prefix's logits by its own tokens)."""
    vocab = model.vocab_size
    probs = {(): 1.0}
    for _ in range(tokens):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float()
        logits = torch.cat(
            [adjusted_logits(logits[i : i + 1], params, prompt + list(p), len(prompt), []) for i, p in enumerate(prefixes)]
        )
        step = logits_to_probs(logits, params)
        probs = {prefix + (t,): probs[prefix] * float(step[i, t]) for i, prefix in enumerate(prefixes) for t in range(vocab)}
    return probs


def sample_sequences(
    target,
    draft,
    params: SamplingParams,
    gamma: int,
    tokens: int = TOKENS,
    samples: int = SAMPLES,
    overlap: bool = False,
    prompt: list[int] = PROMPT,
    proposer: Proposer | None = None,
) -> tuple[list[tuple[int, ...]], int, tuple[int, int]]:
    """The first `tokens` tokens of `samples` seeded requests, how many rounds used an overlapped proposal, and the
    tokens drafted and accepted over all of them. The draft: the model `draft`, or `proposer`."""

    async def run():
        proposer_ = proposer or ModelProposer(draft, calibrate=False)
        workers = InProcessWorkers(TargetEngine(target, calibrate=False), DraftEngine(proposer_, "draft"))
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target.tokenizer)
        out, overlapped, drafted, accepted = [], 0, 0, 0
        for seed in range(samples):
            sampling = replace(params, seed=seed)
            request = GenerationParams(prompt, sampling, tokens, gamma, ignore_eos=True, overlap=overlap)
            result = await engine.generate_all(request)
            out.append(tuple(result.token_ids))
            overlapped += result.overlapped_rounds
            drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens
        return out, overlapped, (drafted, accepted)

    return asyncio.run(run())


def chi_square_p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Cells with an expected count under 5 are pooled into one, as the test requires."""
    counts = {seq: 0 for seq in exact}
    for seq in samples:
        counts[seq] += 1
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        if prob * len(samples) >= 5:
            observed.append(counts[seq])
            expected.append(prob * len(samples))
        else:
            pooled_obs += counts[seq]
            pooled_exp += prob * len(samples)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=1.2, top_p=0.8)],
    ids=["temperature", "top_k", "top_p"],
)
def test_speculative_samples_follow_the_exact_target_distribution(models, params):
    target, draft = models
    exact = enumerate_sequences(target, params)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    samples, _, _ = sample_sequences(target, draft, params, gamma=2)
    assert chi_square_p_value(samples, exact) > 1e-3
    # The test can fail: the draft's own distribution is clearly rejected by the same samples.
    assert chi_square_p_value(samples, enumerate_sequences(draft, params)) < 1e-6


PENALIZED = SamplingParams(
    temperature=1.0, presence_penalty=1.0, frequency_penalty=0.7, repetition_penalty=1.8, logit_bias=((2, 1.5),), min_p=0.02
)


@pytest.mark.slow
def test_speculative_samples_under_penalties_logit_bias_and_min_p_follow_the_exact_target_distribution(models):
    target, draft = models
    exact = enumerate_sequences(target, PENALIZED)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    samples, _, (drafted, accepted) = sample_sequences(target, draft, PENALIZED, gamma=2, samples=1000)
    assert drafted > 0 and 0 < accepted < drafted  # speculation ran, with rejections
    assert chi_square_p_value(samples, exact) > 1e-3
    # The test can fail: the same samples clearly reject the target's distribution without the adjustments.
    plain = replace(PENALIZED, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=())
    assert chi_square_p_value(samples, enumerate_sequences(target, plain)) < 1e-6


def test_draft_disagrees_enough_to_exercise_rejections(models):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    exact, wrong = enumerate_sequences(target, params), enumerate_sequences(draft, params)
    total_variation = 0.5 * sum(abs(exact[s] - wrong[s]) for s in itertools.product(range(VOCAB), repeat=TOKENS))
    assert total_variation > 0.2


OVERLAP_VOCAB = 4
OVERLAP_TOKENS = 4  # overlap needs room for a round after the first: 4 tokens at gamma 1
OVERLAP_PROMPT = [1, 2, 3, 0]


@pytest.fixture(scope="module")
def small_vocab_models():
    target = f"tiny-random:seed=5,vocab={OVERLAP_VOCAB},layers=1,hidden=16"
    return load_model(target), load_model(f"{target},noise=1.5")


@pytest.mark.slow
def test_overlapped_speculation_follows_the_exact_target_distribution(small_vocab_models):
    """Overlap drafts the next round before the verdict and keeps that work only when the verdict matches what it
    assumed; the kept proposals must not bias the output."""
    target, draft = small_vocab_models
    params = SamplingParams(temperature=1.0)
    exact = enumerate_sequences(target, params, OVERLAP_TOKENS, OVERLAP_PROMPT)
    samples, overlapped, _ = sample_sequences(target, draft, params, 1, OVERLAP_TOKENS, 4000, True, OVERLAP_PROMPT)
    assert overlapped > 400, "too few overlapped proposals were kept to test them"
    assert chi_square_p_value(samples, exact) > 1e-3
    assert chi_square_p_value(samples, enumerate_sequences(draft, params, OVERLAP_TOKENS, OVERLAP_PROMPT)) < 1e-6
