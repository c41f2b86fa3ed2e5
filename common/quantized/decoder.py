"""The gguf engine's forward pass over several sessions: a decoder of one of the architectures of
common/quantized/architectures.py whose layers run in one call into the kernels (decoder_layers.h: products, RMS
norm, rotary embedding, attention over each session's cache).

transformers' own forward over the same layers spends about a fifth of a 1.5B decoding step on 2 cores in Python and
small torch ops (some 60 per layer), and a loop of our own kernels called from Python still took 1.11-1.15x the time
of the C++ loop (docs/results/); this pass reads the same modules (so the variants `#layers=` and `#vocab=` apply)
and computes the same functions. Every row is computed on its own (see decoder_ops.h and kernels.cpp), so a
session's logits are bit-identical alone, in a pass of any row count and beside any sessions.
"""

import torch
from transformers.cache_utils import Cache

from specdec.common.model_runner import ModelRunner
from specdec.common.quantized.architectures import Architecture, architecture_of
from specdec.common.quantized.kernels import kernels
from specdec.common.quantized.layers import QuantizedLinear


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


def linear_spec(linear: QuantizedLinear) -> tuple:
    """A linear layer as the C++ layers take it: (kernel, its weight tensors, out features, in features, bias)."""
    packed = linear.packed
    return packed.kernel, list(packed.tensors), packed.out_features, packed.in_features, linear.bias


def stacked_spec(products: StackedProducts) -> tuple:
    return [(linear_spec(linear), sizes) for linear, sizes in products.calls], products.order


def norm_weights(norm: torch.nn.Module, offset: float) -> torch.Tensor:
    """An RMS norm's weights as the kernels multiply by them: transformers' weights plus the architecture's offset
    (Gemma's 1 + w, added in float32 as transformers does)."""
    weight = norm.weight.detach().float()
    return (weight + offset if offset else weight).contiguous()


def rope_tables(decoder: torch.nn.Module, text) -> list[str | None]:
    """The rotary tables a pass computes, by the layer type they serve (None: one table for every layer)."""
    return sorted(set(text.layer_types)) if architecture_of_decoder(decoder).rope_by_layer_type else [None]


# Positions a rotary table grows by.
ROPE_BLOCK = 256


def frequencies_move_with_length(rotary: torch.nn.Module) -> bool:
    """Whether transformers recomputes the rotary frequencies from a pass's positions (its dynamic and longrope
    types): their cos and sin then belong to the pass, and cannot be kept."""
    types = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    return any("dynamic" in t or t == "longrope" for t in types)


