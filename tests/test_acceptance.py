"""What an acceptance rate promises (common.acceptance): the expected tokens of a round, and the decayed estimate
every choice made on a rate reads."""

import pytest

from common.acceptance import DecayedRate, expected_tokens


def test_expected_tokens_count_the_accepted_drafts_and_the_targets_own_token():
    # alpha 0.5, gamma 2: 1 + 0.5 + 0.25 = 1.75
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # alpha 0.8, gamma 4: (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(1.0, 3) == 4.0


def test_a_decayed_rate_starts_at_its_prior_and_follows_recent_evidence():
    rate = DecayedRate(prior=0.5, decay=0.5)
    assert rate.value == 0.5
    rate.update(0, 10)  # ten failures: (0 + 0.5) / (10 + 1)
    assert rate.value == pytest.approx(0.5 / 11)
    rate.update(10, 10)  # then ten successes, the failures halved: (10 + 0.5) / (15 + 1)
    assert rate.value == pytest.approx(10.5 / 16)
    rate.update(0, 0, decay=0.0)  # evidence forgotten at once: back to the prior
    assert rate.value == 0.5
