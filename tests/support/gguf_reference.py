"""A float64 forward pass of a gguf-engine model, written from each architecture's definition (transformers' modeling
files) on the de-quantised weights: the reference the engine's logits are checked against, for every row of
common/quantized/architectures.py."""

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from specdec.common.quantized import formats
from specdec.common.quantized.architectures import architecture_of
from specdec.common.quantized.layers import QuantizedLinear


def weights(linear: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if linear.bias is None else linear.bias.double()
    return formats.dequantize(linear.packed), bias


def product(x: torch.Tensor, linear: QuantizedLinear) -> torch.Tensor:
    w, b = weights(linear)
    y = x @ w.T
    return y if b is None else y + b


def rms(x: torch.Tensor, norm: torch.nn.Module, offset: float, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (norm.weight.double() + offset)


def embeddings(embedding, ids: list[int]) -> torch.Tensor:
    rows = embedding.blocks[torch.tensor(ids)].numpy()
    values = rows.view(np.float32) if embedding.qtype == GGMLQuantizationType.F32 else quants.dequantize(rows, embedding.qtype)
    x = torch.from_numpy(np.asarray(values, dtype=np.float64).reshape(len(ids), -1))
    return x if embedding.scale is None else x * float(embedding.scale)


def rotate(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, heads, dim] rotated by transformers' rotate_half convention."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def inverse_frequencies(rotary: torch.nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float]:
    if layer_type is None:
        return rotary.inv_freq, float(rotary.attention_scaling)
    return getattr(rotary, f"{layer_type}_inv_freq"), float(getattr(rotary, f"{layer_type}_attention_scaling"))


def float64_logits(model: torch.nn.Module, ids: list[int], head_rows: torch.Tensor, window_off: bool = False) -> torch.Tensor:
    """Logits [len(ids), len(head_rows)] of the vocabulary rows head_rows, every position (no cache).
    window_off: every layer attends to all positions (to show that a test depends on the window)."""
    decoder, text = model.get_decoder(), model.config.get_text_config()
    architecture = architecture_of(text.model_type)
    offset, eps = architecture.norm_offset, float(text.rms_norm_eps)
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    n = len(ids)
    positions = torch.arange(n)
    x = embeddings(decoder.embed_tokens, ids)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * len(decoder.layers)
    for index, layer in enumerate(decoder.layers):
        attention, mlp = layer.self_attn, layer.mlp
        dim = attention.head_dim
        h = rms(x, layer.input_layernorm, offset, eps)
        q = product(h, attention.q_proj).reshape(n, heads, dim)
        k = product(h, attention.k_proj).reshape(n, kv_heads, dim)
        v = product(h, attention.v_proj).reshape(n, kv_heads, dim)
        if getattr(attention, "q_norm", None) is not None:
            q, k = rms(q, attention.q_norm, offset, eps), rms(k, attention.k_norm, offset, eps)
        inv_freq, scaling = inverse_frequencies(
            decoder.rotary_emb, layer_types[index] if architecture.rope_by_layer_type else None
        )
        q, k = rotate(q, inv_freq, positions) * scaling, rotate(k, inv_freq, positions) * scaling
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * attention.scaling
        cap = getattr(text, "attn_logit_softcapping", None)
        if cap:
            scores = cap * torch.tanh(scores / cap)
        visible = positions[None, :] <= positions[:, None]
        if layer_types[index] == "sliding_attention" and not window_off:
            visible &= positions[None, :] > positions[:, None] - text.sliding_window
        scores = scores.masked_fill(~visible, -torch.inf).softmax(-1)
        attended = product(torch.einsum("hqk,khd->qhd", scores, v).reshape(n, heads * dim), attention.o_proj)
        if architecture.sandwich_norms:
            attended = rms(attended, layer.post_attention_layernorm, offset, eps)
        x = x + attended
        h = rms(
            x, layer.pre_feedforward_layernorm if architecture.sandwich_norms else layer.post_attention_layernorm, offset, eps
        )
        gate = product(h, mlp.gate_proj)
        gate = torch.nn.functional.gelu(gate, approximate="tanh") if architecture.gelu else torch.nn.functional.silu(gate)
        out = product(gate * product(h, mlp.up_proj), mlp.down_proj)
        if architecture.sandwich_norms:
            out = rms(out, layer.post_feedforward_layernorm, offset, eps)
        x = x + out
    x = rms(x, decoder.norm, offset, eps)
    logits = product(x, model.get_output_embeddings().select_rows(head_rows))
    cap = getattr(text, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits
