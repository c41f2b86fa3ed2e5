"""A suffix tree of bounded depth over token sequences, with counts: SuffixDecoding's data structure
(Oliaro et al., arXiv 2411.04975).

The tree holds every substring of at most `depth` tokens of the sequences added, each node counting the
occurrences of the substring its path spells. Appending a token updates the `depth` substrings that end at it, in
O(depth): the cursor of a growing sequence holds the node of each of its current suffixes. A sequence can be
removed again (its counts taken back, nodes at zero freed): the tree is then exactly the tree of the sequences that
remain, as if they alone had been added.

Speculating from a context: find its longest suffix that occurred before with a continuation (monotone in the
length, so a binary search), then follow the most frequent child (ties: the most recently extended) while the
path's probability, the product of count(child) / count(parent), stays above a floor. Each token also gets a
confidence, the proposer's uncalibrated estimate that the target accepts it once it accepted the tokens before it:
count(child) / count(parent) times m / (m + 1), m the length of the text it follows that the tree holds (the match
and the tokens proposed before it). The frequency alone says 1 for a continuation seen once after a match of one
token; what the target accepted of such tokens grows with m (the suffix trees' proposals on the drafting suite's
editing workload, offline: 0.35 of those at m < 3, 0.78-0.89 at 3-8, 0.96-0.99 at 12 and beyond).

The nodes live in flat arrays and one dict keyed by (node, token) rather than in an object and a dict of children
per node: a node costs 140-165 bytes (measured by tests/service/test_suffix.py), most of it the dict's entry.
"""

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

NONE = -1
TOKEN_BITS = 24  # token ids below 2^24: every vocabulary in use (the largest are ~2^18)
ROOT = 0


@dataclass
class Speculation:
    """A continuation found in a tree: its tokens, the length of the context's suffix it followed, its score (the
    sum of the path's probabilities: the expected number of its tokens that the text goes on with), and each
    token's confidence (see the module's docstring)."""

    token_ids: list[int]
    match_length: int
    score: float
    confidence: list[float] = field(default_factory=list)


NO_SPECULATION = Speculation([], 0, 0.0)


