"""What the coordinator's engine takes and gives: a request's parameters, one stats record per round, the result.

Each round's RoundStats is the one record every sink reads: the round's span attributes, the speculation
metrics, and the response's round list and totals.
"""

from collections import Counter
from dataclasses import dataclass, field, fields

from specdec.common.rounds import DraftSource
from specdec.common.sampling import SamplingParams, TokenLogprob


@dataclass
class GenerationParams:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int  # -1: chosen each round (auto), 0: off
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    operation: str = "text_completion"  # GenAI operation name: "chat" for chat messages
    gamma_schedule: str = "cost_model"  # how auto chooses gamma: "cost_model" or "heuristic"
    overlap: bool = False  # draft round n+1 while the target verifies round n
    # The caller asked for max_new_tokens: then prompt + max_new_tokens must fit the context (an error, as in vLLM);
    # a default is only an upper bound, cut to what the context leaves.
    max_new_tokens_given: bool = False
    logprobs: int | None = None  # each output token's log-probability, with this many alternatives (None: off)
    prompt_logprobs: bool = False  # the prompt's too (max_new_tokens may then be 0)


@dataclass
class TimeSplit:
    """Where time went, in microseconds; the parts (all but total_us and the two hidden ones, draft_overlapped_us and
    verify_ahead_us) add up to total_us."""

    prefill_us: int = 0
    draft_us: int = 0
    verify_us: int = 0
    sync_us: int = 0
    network_us: int = 0  # transport alone: round trips minus the workers' handling of the messages
    coordinator_us: int = 0
    total_us: int = 0
    draft_overlapped_us: int = 0  # drafting hidden behind verification; not part of total_us
    queue_us: int = 0  # waiting on the workers for a batch to form or for the pass before it
    handling_us: int = 0  # the workers' own overhead: handling a message beyond its queue, compute and sync
    verify_ahead_us: int = 0  # the target's scoring ahead of its rounds, behind their exchange; not part of total_us

    def add(self, other: "TimeSplit") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def attributes(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}.{f.name.removesuffix('_us')}_us": getattr(self, f.name) for f in fields(self)}

    @property
    def overhead_us(self) -> int:
        """Time beyond the workers' compute, sync and queueing: what the split into services costs a round."""
        return self.network_us + self.coordinator_us + self.handling_us


@dataclass
class RoundStats:
    """What one speculation round did and what it cost."""

    gamma: int
    drafted: int
    accepted: int
    committed: int
    time_split: TimeSplit
    bytes_sent: int = 0
    bytes_received: int = 0
    overlapped: bool = False  # the proposal was drafted while the previous round was verified
    target_batch_size: int = 1
    draft_source: DraftSource = DraftSource.NONE  # what proposed the verified tokens (NONE: nothing drafted)

    @property
    def rollback(self) -> int:
        return self.drafted - self.accepted

    def attributes(self) -> dict:
        """The round's span attributes."""
        return {
            "specdec.gamma": self.gamma,
            "specdec.drafted": self.drafted,
            "specdec.accepted": self.accepted,
            "specdec.rollback": self.rollback,
            "specdec.committed": self.committed,
            "specdec.bytes_sent": self.bytes_sent,
            "specdec.bytes_received": self.bytes_received,
            "specdec.overlapped": self.overlapped,
            "specdec.target_batch_size": self.target_batch_size,
            "specdec.draft_source": str(self.draft_source),
            **self.time_split.attributes("specdec.time"),
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: int
    prompt_tokens: int
    num_speculative_tokens: int
    rounds: list[RoundStats]
    time_split: TimeSplit
    fallback_reason: str = ""
    overlap: bool = False
    cached_prompt_tokens: int = 0  # prompt tokens the target reused from its prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # per prompt token after the first

    @property
    def overlapped_rounds(self) -> int:
        return sum(r.overlapped for r in self.rounds)

    @property
    def drafted_tokens(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.accepted for r in self.rounds)

    def speculation_stats(self) -> dict:
        """The request's speculation figures, as every sink reports them (the fields of the proto's
        SpeculationStats): the one place they are named."""
        return summed_speculation([self])

    def by_position(self) -> list[tuple[int, int, int]]:
        """(position, drafted, accepted) per draft position (1-based): what acceptance does along a proposal."""
        drafted, accepted = Counter(), Counter()
        for stats in self.rounds:
            drafted.update(range(1, stats.drafted + 1))
            accepted.update(range(1, stats.accepted + 1))
        return [(position, drafted[position], accepted[position]) for position in sorted(drafted)]


def summed_speculation(results: list[GenerationResult]) -> dict:
    """The speculation figures of one or more results (a request's choices) together."""
    rounds = [r for result in results for r in result.rounds]
    drafted, accepted = sum(r.drafted for r in rounds), sum(r.accepted for r in rounds)
    return {
        "rounds": len(rounds),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_round": sum(r.committed for r in rounds) / len(rounds) if rounds else 0.0,
        "num_speculative_tokens": results[0].num_speculative_tokens,
        "fallback_reason": next((r.fallback_reason for r in results if r.fallback_reason), ""),
        "overlap": results[0].overlap,
        "overlapped_rounds": sum(r.overlapped for r in rounds),
    }
