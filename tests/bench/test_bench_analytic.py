"""The benchmark's calculations against hand-computed values."""

import math

import pytest

from specdec.common.acceptance import expected_tokens

from specdec.bench.analytic import (
    alpha_from_tokens_per_round,
    break_even_cost_ratio,
    corrected_speedup,
    predicted_speedup,
)


def test_predicted_speedup_matches_leviathan_examples():
    # alpha 0.8, gamma 4, c 0.05: 3.3616 / 1.2 = 2.8013
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    # A free draft (c = 0) gives exactly the expected tokens per round.
    assert predicted_speedup(0.6, 3, 0.0) == pytest.approx(expected_tokens(0.6, 3))


def test_corrected_model_charges_the_measured_verify_cost_and_overhead():
    # alpha 0.5, gamma 2 -> 1.75 tokens; target 40 ms/token, draft 1 ms, verify 60 ms, overhead 4 ms:
    # 1.75 * 40 / (2 + 60 + 4) = 70 / 66
    assert corrected_speedup(0.5, 2, 0.040, 0.001, 0.060, 0.004) == pytest.approx(70 / 66)
    # The baseline pays its own overhead per token (here 2 ms): 1.75 * 42 / 66
    assert corrected_speedup(0.5, 2, 0.040, 0.001, 0.060, 0.004, 0.002) == pytest.approx(1.75 * 42 / 66)
    # With verify = one target step and no overhead it equals the analytic model.
    assert corrected_speedup(0.7, 3, 1.0, 0.1, 1.0, 0.0) == pytest.approx(predicted_speedup(0.7, 3, 0.1))


def test_break_even_cost_ratio_solves_speedup_equal_one():
    # alpha 0.5, gamma 2: (1.75 - 1) / 2 = 0.375
    assert break_even_cost_ratio(0.5, 2) == pytest.approx(0.375)
    for alpha, gamma in [(0.3, 1), (0.6, 4), (0.9, 8)]:
        assert predicted_speedup(alpha, gamma, break_even_cost_ratio(alpha, gamma)) == pytest.approx(1.0)


def test_alpha_is_recovered_from_tokens_per_round():
    for alpha, gamma in [(0.2, 2), (0.62, 4), (0.95, 8)]:
        assert alpha_from_tokens_per_round(expected_tokens(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-6)
    assert alpha_from_tokens_per_round(1.0, 4) == pytest.approx(0.0, abs=1e-6)
    assert math.isclose(alpha_from_tokens_per_round(5.0, 4), 1.0, abs_tol=1e-6)
