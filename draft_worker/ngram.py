"""Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's last n tokens."""

from specdec.common.model_specs import parse_spec_params
from specdec.common.rounds import DraftSource, Proposal
from specdec.common.sampling import SamplingParams
from specdec.draft_worker.proposer import Proposer, deterministic_proposal
from specdec.draft_worker.specs import NGRAM_PREFIX

NGRAM_DEFAULTS = {"max": 3, "min": 1}


def parse_ngram(spec: str) -> tuple[int, int]:
    params = parse_spec_params(spec, NGRAM_PREFIX, NGRAM_DEFAULTS)
    return int(params["max"]), int(params["min"])


def find_continuation(tokens: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier match of the last n tokens, n from max_n down."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


class NgramIndex:
    """A growing sequence with, for each n-gram (n from min_n to max_n), where the token after its latest
    occurrence sits: a lookup costs the same at token 2,000 as at token 20, where find_continuation scans back
    through the whole sequence. The sequence can be cut back (a rejected draft chain), undoing what its tokens
    recorded."""

    def __init__(self, tokens: list[int], max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}
        self.undo: list[list[tuple[tuple[int, ...], int | None]]] = []  # per token: the entries it overwrote
        self.undo_start = 0  # position of the first token undo still covers (tokens before it are final)
        self.extend(tokens)
        self.keep(len(self.tokens))

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            overwritten = []
            for n in range(self.min_n, min(self.max_n, i) + 1):
                key = tuple(self.tokens[i - n : i])  # now followed by the token at i
                overwritten.append((key, self.follower.get(key)))
                self.follower[key] = i
            self.undo.append(overwritten)
            self.tokens.append(token)

    def keep(self, length: int) -> None:
        """The first `length` tokens will never be cut back: forgets how to undo them."""
        drop = min(length, len(self.tokens)) - self.undo_start
        if drop > 0:
            del self.undo[:drop]
            self.undo_start += drop

    def truncate(self, length: int) -> None:
        if length < self.undo_start:
            raise ValueError(f"cannot cut back to {length} tokens: the first {self.undo_start} are kept")
        while len(self.tokens) > length:
            self.tokens.pop()
            for key, previous in reversed(self.undo.pop()):
                if previous is None:
                    del self.follower[key]
                else:
                    self.follower[key] = previous

    def continuation(self, num_tokens: int) -> list[int]:
        """find_continuation(self.tokens, num_tokens, max_n, min_n), by look-up."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.follower.get(tuple(self.tokens[length - n :]))
            if start is not None:
                return self.tokens[start : start + num_tokens]
        return []


class NgramDraftSession:
    """The session's committed tokens and the chain proposed since the last verdict, in one index."""

    cached = 0

    def __init__(self, prompt: list[int], max_n: int, min_n: int, max_tokens: int):
        self.index = NgramIndex(prompt, max_n, min_n)  # committed tokens, then the chain
        self.committed = len(prompt)
        self.max_tokens = max_tokens

    @property
    def chain(self) -> list[int]:
        return self.index.tokens[self.committed :]

    @property
    def num_committed(self) -> int:
        return self.committed


class PromptLookupProposer(Proposer):
    """Model-free: proposals are deterministic, so each q is a point mass (q = 1) and the rejection rule stays
    exact. kv_bytes_per_token: what a token costs the index, a few dictionary entries keyed by tuples (measured:
    0.28 KB at max=3)."""

    kv_bytes_per_token = 512

    def __init__(self, max_n: int = NGRAM_DEFAULTS["max"], min_n: int = NGRAM_DEFAULTS["min"]):
        self.max_n, self.min_n = max_n, min_n

    @classmethod
    def from_spec(cls, spec: str) -> "PromptLookupProposer":
        return cls(*parse_ngram(spec))

    def open(self, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int) -> NgramDraftSession:
        return NgramDraftSession(prompt, self.max_n, self.min_n, max_tokens)

    def observe(self, state: NgramDraftSession, num_accepted: int, committed: list[int]) -> None:
        index = state.index
        index.truncate(state.committed + num_accepted)
        index.extend(committed)
        state.committed = len(index.tokens)
        index.keep(state.committed)

    def propose(self, states: list[NgramDraftSession], steps: list[tuple[int, bool]]) -> list[Proposal | Exception]:
        proposals = []
        for state, (num_tokens, assume_accepted) in zip(states, steps, strict=True):
            found = state.index.continuation(num_tokens + assume_accepted)
            state.index.extend(found)  # the chain
            proposals.append(deterministic_proposal(found, assume_accepted, DraftSource.PROMPT_LOOKUP))
        return proposals
