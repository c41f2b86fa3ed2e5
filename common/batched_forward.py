"""One forward pass over several sessions' new tokens, each session on its own KV cache.

The sessions' tokens are packed into one row ([1, sum of n_i]), so every linear layer (where the weights are
streamed, the cost that batching amortises) runs once for all of them; attention runs per session against that
session's own cache, at its own positions. No cache is padded, stacked or copied to form the batch: each session's
keys and values live in a buffer that grows by doubling (never past the session's reservation), so appending a
round's tokens writes only those tokens and a rollback only moves a length (round.md's crop, O(1)).

A session's attention is computed with the same shapes whether it runs alone or in a batch; only the row count of
the matrix products changes with the batch.
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer

ATTENTION = "specdec_ragged"
INITIAL_CAPACITY = 64


class GrowableLayer(DynamicLayer):
    """A DynamicLayer with spare capacity: an update writes the new tokens only (transformers' DynamicLayer
    concatenates, copying the whole layer every forward pass). keys and values are views of the filled part.
    max_tokens: the most the buffers grow to (the session's KV reservation); None for no bound."""

    def __init__(self, max_tokens: int | None = None):
        super().__init__()
        self.max_tokens = max_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self.key_buffer = self.value_buffer = None
        self.is_initialized = True

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = self.key_buffer.shape[-2] if self.key_buffer is not None else 0
        if needed <= capacity:
            return
        capacity = max(INITIAL_CAPACITY, 2 * capacity, needed)
        if self.max_tokens is not None:
            if needed > self.max_tokens:
                raise ValueError(f"the cache would hold {needed} tokens, beyond its reservation of {self.max_tokens}")
            capacity = min(capacity, self.max_tokens)
        batch, heads = key_states.shape[:2]
        keys = key_states.new_empty(batch, heads, capacity, key_states.shape[-1])
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self.length:
            keys[:, :, : self.length] = self.keys
            values[:, :, : self.length] = self.values
        self.key_buffer, self.value_buffer = keys, values

    def set_length(self, length: int) -> None:
        self.length = length

    # keys and values are views of the filled part, made when read: every pass moves the length of each layer of
    # each session in it, and making both views there cost about 1.5 ms of a 95 ms pass of 8 sessions of the 1.5B
    # on the gguf engine, which never reads them (measured). Without live buffers (before the first pass, after a
    # reset) they are what was last assigned, as in DynamicLayer.
    def filled(self, buffer_name: str, assigned: torch.Tensor | None) -> torch.Tensor | None:
        buffer = self.__dict__.get(buffer_name)
        live = buffer is not None and self.__dict__.get("is_initialized")
        return buffer[:, :, : self.length] if live else assigned

    @property
    def keys(self) -> torch.Tensor | None:
        return self.filled("key_buffer", self._keys)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        return self.filled("value_buffer", self._values)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self.reserve(key_states, value_states, end)
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.set_length(max(0, self.length + tokens_to_remove))


def session_cache(num_layers: int, max_tokens: int | None = None) -> Cache:
    return Cache(layers=[GrowableLayer(max_tokens) for _ in range(num_layers)])


def clone_cache(cache: Cache) -> Cache:
    """A session cache holding a copy of `cache`'s tokens in buffers of its own."""
    copy = session_cache(len(cache.layers), cache.layers[0].max_tokens if cache.layers else None)
    for source, target in zip(cache.layers, copy.layers, strict=True):
        if source.is_initialized and source.key_buffer is not None:
            target.lazy_initialization(source.keys, source.values)
            target.key_buffer, target.value_buffer = source.key_buffer.clone(), source.value_buffer.clone()
            target.set_length(source.length)
    return copy


def copy_prefix(source: Cache, target: Cache, length: int) -> None:
    """Writes the keys and values of source's first `length` tokens into target, an empty session cache, in
    buffers of target's own with room for its next tokens (common.prefix_cache)."""
    for source_layer, layer in zip(source.layers, target.layers, strict=True):
        keys, values = source_layer.key_buffer[:, :, :length], source_layer.value_buffer[:, :, :length]
        layer.lazy_initialization(keys, values)
        capacity = max(INITIAL_CAPACITY, 2 * length)
        if layer.max_tokens is not None:
            capacity = min(capacity, layer.max_tokens)
        layer.reserve(keys, values, capacity)
        layer.key_buffer[:, :, :length] = keys
        layer.value_buffer[:, :, :length] = values
        layer.set_length(length)


def held_tokens(cache: Cache) -> int:
    """The tokens a session cache's buffers have room for: the memory it takes, in tokens."""
    layer = cache.layers[0] if cache.layers else None
    buffer = getattr(layer, "key_buffer", None)
    return buffer.shape[-2] if buffer is not None else 0


class RaggedCache:
    """What the model sees as its cache during a batched pass: update() splits the packed keys and values by
    session, appends each part to its session's cache, and hands every session's full keys and values on to
    ragged_attention."""

    def __init__(self, caches: list[Cache], lengths: list[int]):
        self.caches, self.lengths = caches, lengths

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for cache, k, v in zip(
            self.caches, key_states.split(self.lengths, dim=-2), value_states.split(self.lengths, dim=-2), strict=True
        ):
            full_k, full_v = cache.layers[layer_idx].update(k, v)
            keys.append(full_k)
            values.append(full_v)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def causal_mask(query_length: int, key_length: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """The query block is the last query_length positions of key_length: row i sees keys up to its own position, and
    with a sliding window only the last `window` of them (its own included: transformers' sliding_window_overlay)."""
    rows = torch.arange(key_length - query_length, key_length, device=device)[:, None]
    keys = torch.arange(key_length, device=device)[None, :]
    return (keys <= rows) & (keys > rows - window) if window else keys <= rows


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, window: int | None = None
) -> torch.Tensor:
    """One session's attention, [1, heads, n, d] queries against its [1, kv_heads, L, d] cache."""
    n, length = query.shape[-2], keys.shape[-2]
    if n == 1 and window and length > window:  # a step sees the last window keys: a slice, not a mask
        keys, values, length = keys[..., -window:, :], values[..., -window:, :], window
    mask = causal_mask(n, length, query.device, window) if n > 1 else None
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1]
    )