class SuffixTree:
    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"depth must be at least 2, got {depth}")
        self.depth = depth
        self.child: dict[int, int] = {}  # (node << TOKEN_BITS | token) -> child node
        self.count = array("i", [0])  # occurrences of the node's substring
        self.stamp = array("i", [0])  # when it was last counted: recency breaks ties between children
        self.token = array("i", [NONE])  # the token on the edge from its parent
        self.best = array("i", [NONE])  # its most frequent child (ties: the most recent)
        self.first = array("i", [NONE])  # its children, as a list through `sibling`
        self.sibling = array("i", [NONE])
        self.free: list[int] = []  # node ids to reuse
        self.clock = 0
        self.tokens_held = 0  # tokens of the sequences in the tree

    def __len__(self) -> int:
        """Live nodes, the root excluded."""
        return len(self.count) - 1 - len(self.free)

    # -- adding and removing ------------------------------------------------------------------------------------

    def cursor(self) -> list[int]:
        """The state of a new sequence: the nodes of its suffixes, shortest first (none yet)."""
        return []

    def append(self, cursor: list[int], tokens: Sequence[int]) -> None:
        """Adds tokens to the end of the sequence whose cursor this is; the cursor moves along."""
        children, count, stamp, best = self.child, self.count, self.stamp, self.best
        keep = self.depth - 1
        for token in tokens:
            self.clock += 1
            clock = self.clock
            # The suffixes ending at the new token: the token alone, then each old suffix (but the longest) + token.
            moved = []
            for node in [ROOT, *cursor[:keep]]:
                key = node << TOKEN_BITS | token
                child = children.get(key)
                if child is None:
                    child = children[key] = self.new_node(node, token)
                count[child] += 1
                stamp[child] = clock
                leader = best[node]
                if leader != child and node != ROOT and (leader == NONE or count[child] >= count[leader]):
                    best[node] = child
                moved.append(child)
            cursor[:] = moved
        self.tokens_held += len(tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes a whole sequence (as it was appended) back out of the tree."""
        for start in range(len(tokens)):
            path = [ROOT]
            for token in tokens[start : start + self.depth]:
                path.append(self.child[path[-1] << TOKEN_BITS | token])
                self.count[path[-1]] -= 1
            self.prune(path)
        self.tokens_held -= len(tokens)

    def new_node(self, parent: int, token: int) -> int:
        if self.free:
            node = self.free.pop()
            self.count[node], self.stamp[node], self.token[node] = 0, 0, token
            self.best[node], self.first[node] = NONE, NONE
        else:
            node = len(self.count)
            for column, value in ((self.count, 0), (self.stamp, 0), (self.token, token), (self.best, NONE)):
                column.append(value)
            self.first.append(NONE)
            self.sibling.append(NONE)
        self.sibling[node] = self.first[parent]
        self.first[parent] = node
        return node

    def prune(self, path: list[int]) -> None:
        """After the counts along a path (root first) fell: frees the nodes at zero, deepest first (a node at zero
        has only children at zero), and finds a new leading child where the leader's count fell. The root's
        leader is never read (a speculation starts below a matched token), so its many children are not scanned."""
        for depth in range(len(path) - 1, 0, -1):
            parent, node = path[depth - 1], path[depth]
            if self.count[node] == 0:
                self.unlink(parent, node)
            if parent != ROOT and self.best[parent] == node:
                self.best[parent] = self.leading_child(parent)

    def unlink(self, parent: int, node: int) -> None:
        del self.child[parent << TOKEN_BITS | self.token[node]]
        if self.first[parent] == node:
            self.first[parent] = self.sibling[node]
        else:
            previous = self.first[parent]
            while self.sibling[previous] != node:
                previous = self.sibling[previous]
            self.sibling[previous] = self.sibling[node]
        self.free.append(node)

    def children(self, node: int) -> list[int]:
        found, child = [], self.first[node]
        while child != NONE:
            found.append(child)
            child = self.sibling[child]
        return found

    def leading_child(self, node: int) -> int:
        return max(self.children(node), key=lambda c: (self.count[c], self.stamp[c]), default=NONE)

    # -- looking up ---------------------------------------------------------------------------------------------

    def walk(self, tokens: Sequence[int]) -> int:
        """The node whose path spells tokens, or NONE."""
        node = ROOT
        for token in tokens:
            node = self.child.get(node << TOKEN_BITS | token, NONE)
            if node == NONE:
                return NONE
        return node

    def longest_match(self, context: Sequence[int], max_length: int) -> tuple[int, int]:
        """(length, node) of the longest suffix of context, at most max_length tokens, that occurred followed by
        another token; (0, NONE) when not even its last token did. If a suffix occurred with a continuation, so did
        each shorter one: the length is found by binary search."""
        low, high, found = 0, min(max_length, len(context), self.depth - 1), NONE
        while low < high:
            middle = (low + high + 1) // 2
            node = self.walk(context[len(context) - middle :])
            if node != NONE and self.first[node] != NONE:
                low, found = middle, node
            else:
                high = middle - 1
        return low, found

    def speculate(self, context: Sequence[int], max_tokens: int, max_match: int, factor: float, min_prob: float) -> Speculation:
        """The likeliest continuation of the context: at most min(max_tokens, factor * match length) tokens, each
        with a path probability of at least min_prob."""
        length, node = self.longest_match(context, max_match)
        if not length:
            return NO_SPECULATION
        limit = min(max_tokens, int(factor * length + 0.999999))
        tokens, confidence, prob, score = [], [], 1.0, 0.0
        while len(tokens) < limit:
            child = self.best[node]
            if child == NONE:
                break
            frequency = self.count[child] / self.count[node]
            prob *= frequency
            if prob < min_prob:
                break
            held = length + len(tokens)
            tokens.append(self.token[child])
            confidence.append(frequency * held / (held + 1))
            score += prob
            node = child
        return Speculation(tokens, length, score, confidence)


class GlobalSuffixTree:
    """The tree of the latest requests' outputs, shared by the sessions of one draft worker: at most max_tokens
    tokens of them, the least recently finished request evicted first."""

    def __init__(self, depth: int, max_tokens: int):
        self.tree = SuffixTree(depth)
        self.max_tokens = max_tokens
        self.held: dict[int, list[int]] = {}  # request number -> its output, oldest first
        self.added = 0

    def add(self, output: Sequence[int]) -> None:
        """A finished request's output; evicts the oldest ones past the budget (an output beyond the whole
        budget keeps only its last max_tokens tokens)."""
        output = list(output[len(output) - self.max_tokens :]) if self.max_tokens else []
        if not output:
            return
        while self.held and self.tree.tokens_held + len(output) > self.max_tokens:
            self.tree.remove(self.held.pop(next(iter(self.held))))
        self.tree.append(self.tree.cursor(), output)
        self.held[self.added] = output
        self.added += 1
