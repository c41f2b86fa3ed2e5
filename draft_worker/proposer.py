"""What the draft worker drafts with: one small interface, a class per strategy (as transformers'
`candidate_generator.py`).

A proposer opens a state per session, hears each verdict (`observe`: the accepted part of its last proposal and the
tokens the target committed), and proposes for several sessions at once (`propose`: a model runs the k-th pass of
every session as one batch; a model-free proposer answers each in turn). Every proposal carries the exact q each
token was drawn from, so the target's acceptance test keeps the output the target's whatever the strategy:

- `ModelProposer` (draft_worker.model_proposer): a small model, sampled as the request samples;
- `PromptLookupProposer` (draft_worker.ngram): the continuation of the latest earlier occurrence of the last n
  tokens, q = 1;
- `SuffixProposer` (draft_worker.suffix): the likeliest continuation in suffix trees over the request and over
  earlier requests' outputs, q = 1;
- `HybridProposer` (draft_worker.hybrid): the suffix trees first, the model where they have no likely match.
"""

import functools
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from specdec.common.errors import InvalidArgument
from specdec.common.prefix_cache import PrefixCache
from specdec.common.rounds import DraftSource, Proposal
from specdec.common.sampling import SamplingParams, SparseDistribution

# A model-free proposer has no model context; its state holds a few entries per token, so a session's length is
# bounded here (above every target's context the project serves) rather than by the 16 MiB message size.
MODEL_FREE_MAX_CONTEXT = 131_072
CERTAIN = torch.ones(1)


class DraftState(Protocol):
    """A session's drafting state, as the engine reads it."""

    @property
    def chain(self) -> list[int]:
        """Tokens proposed (and assumed) since the last verdict, in order."""

    @property
    def num_committed(self) -> int:
        """Committed tokens: the prompt and the accepted output."""

    @property
    def max_tokens(self) -> int:
        """The session's reservation: committed and chained tokens never exceed it."""

    @property
    def cached(self) -> int:
        """Tokens the opening cached (0 without a model)."""


class Proposer(ABC):
    batched: bool = False  # True: sessions' steps share forward passes, so they go through the worker's batcher
    vocab_size: int = 0  # 0: model-free, any token id
    max_context_length: int = MODEL_FREE_MAX_CONTEXT
    kv_bytes_per_token: int = 512  # what a token of a session's state costs (the KV budget's unit)
    device: str = "cpu"
    prefixes: PrefixCache | None = None  # closed sessions' caches it keeps, in the worker's KV budget

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        """(tokens, ms) of one draft pass; empty: free to ask (the coordinator's cost model reads it)."""
        return []

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidArgument("start.prompt_token_ids", "must not be empty")
        if len(prompt) >= self.max_context_length:
            raise InvalidArgument(
                "start.prompt_token_ids", f"{len(prompt)} tokens: a model-free draft holds at most {self.max_context_length}"
            )

    def check_tokens(self, token_ids: list[int], field: str) -> None:  # noqa: B027 - a hook: nothing to check by default
        """Token ids a verdict commits; any id is fine without a vocabulary."""

    def prepare(self, params: SamplingParams) -> None:  # noqa: B027 - a hook: nothing to prepare by default
        """Work a session's opening needs that may take a while (compiling its grammar), done on a thread of its own
        before the opening, so that it holds up no other session's step."""

    @abstractmethod
    def open(self, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int) -> DraftState:
        """A new session's state (cheap: its prompt is cached by prefill)."""

    def prefill(self, state: DraftState, max_tokens: int | None) -> bool:
        """Caches the next chunk of the prompt (at most max_tokens, or all); True once all of it is."""
        return True

    @abstractmethod
    def observe(self, state: DraftState, num_accepted: int, committed: list[int]) -> None:
        """The verdict on the last proposal: its first num_accepted tokens were kept, then committed followed."""

    @abstractmethod
    def propose(self, states: list[DraftState], steps: list[tuple[int, bool]]) -> list[Proposal | Exception]:
        """Per session, (num_tokens, assume_accepted): up to num_tokens tokens with their q; with assume_accepted a
        token standing in for the target's pending bonus first (Proposal.assumed_token). A session whose
        proposing fails gets its error; the others go on."""

    def close(self, state: DraftState) -> None:  # noqa: B027 - a hook: nothing to free by default
        """The session ended (finished, failed or cancelled)."""

    def describe(self) -> dict:
        """The model's fields of GetInfo (empty for a model-free proposer)."""
        return {"tokenizer_fingerprint": "", "dtype": "", "eos_token_ids": [], "engine": ""}


@functools.lru_cache(maxsize=1 << 16)
def point_mass(token: int) -> SparseDistribution:
    """q of a deterministic proposal. Cached: its tensors are never written, and a round then creates none."""
    return SparseDistribution(torch.tensor([token]), CERTAIN)


def deterministic_proposal(
    found: list[int], assume_accepted: bool, source: DraftSource, confidence: list[float] | None = None
) -> Proposal:
    """A model-free proposer's tokens as a proposal: with assume_accepted the first stands in for the target's
    bonus token; every q is a point mass (the tokens were chosen without randomness, so q(x) = 1 is exact).
    confidence: per token of found (Proposal.confidence), if the proposer estimates it."""
    proposal = Proposal([], [], source=source)
    confidence = list(confidence or [])
    if assume_accepted:
        if not found:
            return proposal
        proposal.assumed_token, found, confidence = found[0], found[1:], confidence[1:]
    proposal.token_ids = list(found)
    proposal.confidence = confidence
    proposal.distributions = [point_mass(t) for t in found]
    return proposal
