"""Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's last n tokens."""

from common.models import parse_spec_params

NGRAM_PREFIX = "ngram"
NGRAM_DEFAULTS = {"max": 3, "min": 1}


def is_ngram(spec: str) -> bool:
    return spec == NGRAM_PREFIX or spec.startswith(NGRAM_PREFIX + ":")


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