class RotaryTables:
    """cos and sin [rows, head dim] of a pass's positions, per rotary table, from transformers' rotary embedding (so
    that any rope scaling it implements applies). Each position's are computed once, in a call of its own, and
    kept: one shape for every position (a row of head-dim values, below torch's parallel grain: one call into MKL
    whatever the thread count), so they are the same bits in a pass of any length, on any worker. torch computes
    cos and sin with MKL's vector math on x86, which chooses its code by CPU and promises an accuracy, not the same
    bits for an element in calls of other lengths."""

    def __init__(self, decoder: torch.nn.Module, text):
        self.rotary, self.types = decoder.rotary_emb, rope_tables(decoder, text)
        self.kept = not frequencies_move_with_length(self.rotary)
        self.tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin of positions 0, 1, ...

    def computed(self, positions: torch.Tensor, table: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        by_type = () if table is None else (table,)
        cos, sin = self.rotary(torch.empty(1, len(positions), 1), positions[None], *by_type)
        return cos[0].contiguous(), sin[0].contiguous()

    def covering(self, table: str | None, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept table, grown by whole blocks of ROPE_BLOCK positions to cover the first `positions`."""
        kept = self.tables.get(table, ())
        have = len(kept[0]) if kept else 0
        if have < positions:
            whole_blocks = (positions + ROPE_BLOCK - 1) // ROPE_BLOCK * ROPE_BLOCK
            rows = [self.computed(torch.tensor([p]), table) for p in range(have, whole_blocks)]
            kept = tuple(torch.cat([*kept[i : i + 1], *(row[i] for row in rows)]) for i in (0, 1))
            self.tables[table] = kept
        return kept

    def __call__(self, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self.kept:
            tables = [self.computed(positions, t) for t in self.types]
        else:
            end = int(positions.max()) + 1 if len(positions) else 1
            tables = [[t.index_select(0, positions) for t in self.covering(table, end)] for table in self.types]
        return [cos for cos, _ in tables], [sin for _, sin in tables]


def architecture_of_decoder(decoder: torch.nn.Module) -> Architecture:
    return architecture_of(decoder.config.model_type)


def decoder_layers(decoder: torch.nn.Module, text):
    """The model's decoder layers as one C++ object (decoder_layers.h) that runs them all in a single call, with
    each architecture's optional blocks (architectures.py)."""
    architecture = architecture_of_decoder(decoder)
    offset = architecture.norm_offset
    layers = kernels().DecoderLayers(text.num_attention_heads, text.num_key_value_heads)
    tables = rope_tables(decoder, text)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * len(decoder.layers)
    for index, layer in enumerate(decoder.layers):
        attention, mlp = layer.self_attn, layer.mlp
        layer_type = layer_types[index]
        sandwich = architecture.sandwich_norms
        optional = lambda module: None if module is None else norm_weights(module, offset)  # noqa: E731
        layers.add_layer(
            norm_weights(layer.input_layernorm, offset),
            float(text.rms_norm_eps),
            stacked_spec(StackedProducts([attention.q_proj, attention.k_proj, attention.v_proj])),
            linear_spec(attention.o_proj),
            norm_weights(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, offset),
            stacked_spec(StackedProducts([mlp.gate_proj, mlp.up_proj])),
            linear_spec(mlp.down_proj),
            attention.head_dim,
            attention.scaling,
            optional(getattr(attention, "q_norm", None)),
            optional(getattr(attention, "k_norm", None)),
            optional(layer.post_attention_layernorm if sandwich else None),
            optional(layer.post_feedforward_layernorm if sandwich else None),
            architecture.gelu,
            int(text.sliding_window or 0) if layer_type == "sliding_attention" else 0,
            tables.index(layer_type if architecture.rope_by_layer_type else None),
            float(getattr(text, "attn_logit_softcapping", None) or 0.0),
        )
    return layers


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) where the config sets a final soft cap (as transformers' Gemma heads), else logits.
    Row by row: every row's tanh (MKL's, as cos in RotaryTables) in a call of the same length, whatever the pass."""
    if cap:
        for row in logits:
            row.div_(cap).tanh_().mul_(cap)
    return logits


class GgufRunner(ModelRunner):
    """The gguf engine's runner, over a model built by common.quantized.loader: every row computed on its own, so
    a session's logits are bit-identical alone, at any row count and in any batch."""

    engine = "gguf"
    fixed_kernels = True

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.layers = self.rotary = None  # built at the first pass, after any variant has trimmed them

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.float32  # the decoder's caches, whatever the blocks' format

    @torch.inference_mode()
    def forward(self, caches: list[Cache], token_ids: list[list[int]], logits_to_keep: list[int]) -> list[torch.Tensor]:
        decoder = self.model.get_decoder()
        text = self.model.config.get_text_config()
        if self.layers is None:
            self.layers, self.rotary = decoder_layers(decoder, text), RotaryTables(decoder, text)
        lengths = [len(ids) for ids in token_ids]
        starts = [cache.get_seq_length() for cache in caches]
        ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        hidden = decoder.embed_tokens(ids).contiguous()
        cos, sin = self.rotary(positions)
        # Room in every session's buffers for this pass (their lengths move only once the pass has succeeded).
        prototype = hidden.new_empty(1, text.num_key_value_heads, 0, decoder.layers[0].self_attn.head_dim)
        keys, values = [], []
        for layer in range(len(self.layers)):
            for cache, start, n in zip(caches, starts, lengths, strict=True):
                buffers = cache.layers[layer]
                if not buffers.is_initialized:
                    buffers.lazy_initialization(prototype, prototype)
                buffers.reserve(prototype, prototype, start + n)
                keys.append(buffers.key_buffer)
                values.append(buffers.value_buffer)
        hidden = self.layers.forward(hidden, cos, sin, keys, values, starts, lengths)
        for cache, start, n in zip(caches, starts, lengths, strict=True):
            for buffers in cache.layers:
                buffers.set_length(start + n)
        ends = torch.tensor(lengths).cumsum(0).tolist()
        keep = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, logits_to_keep, strict=True)])
        offset = architecture_of_decoder(decoder).norm_offset
        last = kernels().rms_norm(hidden[keep].contiguous(), norm_weights(decoder.norm, offset), float(text.rms_norm_eps))
        logits = soft_capped(self.model.get_output_embeddings()(last), getattr(text, "final_logit_softcapping", None))
        return list(logits.split(logits_to_keep))
