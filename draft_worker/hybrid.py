"""Hybrid drafting (`--model suffix+MODEL`): the suffix trees first, the draft model where they have no likely match.

Each round, per session, the source expected to have more of its tokens accepted proposes: the suffix trees'
continuation (free: a look-up) by its score times how well the session's suffix proposals have scored against their
verdicts so far, against the model's gamma tokens by the model's measured acceptance (E = a + a^2 + ... + a^g).
Ties go to the suffix trees, which cost nothing. Both sources hear every verdict: the model's cache simply does not
hold tokens the suffix trees proposed until its next pass feeds them, and the trees are extended by whatever the
target committed. The q of each token is the one of the source that proposed it, so the acceptance test stays exact.
"""

from collections import Counter
from dataclasses import dataclass, field

from specdec.common.acceptance import DecayedRate, expected_tokens
from specdec.common.rounds import DraftSource, Proposal
from specdec.common.sampling import SamplingParams
from specdec.draft_worker.model_proposer import ModelDraftSession, ModelProposer
from specdec.draft_worker.proposer import Proposer, deterministic_proposal
from specdec.draft_worker.suffix import SuffixDraftSession, SuffixProposer

RATE_DECAY = 0.8  # per round the source proposed: the estimates follow the text
MODEL_PRIOR = 0.6  # a draft model's acceptance before any verdict (the pair's measured greedy rate is 0.6-0.8)


@dataclass
class HybridDraftSession:
    model: ModelDraftSession
    suffix: SuffixDraftSession
    model_rate: DecayedRate = field(default_factory=lambda: DecayedRate(MODEL_PRIOR, RATE_DECAY))  # accepted per drafted token
    suffix_precision: DecayedRate = field(default_factory=lambda: DecayedRate(1.0, RATE_DECAY))  # accepted per unit of score
    last: tuple[str, int, float] | None = None  # the last proposal's source, its length and score
    cached = property(lambda self: self.model.cached)
    chain = property(lambda self: self.model.chain)
    num_committed = property(lambda self: self.model.num_committed)
    max_tokens = property(lambda self: self.model.max_tokens)
    reused_tokens = property(lambda self: self.model.reused_tokens)


class HybridProposer(Proposer):
    batched = True

    def __init__(self, suffix: SuffixProposer, model: ModelProposer):
        self.suffix, self.model = suffix, model
        self.vocab_size, self.max_context_length, self.device = model.vocab_size, model.max_context_length, model.device
        self.kv_bytes_per_token = model.kv_bytes_per_token + suffix.kv_bytes_per_token
        self.check_prompt, self.check_tokens, self.describe = model.check_prompt, model.check_tokens, model.describe
        self.proposals_by_source: Counter[DraftSource] = Counter()  # what it chose, over the worker's life
        self.prefixes = model.prefixes

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        return self.model.forward_costs

    def prepare(self, params: SamplingParams) -> None:
        self.model.prepare(params)

    def open(self, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int) -> HybridDraftSession:
        return HybridDraftSession(
            self.model.open(prompt, params, max_q_entries, max_tokens),
            self.suffix.open(prompt, params, max_q_entries, max_tokens),
        )

    def prefill(self, state: HybridDraftSession, max_tokens: int | None) -> bool:
        return self.model.prefill(state.model, max_tokens)

    def observe(self, state: HybridDraftSession, num_accepted: int, committed: list[int]) -> None:
        if state.last is not None:
            source, drafted, score = state.last
            if source == "model":
                state.model_rate.update(num_accepted, num_accepted + (num_accepted < drafted))
            else:
                state.suffix_precision.update(num_accepted, score)
            state.last = None
        self.model.observe(state.model, num_accepted, committed)
        self.suffix.observe(state.suffix, num_accepted, committed)

    def propose(self, states: list[HybridDraftSession], steps: list[tuple[int, bool]]) -> list[Proposal | Exception]:
        proposals: list[Proposal | Exception | None] = [None] * len(states)
        by_model = []
        for n, (state, (num_tokens, assume_accepted)) in enumerate(zip(states, steps, strict=True)):
            found, source = self.suffix.speculate(state.suffix, num_tokens + assume_accepted)
            drafted = len(found.token_ids) - assume_accepted
            expected = found.score * state.suffix_precision.value
            if found.token_ids and expected >= expected_tokens(state.model_rate.value, num_tokens) - 1:
                state.suffix.chain += found.token_ids
                state.model.chain += found.token_ids  # cached by the model's next pass
                state.last = ("suffix", drafted, found.score)
                proposals[n] = deterministic_proposal(found.token_ids, assume_accepted, source, found.confidence)
                self.proposals_by_source[source] += 1
            else:
                by_model.append(n)
        if by_model:
            drafted = self.model.propose([states[n].model for n in by_model], [steps[n] for n in by_model])
            for n, proposal in zip(by_model, drafted, strict=True):
                proposals[n] = proposal
                if not isinstance(proposal, Exception):
                    state = states[n]
                    state.suffix.chain += state.model.chain[len(state.suffix.chain) :]
                    state.last = ("model", len(proposal.token_ids), 0.0)
                    self.proposals_by_source[DraftSource.MODEL] += 1
        return proposals

    def close(self, state: HybridDraftSession) -> None:
        self.suffix.close(state.suffix)
        self.model.close(state.model)
