"""Model runners: the one interface through which workers (and the bench) run a loaded model, one class per engine.

A runner makes session caches, runs one forward pass over several sessions' new tokens (returning the logit rows
asked for), rolls a cache back, copies one, and measures its own cost curve. What was loaded (tokenizer, its
fingerprint, vocabulary, end-of-sequence ids, context length) is the LoadedModel's (common.loaded_model); sampling, q,
the acceptance test and top-k/top-p are common.sampling's, on the logits a runner returns.

- TorchRunner: transformers' forward with specdec's ragged attention (common.batched_forward), over float32
  oneDNN-packed, eager, bfloat16 (GPU) or #int8 layers.
- GgufRunner (common.quantized.decoder): the gguf engine's own decoder pass on the file's quantized blocks.
"""

import statistics
import time
from abc import ABC, abstractmethod

import torch
from transformers.cache_utils import Cache

from specdec.common import startup_turn
from specdec.common.batched_forward import clone_cache, forward_sessions, session_cache, use_ragged_attention
from specdec.common.cost_curve import nondecreasing

# The cost curve's token counts: every count a single session's round can feed, then batches of several sessions.
CALIBRATION_TOKENS = [*range(1, 11), 12, 16, 24, 32, 48, 64]
CALIBRATION_CONTEXT = 160  # tokens already in each session's cache: a chat prompt and some of its answer
MAX_TOKENS_PER_SESSION = 8


class ModelRunner(ABC):
    engine: str
    # Whether a session's logits are the same alone, beside other sessions and at any row count of the pass. A
    # runner that is not runs each session in a pass of its own (see forward), and is never padded.
    batch_invariant: bool = True
    # Whether every row count runs the same kernels (rows share only the loading of the weights, each adds its
    # own products): a pass over more rows then never costs less, a new row count needs no warm-up, and a row's
    # logits are bit for bit the same in a pass of any row count (so a round's first row may be scored in a pass
    # of its own: decode ahead). torch's products pick their kernels by the row count: its rows differ in the last
    # bits between a 1-row and a 4-row pass.
    fixed_kernels: bool = False

    @property
    def rows_alone(self) -> bool:
        """Whether a row's numbers are the same in any pass, alone or beside others, at any row count: a row may
        then be scored ahead of its round (decode ahead), and a token's keys and values reused from a cache another
        pass wrote (prefix caching), exactly."""
        return self.batch_invariant and self.fixed_kernels

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # Every forward of transformers' over the model (a torch pass, or generate on the gguf engine's layers)
        # goes through the ragged attention.
        use_ragged_attention(model)

    def new_cache(self, max_tokens: int | None = None) -> Cache:
        """An empty cache for one session; its buffers never grow past max_tokens (the session's reservation)."""
        return session_cache(self.model.config.get_text_config().num_hidden_layers, max_tokens)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token of a session's cache takes: keys and values of every layer."""
        text = self.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * element

    @abstractmethod
    def forward(self, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]) -> list[torch.Tensor]:
        """Feeds token_ids[i] on top of caches[i], all in one pass; for each session its last logits_to_keep[i]
        rows of logits [k_i, V], on the model's device and in its dtype (common.batched_forward.as_sampling_input
        makes them what the sampling math takes)."""

    @staticmethod
    def crop_to(cache: Cache, keep: int) -> int:
        """Crops the cache to its first keep tokens (O(1): a length moves); returns how many were removed."""
        removed = cache.get_seq_length() - keep
        if removed > 0:
            cache.crop(-removed)
        return max(removed, 0)

    @staticmethod
    def copy_cache(cache: Cache) -> Cache:
        return clone_cache(cache)

    def cost_curve(self, vocab_size: int, repeats: int = 2) -> list[tuple[int, float]]:
        """(tokens, median ms) of one pass for each count in CALIBRATION_TOKENS at a CALIBRATION_CONTEXT-token
        context, with logits for every token as a verification needs them (the output layer is a large share of
        a small model's pass); more than 8 tokens are split over sessions of at most 8, the way rounds of several
        sessions are batched. With fixed kernels only the first shape is warmed up, and since the cost cannot
        fall with more rows, a dip measured in a noisy moment is smoothed away (nondecreasing) instead of making
        every pass padded to the dip (cost_curve.cheapest_rows). In a `specdec serve` worker nothing else of specdec
        computes on the machine meanwhile (common.startup_turn)."""
        startup_turn.alone()
        generator = torch.Generator().manual_seed(0)
        context = torch.randint(0, vocab_size, (CALIBRATION_CONTEXT,), generator=generator).tolist()
        caches: list[Cache] = []
        costs = []
        for tokens in CALIBRATION_TOKENS:
            sizes = [MAX_TOKENS_PER_SESSION] * (tokens // MAX_TOKENS_PER_SESSION)
            if tokens % MAX_TOKENS_PER_SESSION:
                sizes.append(tokens % MAX_TOKENS_PER_SESSION)
            while len(caches) < len(sizes):
                # One prefill, then copies: prefilling 8 sessions of the context was most of a worker's start-up.
                if caches:
                    caches.append(self.copy_cache(caches[0]))
                else:
                    caches.append(self.new_cache())
                    self.forward([caches[-1]], [context], [1])
            batch = caches[: len(sizes)]
            feeds = [context[:n] for n in sizes]
            samples = []
            warm_ups = 0 if self.fixed_kernels and costs else 1  # the first run of a shape warms up its kernels
            for _ in range(repeats + warm_ups):
                start = time.perf_counter()
                self.forward(batch, feeds, sizes)
                samples.append((time.perf_counter() - start) * 1e3)
                for cache in batch:
                    self.crop_to(cache, CALIBRATION_CONTEXT)
            costs.append((tokens, statistics.median(samples[warm_ups:])))
        return nondecreasing(costs) if self.fixed_kernels else costs


class TorchRunner(ModelRunner):
    """transformers' forward over the packed sessions, attention per session (common.batched_forward)."""

    engine = "torch"

    def __init__(self, model: torch.nn.Module, batch_invariant: bool = True):
        super().__init__(model)
        self.batch_invariant = batch_invariant

    def forward(self, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]) -> list[torch.Tensor]:
        if len(caches) > 1 and not self.batch_invariant:
            return [
                forward_sessions(self.model, [c], [ids], [k])[0]
                for c, ids, k in zip(caches, token_ids, logits_to_keep, strict=True)
            ]
        return forward_sessions(self.model, caches, token_ids, logits_to_keep)


def runner_for(model: torch.nn.Module, engine: str, batch_invariant: bool = True) -> ModelRunner:
    """The runner of a model loaded for `engine` (common.models.resolve_engine)."""
    if engine == "gguf":
        from specdec.common.quantized.decoder import GgufRunner

        return GgufRunner(model)
    return TorchRunner(model, batch_invariant)
