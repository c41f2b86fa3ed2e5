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
