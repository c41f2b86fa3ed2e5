"""Turns committed tokens into what the client sees: text deltas, and where generation must stop.

Generation stops at an end-of-sequence token (unless ignored), at the first stop string, or after
max_new_tokens. Text that could still become a stop string, or an incomplete UTF-8 character, is held back
so that nothing streamed ever has to be taken back.
"""

from dataclasses import dataclass, field

from specdec.common.tokenizer import REPLACEMENT_CHAR, Tokenizer
from specdec.v1 import generation_pb2


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # per token of token_ids, when the request asked for them
    prompt_logprobs: list = field(default_factory=list)  # the first delta's, when the request asked for them


def prefix_function(pattern: str) -> list[int]:
    """KMP's failure table: for each i, the length of the longest proper prefix of pattern[: i + 1] that is also
    a suffix of it."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """Finds stop strings in text that grows piece by piece, in time linear in the new text: for each stop string
    it keeps how much of it the text so far ends with (a KMP automaton's state), so that no round rescans the text
    or slices every prefix of every stop string."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.tables = [prefix_function(s) for s in stop]
        self.matched = [0] * len(stop)  # per stop string: the longest prefix of it that the text ends with

    def feed(self, text: str, start: int) -> int:
        """Takes text[start:], the text added since the last call; returns the index in text of the earliest-starting
        stop string that it completes, or -1."""
        found = -1
        for n, (pattern, table) in enumerate(zip(self.stop, self.tables, strict=True)):
            k = self.matched[n]
            for i in range(start, len(text)):
                char = text[i]
                while k and char != pattern[k]:
                    k = table[k - 1]
                if char == pattern[k]:
                    k += 1
                if k == len(pattern):
                    begins = i + 1 - k
                    found = begins if found < 0 else min(found, begins)
                    k = table[k - 1]
                    break
            self.matched[n] = k
        return found

    @property
    def held(self) -> int:
        """Characters at the end of the text that might begin a stop string."""
        return max(self.matched, default=0)


def held_back_length(text: str, stop: list[str]) -> int:
    """Characters at the end of text that might begin a stop string or complete a multi-byte character."""
    matcher = StopMatcher(stop)
    matcher.feed(text, 0)
    return max(matcher.held, incomplete_tail(text))


def incomplete_tail(text: str) -> int:
    """Replacement characters at the end of text: bytes of a character whose remaining bytes are still to come."""
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR)) if text.endswith(REPLACEMENT_CHAR) else 0


@dataclass
class OutputTracker:
    """Detokenises incrementally (a round costs the same at token 2,000 as at token 20) and checks stop strings in
    the new text only; the text of a finished answer is decoded once as a whole, so it is exactly the tokenizer's."""

    tokenizer: Tokenizer
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_chars: int = 0
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED

    def __post_init__(self):
        self.stream = self.tokenizer.decode_stream()
        self.stops = StopMatcher(self.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def add(self, tokens: list[int]) -> Delta:
        """Appends one round's tokens, cutting them at the first stop condition; returns what may be streamed."""
        for token in tokens:
            self.token_ids.append(token)
            if not self.ignore_eos and token in self.eos_token_ids:
                self.finish_reason = generation_pb2.FINISH_REASON_EOS
                break
            checked = len(self.text)
            self.text += self.stream.step(token)
            if self.stop and self.cut_at_stop(checked):
                self.finish_reason = generation_pb2.FINISH_REASON_STOP
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            if self.finished:
                break
        if self.finished and self.finish_reason != generation_pb2.FINISH_REASON_STOP:
            self.text = self.tokenizer.decode(self.token_ids)  # once: includes a character the answer left unfinished
        safe = len(self.text) if self.finished else len(self.text) - max(self.stops.held, incomplete_tail(self.text))
        delta = Delta(self.text[self.emitted_chars : max(safe, self.emitted_chars)], self.token_ids[self.emitted_tokens :])
        self.emitted_chars = max(safe, self.emitted_chars)
        self.emitted_tokens = len(self.token_ids)
        return delta

    def cut_at_stop(self, checked: int) -> bool:
        """Looks for a stop string ending in the text after `checked`; cuts the text before the first one found."""
        index = self.stops.feed(self.text, checked)
        if index < 0:
            return False
        self.text = self.text[:index]
        return True
