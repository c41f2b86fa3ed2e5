"""A session's token sequence and the KV cache that holds (a prefix of) it, per ../design/round.md.

Between rounds the cache holds every committed token but the pending tail; a forward pass feeds tokens on top of
the cache, and a rollback crops rejected tokens off its end in O(1) tensor views, never re-running the prefix.
"""

import time

import torch
from transformers import DynamicCache


class CachedSequence:
    def __init__(self, model: torch.nn.Module, prompt: list[int]):
        self.model = model
        self.tokens = list(prompt)  # committed tokens: prompt + accepted output
        self.cache = DynamicCache(config=model.config)
        self.cache_len = 0  # tokens in the cache; may exceed len(tokens) while drafted tokens are held

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def pending(self) -> list[int]:
        """Committed tokens not yet in the cache: fed at the start of the next forward pass."""
        return self.tokens[self.cache_len :]

    @torch.inference_mode()
    def forward(self, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Feeds token_ids on top of the cache; returns the last logits_to_keep rows as CPU float32 [k, V]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self.cache_len += len(token_ids)
        return out.logits[0, -logits_to_keep:].float().cpu()

    def prefill(self) -> None:
        """Caches the prompt but its last token, which stays pending for the first round."""
        if len(self.tokens) > 1:
            self.forward(self.tokens[:-1], 1)

    def rollback(self, keep: int) -> int:
        """Crops the cache to its first keep tokens; returns how many tokens were removed."""
        removed = self.cache_len - keep
        if removed > 0:
            self.cache.crop(-removed)
            self.cache_len = keep
        return max(removed, 0)


def elapsed_us(start: float) -> int:
    return int((time.perf_counter() - start) * 1e6)
