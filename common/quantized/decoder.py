"""The gguf engine's forward pass over several sessions: a llama / qwen2 decoder written out as a few calls per
layer into the kernels (products, RMS norm, rotary embedding, attention over each session's cache).

transformers' own forward over the same layers spends about a fifth of a 1.5B decoding step on 2 cores in Python
and small torch ops (some 60 per layer); this pass reads the same modules (so the variants `#layers=` and
`#vocab=` apply) and computes the same functions. Every row is computed on its own (see decoder_ops.h and
kernels.cpp), so a session's logits are bit-identical alone, in a pass of any row count and beside any sessions.
"""

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from common.quantized.kernels import kernels
from common.quantized.layers import QuantizedLinear


class StackedProducts:
    """Products that read the same input, in as few kernel calls as their formats allow (QuantizedLinear.stacked):
    q, k and v (v's format differs in some layers of a Q4_K_M file), gate and up."""

    def __init__(self, layers: list[QuantizedLinear]):
        groups: dict[tuple, list[QuantizedLinear]] = {}
        for layer in layers:
            groups.setdefault(layer.stacking_key, []).append(layer)
        self.calls = [
            (group[0] if len(group) == 1 else QuantizedLinear.stacked(group), [g.out_features for g in group])
            for group in groups.values()
        ]
        order = [layer for group in groups.values() for layer in group]
        self.order = [order.index(layer) for layer in layers]  # where each given layer's output lands

    def __call__(self, h: torch.Tensor) -> list[torch.Tensor]:
        outputs = [y for linear, sizes in self.calls for y in linear.product(h).split(sizes, dim=1)]
        return [outputs[i] for i in self.order]


class DecoderLayer:
    """One layer's modules, looked up once."""

    def __init__(self, layer: torch.nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.o, self.down = attention.o_proj, mlp.down_proj
        self.qkv = StackedProducts([attention.q_proj, attention.k_proj, attention.v_proj])
        self.gate_up = StackedProducts([mlp.gate_proj, mlp.up_proj])
        self.attention_norm, self.ffn_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.head_dim, self.scaling = attention.head_dim, attention.scaling


class QuantizedDecoder:
    """The pass of common.model_runner.GgufRunner, over a model built by common.quantized.loader."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.layers: list[DecoderLayer] | None = None  # built at the first pass, after any variant has trimmed them

    def __call__(self, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return self.forward(caches, token_ids, logits_to_keep)

    def forward(self, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]) -> list[torch.Tensor]:
        ops, decoder = kernels(), self.model.get_decoder()
        if self.layers is None:
            self.layers = [DecoderLayer(layer) for layer in decoder.layers]
        text = self.model.config.get_text_config()
        heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
        lengths = [len(ids) for ids in token_ids]
        starts = [cache.get_seq_length() for cache in caches]
        rows = sum(lengths)
        ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        hidden = decoder.embed_tokens(ids).contiguous()
        cos, sin = (t[0].contiguous() for t in decoder.rotary_emb(hidden[None], positions[None]))
        # Room in every session's buffers for this pass (their lengths move only once the pass has succeeded).
        for layer, spec in enumerate(self.layers):
            prototype = hidden.new_empty(1, kv_heads, 0, spec.head_dim)
            for cache, start, n in zip(caches, starts, lengths, strict=True):
                buffers = cache.layers[layer]
                if not buffers.is_initialized:
                    buffers.lazy_initialization(prototype, prototype)
                buffers.reserve(prototype, prototype, start + n)
        for layer, spec in enumerate(self.layers):
            h = ops.rms_norm(hidden, spec.attention_norm.weight, spec.attention_norm.variance_epsilon)
            q, k, v = spec.qkv(h)
            q = q.contiguous().view(rows, heads, spec.head_dim)
            k = k.contiguous().view(rows, kv_heads, spec.head_dim)
            v = v.contiguous().view(rows, kv_heads, spec.head_dim)
            ops.rotary(q, cos, sin)
            ops.rotary(k, cos, sin)
            buffers = [cache.layers[layer] for cache in caches]
            attended = ops.attend_sessions(
                q, k, v, [b.key_buffer for b in buffers], [b.value_buffer for b in buffers], starts, lengths, spec.scaling
            )
            hidden += spec.o.product(attended)
            h = ops.rms_norm(hidden, spec.ffn_norm.weight, spec.ffn_norm.variance_epsilon)
            gate, up = spec.gate_up(h)
            # Not in place: gate is a column slice of the stacked product, and down's kernel takes contiguous rows.
            gate = F.silu(gate).mul_(up)
            hidden += spec.down.product(gate)
        for cache, start, n in zip(caches, starts, lengths, strict=True):
            for buffers in cache.layers:
                buffers.set_length(start + n)
        ends = torch.tensor(lengths).cumsum(0).tolist()
        keep = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, logits_to_keep, strict=True)])
        last = ops.rms_norm(hidden[keep].contiguous(), decoder.norm.weight, decoder.norm.variance_epsilon)
        return list(self.model.get_output_embeddings()(last).split(logits_to_keep))
