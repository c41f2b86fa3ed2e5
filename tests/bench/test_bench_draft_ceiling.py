"""bench.draft_ceiling: a model draft's ceiling from one target-only answer and one teacher-forced draft pass."""

import pytest

from specdec.bench.draft_ceiling import CAP, replayed_speedup, run
from tests.support.services import TARGET, draft_spec


def steps(rows: int) -> float:
    return 1 + 0.1 * (rows - 1)  # a pass over `rows` tokens, in steps


def test_a_draft_that_always_agrees_commits_gamma_plus_one_tokens_a_round():
    agree = [True] * 30
    # gamma 4: rounds of 5 tokens, each 4 draft steps of 0.2 and a 5-token pass
    assert replayed_speedup(agree, steps, 0.2, 4) == pytest.approx(30 / (6 * (4 * 0.2 + steps(5))))
    # the oracle drafts the longest run it may (CAP) every round
    assert replayed_speedup(agree, steps, 0.2, None) > replayed_speedup(agree, steps, 0.2, 4)
    assert replayed_speedup([True] * (CAP + 1) * 2, steps, 0.0, None) == pytest.approx((CAP + 1) / steps(CAP + 1))


def test_a_draft_that_never_agrees_pays_for_nothing_and_the_oracle_never_drafts():
    agree = [False] * 10
    assert replayed_speedup(agree, steps, 0.2, 2) == pytest.approx(1 / (2 * 0.2 + steps(3)))
    assert replayed_speedup(agree, steps, 0.2, None) == pytest.approx(1.0)


@pytest.mark.slow
def test_the_draft_identical_to_the_target_agrees_everywhere():
    results = run(TARGET, [draft_spec(0.0), draft_spec(1.0)], tokens=12, repeats=1, hypothetical=[0.3], limit=2)
    assert len(results["prompts"]) == 2 and set(results["curve_ms"]) >= {1, 2, 4, 8}
    for entry in results["prompts"]:
        same, noisy = entry["drafts"][draft_spec(0.0)], entry["drafts"][draft_spec(1.0)]
        assert same["agreement"] == 1.0 and noisy["agreement"] < 1.0
        assert same["ceilings"]["0.30"]["oracle"] >= noisy["ceilings"]["0.30"]["oracle"]
