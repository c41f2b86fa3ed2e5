"""A session's token sequence and the KV cache that holds (a prefix of) it, per docs/design/round.md.

Between rounds the cache holds every committed token but the pending tail; a forward pass feeds tokens on top of
the cache, and a rollback crops rejected tokens off its end in O(1), never re-running the prefix. Forward passes
of several sessions run as one batch: the runner's forward over their caches.
"""

import torch

from specdec.common.batched_forward import as_sampling_input
from specdec.common.model_runner import ModelRunner


class CachedSequence:
    def __init__(self, runner: ModelRunner, prompt: list[int], max_tokens: int | None = None):
        self.runner = runner
        self.tokens = list(prompt)  # committed tokens: prompt + accepted output
        self.max_tokens = max_tokens  # the session's reservation: the cache never grows past it
        self.cache = runner.new_cache(max_tokens)

    @property
    def cache_len(self) -> int:
        """Tokens in the cache; may exceed len(tokens) while drafted tokens are held."""
        return self.cache.get_seq_length()

    def pending(self) -> list[int]:
        """Committed tokens not yet in the cache: fed at the start of the next forward pass."""
        return self.tokens[self.cache_len :]

    def forward(self, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Feeds token_ids on top of the cache; returns the last logits_to_keep rows as CPU float32 [k, V]."""
        return as_sampling_input(self.runner.forward([self.cache], [token_ids], [logits_to_keep])[0])

    def prefill(self, max_tokens: int | None = None) -> bool:
        """Caches the prompt but its last token, which stays pending for the first round: at most max_tokens more
        of it per call (a chunk), or all at once. True once all of it is cached."""
        end, start = len(self.tokens) - 1, self.cache_len
        if start < end:
            self.forward(self.tokens[start : end if max_tokens is None else min(end, start + max_tokens)], 1)
        return self.cache_len >= end

    def crop_to(self, keep: int) -> int:
        """Crops the cache to its first keep tokens; returns how many tokens were removed."""
        return self.runner.crop_to(self.cache, keep)