# Up to this many new tokens of a session (a decoding step, a verification) attend one query row at a time when the
# model asks for row-exact attention: each row then runs the very computation of a one-token step at its position,
# bit for bit. A fused multi-row attention accumulates in another order (differences of 1e-7), which a model on
# quantized activations (the gguf engine) can amplify to a different token. Longer feeds (prefills) run as one
# masked call: a prompt is prefilled the same way alone or in any batch, since attention is per session.
ROW_EXACT_QUERY_ROWS = 16


def attend_rows(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, window: int | None = None
) -> torch.Tensor:
    """attend, one query row at a time, each against the keys up to its own position."""
    n, length = query.shape[-2], keys.shape[-2]
    rows = [
        attend(
            query[..., i : i + 1, :], keys[..., : length - n + i + 1, :], values[..., : length - n + i + 1, :], scaling, window
        )
        for i in range(n)
    ]
    return rows[0] if n == 1 else torch.cat(rows, dim=-2)


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """Attention for a packed batch: key and value are lists, one session's full cache each (see RaggedCache).
    sliding_window: the window of a sliding-window layer (the models of WINDOWED_MODEL_TYPES pass it), else None.

    Called with plain tensors (a forward pass that did not come through forward_sessions, e.g. Hugging Face's
    generate on this model), it treats them as one unpadded sequence.
    """
    row_exact = getattr(module.config, "row_exact_attention", False)

    def one(q, k, v):
        if row_exact and q.shape[-2] <= ROW_EXACT_QUERY_ROWS:
            return attend_rows(q, k, v, scaling, sliding_window)
        return attend(q, k, v, scaling, sliding_window)

    if isinstance(key, torch.Tensor):
        output = one(query, key, value)
    else:
        queries = query.split(kwargs["ragged_lengths"], dim=-2)
        output = torch.cat([one(q, k, v) for q, k, v in zip(queries, key, value, strict=True)], dim=-2)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ragged_attention)


# The model types whose attention hands its layer's window to the attention function (sliding_window=): the ragged
# attention applies it. Others with a window configured are refused rather than run as full attention.
WINDOWED_MODEL_TYPES = ("gemma3_text", "qwen2", "qwen3")


def check_supported(config) -> str | None:
    """Why the ragged attention cannot serve this model, or None when it can."""
    config = config.get_text_config()
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if windowed and config.model_type not in WINDOWED_MODEL_TYPES:
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    return None


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Switches the model to the ragged attention; every forward pass of a worker goes through it."""
    reason = check_supported(model.config)
    if reason:
        raise ValueError(f"{model.config.model_type} uses {reason}, which specdec's batched attention does not implement")
    model.config._attn_implementation = ATTENTION


@torch.inference_mode()
def forward_sessions(
    model: torch.nn.Module, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]
) -> list[torch.Tensor]:
    """Feeds token_ids[i] on top of caches[i], all in one pass; returns for each session its last
    logits_to_keep[i] rows of logits [k_i, V], on the model's device and in its dtype: a greedy verdict needs only
    their argmax, so the rows (151,936 entries each for Qwen) are copied to CPU float32 only where sampling needs
    them (as_sampling_input)."""
    if model.config._attn_implementation != ATTENTION:
        use_ragged_attention(model)
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in token_ids]
    input_ids = torch.tensor([[t for ids in token_ids for t in ids]], dtype=torch.long, device=device)
    positions = torch.cat(
        [torch.arange(c.get_seq_length(), c.get_seq_length() + n) for c, n in zip(caches, lengths, strict=True)]
    )
    ends = torch.tensor(lengths).cumsum(0)
    keep = torch.cat([torch.arange(int(end) - k, int(end)) for end, k in zip(ends, logits_to_keep, strict=True)])
    out = model(
        input_ids=input_ids,
        position_ids=positions[None].to(device),
        cache=RaggedCache(caches, lengths),
        use_cache=True,
        logits_to_keep=keep.to(device),
        ragged_lengths=lengths,
    )
    if device.type == "cuda":
        # The pass is queued, not done: callers time it and read its rows right after, so wait for it here.
        torch.cuda.synchronize(device)
    return list(out.logits[0].split(logits_to_keep))


def as_sampling_input(logits: torch.Tensor) -> torch.Tensor:
    """Logits as the sampling math takes them: CPU float32, so that a seed gives the same draws on any device."""
    return logits.float().cpu()
