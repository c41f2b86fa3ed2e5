"""What an acceptance rate promises and how it is estimated, for every choice made on it: the coordinator's gamma
(coordinator.gamma_policy), the hybrid draft's source (draft_worker.hybrid) and the bench's analytic model."""

from dataclasses import dataclass, field


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens a round commits in expectation, (1 - a^(gamma+1)) / (1 - a): the drafted tokens accepted, each after
    the one before it with probability a, plus the target's own token (Leviathan et al. 2023)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


@dataclass
class DecayedRate:
    """successes / trials over recent evidence, older evidence weighing less by `decay` per update, starting from a
    prior worth prior_weight trials: an estimate that follows the text it is measured on."""

    prior: float
    decay: float
    prior_weight: float = 1.0
    successes: float = 0.0
    trials: float = 0.0

    def update(self, successes: float, trials: float, decay: float | None = None) -> None:
        decay = self.decay if decay is None else decay
        self.successes = decay * self.successes + successes
        self.trials = decay * self.trials + trials

    @property
    def value(self) -> float:
        return self.value_from(self.prior)

    def value_from(self, prior: float) -> float:
        """The estimate on the same evidence from another prior of the same weight."""
        return (self.successes + prior * self.prior_weight) / (self.trials + self.prior_weight)


CONFIDENCE_BINS = 10
CONFIDENCE_DECAY = 0.995  # per token tested: the calibration follows the deployment's traffic
CONFIDENCE_PRIOR_WEIGHT = 2.0  # the proposer's own estimate counts as this many tested tokens


@dataclass
class ConfidenceCalibration:
    """What a proposer's confidence (Proposal.confidence) turns out to be worth: per tenth of [0, 1], the share of
    tested tokens the target accepted, starting from the confidence itself. A token is tested when the target
    accepted every token before it (those after the first rejection never were)."""

    bins: list[DecayedRate] = field(
        default_factory=lambda: [
            DecayedRate((b + 0.5) / CONFIDENCE_BINS, CONFIDENCE_DECAY, CONFIDENCE_PRIOR_WEIGHT) for b in range(CONFIDENCE_BINS)
        ]
    )

    def bin(self, confidence: float) -> DecayedRate:
        return self.bins[min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)]

    def estimate(self, confidence: float) -> float:
        """The probability that a token of this confidence is accepted, once the tokens before it were."""
        return self.bin(confidence).value_from(confidence)

    def observe(self, confidence: list[float], accepted: int) -> None:
        """A verified proposal's confidences, of which the first `accepted` tokens were accepted."""
        for position, value in enumerate(confidence[: accepted + 1]):
            self.bin(value).update(float(position < accepted), 1.0)
