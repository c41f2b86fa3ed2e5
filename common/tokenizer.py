"""Tokenizers behind one small interface: Hugging Face tokenizers and the byte-level one of tiny-random models."""

import codecs
import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

CHAT_ROLES = ("system", "user", "assistant")
REPLACEMENT_CHAR = "\ufffd"  # what decoding shows for an unfinished multi-byte character


class Tokenizer(Protocol):
    fingerprint: str
    eos_token_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (its decoded text alone may be U+FFFD: a piece of a character)."""

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode_stream(self) -> "TextStream": ...


class TextStream(Protocol):
    """Incremental detokenisation: the text of each new token, in constant time whatever came before (decoding
    the whole output again every round would cost a long answer more per round than a short one)."""

    def step(self, token_id: int) -> str:
        """The text the token completes ("" while it is part of an unfinished character)."""


def fingerprint_of(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


class ByteTokenizer:
    """Byte-level tokenizer of tiny-random models: id 0 is end-of-sequence, byte b is id 1 + b mod (vocab - 1).

    With vocab >= 256 every byte of valid UTF-8 (which never uses 0xFF) round-trips; smaller vocabularies fold
    bytes together, which is fine for the random models they serve.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids = [0]
        self.fingerprint = fingerprint_of({"byte-level": vocab_size})

    def encode(self, text: str) -> list[int]:
        return [1 + b % (self.vocab_size - 1) for b in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t - 1 for t in token_ids if 0 < t < min(self.vocab_size, 257)).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 1]) if 0 < token_id < min(self.vocab_size, 257) else b""

    def decode_stream(self) -> "ByteStream":
        return ByteStream(self.vocab_size)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


class ByteStream:
    def __init__(self, vocab_size: int):
        self.limit = min(vocab_size, 257)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self.decoder.decode(bytes([token_id - 1])) if 0 < token_id < self.limit else ""


class HFTokenizer:
    """A Hugging Face tokenizer; chats are rendered with the model's own chat template."""

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self.hf = tokenizer
        self.eos_token_ids = eos_token_ids
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        self.fingerprint = fingerprint_of({"vocab": vocab, "special": sorted(tokenizer.all_special_tokens)})

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level BPE token's piece mapped back through its byte alphabet (GPT-2's, which SmolLM2's and
        Qwen's use); any other token's text."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        alphabet = byte_alphabet()
        if piece and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        return self.hf.decode([token_id]).encode("utf-8")

    def decode_stream(self) -> "TextStream":
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            # No fast tokenizer, or a clean-up that rewrites text already decoded: only whole decodes are exact.
            return WholeDecodeStream(self.decode)
        return HFStream(backend, self.decode)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.hf.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.encode(text)
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters and the byte each stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # slow to import: only once asked

    return {char: byte for byte, char in bytes_to_unicode().items()}


class HFStream:
    """tokenizers' DecodeStream, which raises on some byte-fallback runs that are not UTF-8 ("Invalid prefix
    encountered"); the request then goes on with whole decodes from where the stream stopped."""

    def __init__(self, backend, decode):
        self.backend, self.decode = backend, decode  # the tokenizers.Tokenizer under the transformers tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters returned so far
        self.fallback: WholeDecodeStream | None = None

    def step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self.fallback is None:
            try:
                piece = self.stream.step(self.backend, token_id) or ""
                self.emitted += len(piece)
                return piece
            except Exception:  # noqa: BLE001 - the whole decode below never fails
                self.fallback = WholeDecodeStream(self.decode, self.token_ids[:-1], self.emitted)
        return self.fallback.step(token_id)


class WholeDecodeStream:
    """Decodes all tokens so far at each step and returns what is new, holding back a trailing unfinished
    character: exact for any tokenizer, at a cost that grows with the answer."""

    def __init__(self, decode, token_ids: Sequence[int] = (), emitted: int = 0):
        self.decode = decode
        self.token_ids = list(token_ids)
        self.emitted = emitted

    def step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self.decode(self.token_ids)
        end = len(text.rstrip(REPLACEMENT_CHAR))
        piece = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece
