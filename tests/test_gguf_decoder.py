"""The gguf engine's own decoder pass (common/quantized/decoder.py and decoder_ops.h): each piece against torch's
reference of the same function, and the whole pass against transformers' forward over the same blocks."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from common.batched_forward import forward_sessions
from common.models import load_model
from common.quantized.kernels import kernels

SMOLLM2 = "smollm2-135m"


def test_rms_norm_matches_its_definition():
    x, w = torch.randn(5, 576, dtype=torch.float64) * 3, torch.rand(576, dtype=torch.float64) + 0.5
    reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(kernels().rms_norm(x.float(), w.float(), 1e-5).double(), reference, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_matches_transformers():
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    angles = torch.arange(6.0)[:, None] * 0.37 ** torch.arange(32.0)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ours_q, ours_k = q.clone(), k.clone()
    kernels().rotary(ours_q, cos, sin)
    kernels().rotary(ours_k, cos, sin)
    assert torch.allclose(ours_q, expected_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ours_k, expected_k[0].transpose(0, 1), atol=1e-6)


def test_attention_over_several_sessions_matches_causal_sdpa_on_each_and_appends_their_keys():
    heads, kv_heads, dim = 6, 2, 64
    starts, lengths = [0, 37, 5], [9, 1, 4]
    caches = [
        (torch.randn(1, kv_heads, s + n + 3, dim), torch.randn(1, kv_heads, s + n + 3, dim))
        for s, n in zip(starts, lengths, strict=True)
    ]
    rows = sum(lengths)
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    out = kernels().attend_sessions(q, k, v, [c[0] for c in caches], [c[1] for c in caches], starts, lengths, dim**-0.5)
    row = 0
    for (keys, values), start, n in zip(caches, starts, lengths, strict=True):
        assert torch.equal(keys[0, :, start : start + n], k[row : row + n].transpose(0, 1))
        assert torch.equal(values[0, :, start : start + n], v[row : row + n].transpose(0, 1))
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        expected = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1)[None],
            keys[:, :, : start + n],
            values[:, :, : start + n],
            attn_mask=mask,
            scale=dim**-0.5,
            enable_gqa=True,
        )
        assert torch.allclose(out[row : row + n], expected[0].transpose(0, 1).reshape(n, heads * dim), atol=2e-6)
        row += n


def test_attention_refuses_buffers_that_cannot_hold_the_pass():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    small = torch.zeros(1, 1, 3, 64)
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels().attend_sessions(q, k, k, [small], [small], [0], [4], 0.125)


@pytest.mark.slow
def test_the_pass_scores_as_transformers_forward_on_the_same_blocks():
    """Quantized activations turn any change of float rounding into a different rounding of some int8 codes, so two
    correct passes differ by about as much as each differs from the float32 model: the check is that ours is no
    farther from the de-quantised float32 model than transformers' forward over the same blocks, and picks the
    same tokens as often."""
    quantized = load_model(SMOLLM2, engine="gguf")
    prompt = list(range(400, 460))

    def logits(forward, new_cache):
        cache = new_cache()
        prefill = forward([cache], [prompt[:40]], [40])[0]
        steps = [forward([cache], [[t]], [1])[0] for t in prompt[40:]]
        return torch.cat([prefill, *steps]).float()

    def transformers_logits(loaded):  # transformers' forward over the model's layers
        return logits(lambda *a: forward_sessions(loaded.model, *a), loaded.runner.new_cache)

    ours = logits(quantized.runner.forward, quantized.runner.new_cache)
    theirs = transformers_logits(quantized)
    reference = transformers_logits(load_model(SMOLLM2, engine="torch"))
    distance = lambda a: (a - reference).abs().amax(-1).median()  # noqa: E731
    agreement = lambda a: (a.argmax(-1) == reference.argmax(-1)).float().mean()  # noqa: E731
    assert not torch.equal(ours, theirs)  # the test can fail: these are two different computations
    assert distance(ours) <= 1.25 * distance(theirs)
    assert agreement(ours) >= agreement(theirs) - 0.05
