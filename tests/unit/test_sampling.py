"""The sampling math: warping matches its definition, and one speculative step is distributed exactly as p."""

import itertools

import pytest
import torch
from scipy import stats

from specdec.common.sampling import (
    SamplingParams,
    SparseDistribution,
    adjusted_logits,
    densify,
    greedy_accept,
    logits_to_probs,
    make_generator,
    mask_min_p,
    mask_top_k,
    mask_top_p,
    residual_probs,
    sample_sparse,
    speculative_accept,
    token_logprobs,
    truncate_probs,
    verify_draft,
)


def test_top_k_keeps_the_k_most_likely_tokens():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert mask_top_k(probs, 2).tolist() == pytest.approx([0.0, 0.4, 0.0, 0.3])


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # 0.4 + 0.3 = 0.7 >= 0.65: two tokens suffice; 0.7 needs exactly those two; 0.71 needs a third.
    assert mask_top_p(probs, 0.65).tolist() == pytest.approx([0.0, 0.4, 0.0, 0.3])
    assert mask_top_p(probs, 0.7).tolist() == pytest.approx([0.0, 0.4, 0.0, 0.3])
    assert mask_top_p(probs, 0.71).tolist() == pytest.approx([0.0, 0.4, 0.2, 0.3])
    assert mask_top_p(probs, 0.01).tolist() == pytest.approx([0.0, 0.4, 0.0, 0.0])


def test_warping_applies_temperature_then_top_k_then_top_p():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))
    # softmax(logits / 0.5) = [0.0158, 0.8643, 0.1170, 0.0029]; top-3 drops token 3; after renormalising, token 1
    # alone (0.8668) is short of 0.9, tokens 1 and 2 reach it, so token 0 goes too.
    tempered = torch.softmax(logits / 0.5, dim=-1)
    expected = torch.tensor([0.0, float(tempered[1]), float(tempered[2]), 0.0])
    assert probs.tolist() == pytest.approx((expected / expected.sum()).tolist(), abs=1e-6)


def test_greedy_is_one_hot_at_the_argmax():
    probs = logits_to_probs(torch.tensor([[0.1, 2.0, 1.0], [5.0, 1.0, 5.0]]), SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_truncated_q_is_what_the_draft_samples_from():
    probs = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(0)), dim=-1)
    q = truncate_probs(probs, 8)
    assert len(q.token_ids) == 8
    assert float(q.probs.sum()) == pytest.approx(1.0, abs=1e-6)
    assert set(q.token_ids.tolist()) == set(torch.topk(probs, 8).indices.tolist())
    generator = make_generator(0, "test")
    draws = {sample_sparse(q, generator) for _ in range(500)}
    assert draws <= set(q.token_ids.tolist())


def test_residual_is_the_normalised_positive_part_of_p_minus_q():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert residual_probs(p, q).tolist() == pytest.approx([1.0, 0.0, 0.0])


def exact_first_token_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(first committed token = y) for one round with gamma 1, by enumeration over the draft's x."""
    result = torch.zeros_like(p)
    for x in range(len(q)):
        if q[x] == 0:
            continue
        accept = min(1.0, float(p[x] / q[x]))
        result[x] += q[x] * accept
        result += q[x] * (1 - accept) * residual_probs(p, q)
    return result


def test_rejection_rule_reproduces_p_exactly_by_enumeration():
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = torch.softmax(torch.randn(6, generator=generator) * 2, dim=-1)
        q = torch.softmax(torch.randn(6, generator=generator) * 2, dim=-1)
        assert exact_first_token_distribution(p, q).tolist() == pytest.approx(p.tolist(), abs=1e-6)


@pytest.mark.slow
def test_speculative_step_matches_p_statistically():
    """gamma = 2 with a real (not one-hot) q: the first two committed tokens follow p1 x p2 (chi-square)."""
    vocab = 4
    g = torch.Generator().manual_seed(3)
    p1, p2, p3 = (torch.softmax(torch.randn(vocab, generator=g), dim=-1) for _ in range(3))
    q1, q2 = (torch.softmax(torch.randn(vocab, generator=g), dim=-1) for _ in range(2))
    # The target's p_2 depends on x1 in a real model; here p2 is the same after any first token, which keeps the
    # enumeration small while still exercising acceptance at position 2 and the bonus token.
    generator = make_generator(7, "test")
    counts = torch.zeros(vocab, vocab)
    trials = 40_000
    for _ in range(trials):
        x1 = int(torch.multinomial(q1, 1, generator=generator))
        x2 = int(torch.multinomial(q2, 1, generator=generator))
        n, nxt = speculative_accept(torch.stack([p1, p2, p3]), [x1, x2], torch.stack([q1, q2]), generator)
        first_two = ([x1, x2][:n] + [nxt])[:2]
        if len(first_two) < 2:
            first_two.append(int(torch.multinomial(p2, 1, generator=generator)))
        counts[first_two[0], first_two[1]] += 1
    expected = torch.outer(p1, p2).flatten() * trials
    _, p_value = stats.chisquare(counts.flatten().numpy(), expected.numpy())
    assert p_value > 1e-3
    wrong = torch.outer(q1, q2).flatten() * trials
    assert stats.chisquare(counts.flatten().numpy(), wrong.numpy())[1] < 1e-6


