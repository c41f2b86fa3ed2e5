"""Suffix drafting (`--model suffix`): SuffixDecoding (Oliaro et al., arXiv 2411.04975) as a proposer.

Each session keeps a suffix tree over its own prompt and committed output; the worker keeps one more over the
outputs of its latest finished requests (`global` tokens of them at most, least recently finished evicted first).
A round proposes the likelier of the two trees' continuations of the session's text (its score: the expected
number of tokens the text goes on with), as many tokens as the matched suffix is long (`factor` x its length, at
most what the round asks). The tokens are chosen without randomness, so each q is a point mass (q = 1): the
acceptance test keeps the output exactly the target's, as for prompt lookup.

Privacy: the global tree lets one request's output shape another request's drafts on the same draft worker (which
tokens are proposed, so how fast it runs), never its output distribution. `suffix:global=0` turns it off.
"""

import threading

from specdec.common.errors import InvalidArgument
from specdec.common.model_specs import parse_spec_params
from specdec.common.rounds import DraftSource, Proposal
from specdec.common.sampling import SamplingParams
from specdec.draft_worker.proposer import Proposer, deterministic_proposal
from specdec.draft_worker.specs import SUFFIX_PREFIX
from specdec.draft_worker.suffix_tree import GlobalSuffixTree, Speculation, SuffixTree

SUFFIX_DEFAULTS = {
    "depth": 24,  # longest substring the trees count (vLLM's suffix_decoding_max_tree_depth)
    "factor": 1.0,  # tokens proposed per matched token (SuffixDecoding's max_spec_factor)
    "min_prob": 0.1,  # a proposed token's path probability at least this (SuffixDecoding's min_token_prob)
    "global": 16384,  # tokens of earlier requests' outputs in the worker's global tree; 0: no global tree
}


class SuffixDraftSession:
    cached = 0

    def __init__(self, prompt: list[int], depth: int, max_tokens: int, reads_shared: bool = True):
        self.tree = SuffixTree(depth)
        # A seeded sample's drafts come from its own text only: drafts decide how its random streams are consumed,
        # and the global tree holds whatever other requests answered before (the same seed would give other text).
        self.reads_shared = reads_shared
        self.cursor = self.tree.cursor()
        self.tree.append(self.cursor, prompt)
        self.tokens = list(prompt)  # committed
        self.prompt_length = len(prompt)
        self.chain: list[int] = []
        self.max_tokens = max_tokens

    @property
    def num_committed(self) -> int:
        return len(self.tokens)


# What a node of a suffix tree costs, at most (tests/service/test_suffix.py measures 140-165 bytes).
NODE_BYTES = 170


class SuffixProposer(Proposer):
    def __init__(
        self,
        depth: int = SUFFIX_DEFAULTS["depth"],
        factor: float = SUFFIX_DEFAULTS["factor"],
        min_prob: float = SUFFIX_DEFAULTS["min_prob"],
        global_tokens: int = SUFFIX_DEFAULTS["global"],
    ):
        self.depth, self.factor, self.min_prob = depth, factor, min_prob
        # A token of a session adds up to `depth` nodes to its tree (text that never repeats: 22 at depth 24).
        self.kv_bytes_per_token = NODE_BYTES * depth
        # Half the depth for the match, half for what follows it: a longer match could propose little.
        self.max_match = depth // 2
        self.shared = GlobalSuffixTree(depth, global_tokens) if global_tokens else None
        self.lock = threading.Lock()  # the global tree: sessions close on the event loop, batches propose elsewhere

    @classmethod
    def from_spec(cls, spec: str) -> "SuffixProposer":
        params = parse_spec_params(spec, SUFFIX_PREFIX, SUFFIX_DEFAULTS)
        checks = {
            "depth": 2 <= params["depth"] <= 256,
            "factor": 0 < params["factor"] <= 64,
            "min_prob": 0 <= params["min_prob"] <= 1,
            "global": params["global"] >= 0,
        }
        for key, fine in checks.items():
            if not fine:
                raise InvalidArgument("model", f"{spec!r}: {key}={params[key]} is out of range")
        return cls(params["depth"], params["factor"], params["min_prob"], params["global"])

    def open(self, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int) -> SuffixDraftSession:
        return SuffixDraftSession(prompt, self.depth, max_tokens, reads_shared=not params.seeded_sample)

    def observe(self, state: SuffixDraftSession, num_accepted: int, committed: list[int]) -> None:
        new = state.chain[:num_accepted] + committed
        state.tree.append(state.cursor, new)  # O(depth) per token: the tree is extended, never rebuilt
        state.tokens += new
        state.chain = []

    def speculate(self, state: SuffixDraftSession, num_tokens: int) -> tuple[Speculation, DraftSource]:
        """The likelier continuation of the session's text (committed + chain) in its own tree and the global one,
        and which tree it came from."""
        context = state.tokens + state.chain if state.chain else state.tokens
        own = state.tree.speculate(context, num_tokens, self.max_match, self.factor, self.min_prob)
        if self.shared is None or not state.reads_shared:
            return own, DraftSource.SUFFIX_REQUEST
        with self.lock:
            shared = self.shared.tree.speculate(context, num_tokens, self.max_match, self.factor, self.min_prob)
        return (shared, DraftSource.SUFFIX_GLOBAL) if shared.score > own.score else (own, DraftSource.SUFFIX_REQUEST)

    def propose(self, states: list[SuffixDraftSession], steps: list[tuple[int, bool]]) -> list[Proposal | Exception]:
        proposals = []
        for state, (num_tokens, assume_accepted) in zip(states, steps, strict=True):
            found, source = self.speculate(state, num_tokens + assume_accepted)
            state.chain += found.token_ids
            proposals.append(deterministic_proposal(found.token_ids, assume_accepted, source, found.confidence))
        return proposals

    def close(self, state: SuffixDraftSession) -> None:
        if self.shared is not None:
            with self.lock:
                self.shared.add(state.tokens[state.prompt_length :])
