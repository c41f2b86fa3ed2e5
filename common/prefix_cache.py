"""Prefix caching: the KV caches of closed sessions, kept so that a new prompt that begins with the same tokens
starts from a copy of them instead of computing them again (vLLM's automatic prefix caching, llama.cpp's
cache_prompt).

An agent's requests repeat their history: each turn's prompt is the last one plus a little, a chat carries its
system prompt, an editor resends the file. Prefill is then most of a request on a CPU (the 1.5B prefills some 7 ms a
token; a 400-token prompt costs as much as 50 decoding steps), and all of it is work already done.

Exact only on a runner whose rows are computed alone (common.model_runner: batch_invariant and fixed_kernels): a
token's keys and values are then the same bit for bit whether it was computed in a prefill chunk, in a round's
verification or one at a time, so a session that starts from a copy holds the very numbers its own prefill would
have written, and its output is the same as without the cache. Other runners get no prefix cache.

Memory: the kept caches count against the worker's KV budget (common.sessions), which takes them back, least
recently used first, when an opening needs the room; on their own they never exceed max_tokens.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from specdec.common.batched_forward import copy_prefix, held_tokens
from specdec.common.model_runner import ModelRunner


@dataclass
class CachedPrefix:
    tokens: torch.Tensor  # int64 [n]: the tokens whose keys and values the cache holds, in order
    cache: Cache  # its first len(tokens) positions are never written again (the session it came from is closed)
    held: int  # the tokens of memory its buffers take (their capacity, at least len(tokens))
    last_used: float = field(default_factory=time.monotonic)


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) if len(differs) else n


class PrefixCache:
    """Thread-safe: sessions close on the event loop, openings look their prompt up on the compute thread."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        # What the worker's KV budget leaves unreserved (None: no budget); set by the SessionRegistry it lends to.
        self.room: Callable[[], int | None] = lambda: None
        self.entries: list[CachedPrefix] = []
        self.lock = threading.Lock()
        self.hits = 0  # openings that started from a kept prefix

    @property
    def held(self) -> int:
        with self.lock:
            return sum(e.held for e in self.entries)

    def longest(self, prompt: list[int]) -> tuple[CachedPrefix | None, int]:
        """The kept cache sharing the longest prefix with the prompt, and that prefix's length: at most all of the
        prompt but its last token, which a session keeps pending for its first round (its logits are needed)."""
        usable = len(prompt) - 1
        if usable < 1:
            return None, 0
        wanted = torch.tensor(prompt[:usable], dtype=torch.long)
        with self.lock:
            best, length = None, 0
            for entry in self.entries:
                n = common_prefix_length(entry.tokens, wanted)
                if n > length:
                    best, length = entry, n
            if best is not None:
                best.last_used = time.monotonic()
            return best, length

    def start_from(self, prompt: list[int], cache: Cache) -> int:
        """Copies the keys and values of the longest kept prefix of the prompt into a session's empty cache; how
        many tokens it now holds (0: none kept)."""
        entry, length = self.longest(prompt)
        if entry is None:
            return 0
        # Outside the lock: the kept positions are never written, and an entry evicted meanwhile stays alive here.
        copy_prefix(entry.cache, cache, length)
        with self.lock:
            self.hits += 1
        return length

    def keep(self, tokens: list[int], cache: Cache) -> bool:
        """Keeps a closed session's cache (its reservation already given back) for the prompts that begin with its
        tokens (those of its cache that are committed); makes room by evicting the least recently used, within both
        max_tokens and what the KV budget has unreserved. False when it does not fit or adds nothing."""
        length = min(len(tokens), cache.get_seq_length())
        held = held_tokens(cache)
        room = self.room()
        limit = self.max_tokens if room is None else min(self.max_tokens, room)
        if length < 2 or held > limit:
            return False
        kept = torch.tensor(tokens[:length], dtype=torch.long)
        with self.lock:
            shared = [common_prefix_length(e.tokens, kept) for e in self.entries]
            for entry, n in zip(self.entries, shared, strict=True):
                if n == length:
                    entry.last_used = time.monotonic()
                    return False  # an entry already holds all of it
            # Entries that are prefixes of this one are of no more use.
            self.entries = [e for e, n in zip(self.entries, shared, strict=True) if n < len(e.tokens)]
            self.evict_locked(sum(e.held for e in self.entries) + held - limit)
            self.entries.append(CachedPrefix(kept, cache, held))
            return True

    def release(self, tokens: int) -> int:
        """Evicts the least recently used entries until `tokens` are freed (or none is left); the tokens freed."""
        with self.lock:
            return self.evict_locked(tokens)

    def evict_locked(self, tokens: int) -> int:
        freed = 0
        self.entries.sort(key=lambda e: e.last_used)
        while self.entries and freed < tokens:
            freed += self.entries.pop(0).held
        return freed


def prefix_cache_for(runner: ModelRunner, max_tokens: int) -> PrefixCache | None:
    """A worker's prefix cache: only where the runner computes every row alone (see above), and not turned off."""
    return PrefixCache(max_tokens) if max_tokens > 0 and runner.rows_alone else None
