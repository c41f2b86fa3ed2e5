"""What an acceptance rate promises (common.acceptance): the expected tokens of a round, and the decayed estimate
every choice made on a rate reads."""

import pytest

from specdec.common.acceptance import ConfidenceCalibration, DecayedRate, expected_tokens


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


def test_a_calibration_starts_from_the_confidence_and_learns_what_tokens_of_that_confidence_are_worth():
    calibration = ConfidenceCalibration()
    assert calibration.estimate(0.95) == pytest.approx(0.95) and calibration.estimate(0.12) == pytest.approx(0.12)
    for _ in range(50):  # tokens rated 0.9-1.0 rejected at once; the 0.1-0.2 token after each was never tested
        calibration.observe([0.95, 0.15], accepted=0)
    assert calibration.estimate(0.95) < 0.1 and calibration.estimate(0.92) < 0.1
    assert calibration.estimate(0.15) == pytest.approx(0.15)
    for _ in range(200):  # then accepted, and the token after them too
        calibration.observe([0.95, 0.15], accepted=2)
    assert calibration.estimate(0.95) > 0.5 and calibration.estimate(0.15) > 0.5
