"""Turns committed tokens into what the client sees: text deltas, and where generation must stop.

Generation stops at an end-of-sequence token (unless ignored), at the first stop string, or after
max_new_tokens. Text that could still become a stop string, or an incomplete UTF-8 character, is held back
so that nothing streamed ever has to be taken back.
"""

from dataclasses import dataclass, field

from common.tokenizer import REPLACEMENT_CHAR, Tokenizer
from specdec.v1 import generation_pb2


@dataclass
class Delta:
    text: str
    token_ids: list[int]


def held_back_length(text: str, stop: list[str]) -> int:
    """Characters at the end of text that might begin a stop string or complete a multi-byte character."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                held = max(held, k)
                break
    if text.endswith(REPLACEMENT_CHAR):
        held = max(held, len(text) - len(text.rstrip(REPLACEMENT_CHAR)))
    return held


def find_stop(text: str, stop: list[str], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:], or -1."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else -1


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
        self.longest_stop = max((len(s) for s in self.stop), default=0)

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
        safe = len(self.text) if self.finished else len(self.text) - held_back_length(self.text, self.stop)
        delta = Delta(self.text[self.emitted_chars : max(safe, self.emitted_chars)], self.token_ids[self.emitted_tokens :])
        self.emitted_chars = max(safe, self.emitted_chars)
        self.emitted_tokens = len(self.token_ids)
        return delta

    def cut_at_stop(self, checked: int) -> bool:
        """Looks for a stop string ending in the text after `checked`; cuts the text before the first one found."""
        index = find_stop(self.text, self.stop, max(0, checked - self.longest_stop + 1))
        if index < 0:
            return False
        self.text = self.text[:index]
        return True