def test_greedy_accepts_while_argmax_matches():
    probs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert greedy_accept(probs, [1, 0]) == (2, 2)
    assert greedy_accept(probs, [1, 2]) == (1, 0)
    assert greedy_accept(probs, [0, 0]) == (0, 1)


def test_point_mass_q_keeps_the_rule_exact():
    """Prompt lookup proposes with q = 1: accept with p(x), else sample p without x, renormalised."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = densify(SparseDistribution(torch.tensor([1]), torch.tensor([1.0])), 3)
    assert exact_first_token_distribution(p, q).tolist() == pytest.approx(p.tolist(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_draft_with_no_draft_tokens_samples_from_p(temperature):
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    assert verify_draft(probs, [], [], SamplingParams(temperature=temperature), make_generator(0, "test")) == (0, 1)


def test_every_warp_combination_is_a_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in itertools.product([0.3, 1.0, 2.0], [0, 1, 5], [0.1, 0.9, 1.0]):
        probs = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        assert bool((probs >= 0).all())


def test_draft_and_target_draw_independent_numbers_from_one_seed():
    """Seeded alike, the target's acceptance uniforms would replay the draft's sampling draws and bias the output."""
    draft, target = make_generator(5, "draft"), make_generator(5, "target")
    assert not torch.equal(torch.rand(8, generator=draft), torch.rand(8, generator=target))
    assert torch.equal(torch.rand(8, generator=make_generator(5, "draft")), torch.rand(8, generator=make_generator(5, "draft")))


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 1e-6, 1e-5, 0.5, 1.0, 1e6, 1e30])
@pytest.mark.parametrize("top_k", [0, 1, 3, 10**9])
@pytest.mark.parametrize("top_p", [1e-30, 0.5, 1.0])
def test_extreme_logits_and_parameters_give_distributions_never_nan(temperature, top_k, top_p):
    # Logits of +-1e4 (a model's saturated outputs) under every sampling path: warping, truncating q, the
    # acceptance test and the residual. Below GREEDY_BELOW a temperature is greedy, where dividing by it would
    # overflow float32 to inf and softmax would give NaN.
    from specdec.common.sampling import GREEDY_BELOW, truncate_probs, verify_draft

    logits = torch.tensor([[1e4, -1e4, 9999.0, 0.0, -5.0, 1e4 - 0.5]] * 3)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    assert params.greedy == (temperature < GREEDY_BELOW)
    probs = logits_to_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    q = [truncate_probs(row, 4) for row in probs[:2]]
    assert all(torch.isfinite(d.probs).all() and abs(float(d.probs.sum()) - 1) < 1e-5 for d in q)
    generator = make_generator(1, "target")
    drafted = [int(d.token_ids[0]) for d in q]
    accepted, token = verify_draft(probs, drafted, q, params, generator)
    assert 0 <= accepted <= 2 and 0 <= token < logits.shape[-1]
    if params.greedy:
        assert token == 0 and accepted == 2  # the argmax, first of the tied maxima


PENALIZED = SamplingParams(
    temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((3, 5.0), (9, -100.0))
)


def test_logit_adjustments_follow_their_definitions():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 4.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    # Prompt [0, 1], output [2, 2, 1]: token 0 seen in the prompt only, 1 in both (once in the output), 2 twice.
    adjusted = adjusted_logits(logits, PENALIZED, [0, 1, 2, 2, 1], 2, [])[0]
    expected = logits[0].clone()
    expected[0] = 1.0 / 2.0  # repetition only (prompt): a positive logit is divided
    expected[1] = -1.0 * 2.0 - 0.25 * 1 - 0.5  # a negative one multiplied; frequency x 1; presence
    expected[2] = 2.0 / 2.0 - 0.25 * 2 - 0.5
    expected[3] = 0.5 + 5.0  # logit_bias
    expected[9] = 3.0 - 100.0
    assert adjusted.tolist() == pytest.approx(expected.tolist())


def test_each_row_of_a_round_is_adjusted_bit_identically_to_a_one_at_a_time_decoder():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    context, drafted = [5, 7, 7, 12, 5], [7, 30, 30]
    together = adjusted_logits(logits, PENALIZED, context, 3, drafted)
    for i in range(4):
        alone = adjusted_logits(logits[i : i + 1], PENALIZED, context + drafted[:i], 3, [])
        assert torch.equal(together[i : i + 1], alone), f"row {i}"
    # Nothing to adjust: the logits themselves, untouched.
    assert adjusted_logits(logits, SamplingParams(), context, 3, drafted) is logits


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert mask_min_p(probs, 0.2).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.0])
    assert torch.equal(mask_min_p(probs, 0.0), probs)


def test_token_logprobs_are_the_raw_log_softmax_row_by_row():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    entries = token_logprobs(logits, [4, 0, 19], 3)
    for row, token, entry in zip(logits, [4, 0, 19], entries, strict=True):
        reference = torch.log_softmax(row[None], dim=-1)[0]
        assert entry.logprob == float(reference[token])
        assert entry.top_ids == torch.topk(reference, 3).indices.tolist()
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
