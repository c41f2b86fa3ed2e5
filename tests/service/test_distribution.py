"""Lossless, proven statistically: the first tokens generated with speculation follow the target's exact
distribution (computed by enumerating every continuation), for plain temperature sampling, top-k and top-p.

The runs go through the coordinator's real speculation loop and the real worker engines, in one process so that
thousands of requests fit in seconds; the gRPC layer carries these values unchanged (float32 both ends).
"""

import itertools
from dataclasses import replace

import pytest

from specdec.common.models import load_model
from specdec.common.sampling import SamplingParams
from tests.support.statistics import DRAFT, TARGET, TOKENS, VOCAB, chi_square_p_value, enumerate_sequences, sample_sequences


@pytest.fixture(scope="module")
def models():
    return load_model(TARGET), load_model(DRAFT)


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
