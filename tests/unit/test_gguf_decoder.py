"""The gguf engine's own decoder pass (common/quantized/decoder.py and decoder_ops.h): each piece against torch's
reference of the same function, and the whole pass against transformers' forward over the same blocks."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from specdec.common.batched_forward import forward_sessions
from specdec.common.models import load_model
from specdec.common.quantized.decoder import ROPE_BLOCK, RotaryTables, StackedProducts
from specdec.common.quantized.kernels import kernels
from tests.support.kernel_settings import kernel_settings, switched

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


def recorded_rotary(decoder) -> list[list[int]]:
    """The positions of every call of the decoder's rotary embedding, from now on."""
    calls, forward = [], decoder.rotary_emb.forward

    def recording(x, position_ids, *by_type):
        calls.append(position_ids[0].tolist())
        return forward(x, position_ids, *by_type)

    decoder.rotary_emb.forward = recording
    return calls


def test_a_positions_cos_and_sin_are_computed_once_in_a_call_of_their_own_and_read_alike_in_any_pass():
    """The pass takes cos and sin from kept tables, where transformers' rotary embedding computed each position's
    once, in a call of its own (a table grows by ROPE_BLOCK positions): a position's values are the same bits alone
    and in a pass of any length, whatever torch's thread count (torch's cos and sin are MKL's on x86, which need not
    give an element the same bits in calls of different lengths), and they are transformers' own."""
    model = load_model(SMOLLM2 + "#layers=1", engine="gguf").model
    decoder, text = model.get_decoder(), model.config.get_text_config()
    positions = torch.tensor([3, ROPE_BLOCK - 1, ROPE_BLOCK, ROPE_BLOCK + 40])
    direct_cos, direct_sin = (t[0] for t in decoder.rotary_emb(torch.empty(1, 4, 1), positions[None]))
    calls = recorded_rotary(decoder)
    tables = RotaryTables(decoder, text)
    alone = [tables(positions[i : i + 1]) for i in range(4)]
    (cos,), (sin,) = tables(positions)
    assert calls == [[p] for p in range(2 * ROPE_BLOCK)]
    for i, ((cos_alone,), (sin_alone,)) in enumerate(alone):
        assert torch.equal(cos_alone[0], cos[i]) and torch.equal(sin_alone[0], sin[i]), f"position {positions[i]}"
    assert torch.allclose(cos, direct_cos, rtol=0, atol=1e-6) and torch.allclose(sin, direct_sin, rtol=0, atol=1e-6)
    assert not torch.equal(cos[0], cos[1])
    (none,), _ = tables(torch.tensor([], dtype=torch.long))
    assert none.shape == (0, cos.shape[1])


def test_rotary_frequencies_that_move_with_the_pass_are_computed_for_each_pass():
    """transformers' dynamic and longrope types recompute the frequencies from a pass's positions: such cos and sin
    belong to the pass, and are not kept."""
    model = load_model(SMOLLM2 + "#layers=1", engine="gguf").model
    decoder, text = model.get_decoder(), model.config.get_text_config()
    decoder.rotary_emb.rope_type = "dynamic"
    calls = recorded_rotary(decoder)
    tables = RotaryTables(decoder, text)
    tables(torch.tensor([5, 6]))
    tables(torch.tensor([7]))
    assert calls == [[5, 6], [7]]


def test_attention_over_several_sessions_matches_causal_sdpa_on_each_and_appends_their_keys():
    heads, kv_heads, dim = 6, 2, 64
    starts, lengths = [0, 37, 5], [9, 1, 4]
    caches = [
        (torch.randn(1, kv_heads, s + n + 3, dim), torch.randn(1, kv_heads, s + n + 3, dim))
        for s, n in zip(starts, lengths, strict=True)
    ]
    rows = sum(lengths)
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    out = kernels().attend_sessions(q, k, v, [c[0] for c in caches], [c[1] for c in caches], starts, lengths, dim**-0.5, 0, 0.0)
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


@pytest.mark.parametrize("dim", [64, 72, 128, 256])
def test_a_query_rows_attention_is_bit_identical_in_a_pass_of_any_length_and_matches_sdpa(dim):
    """One head at a time in a step, a key-value group's heads together in a pass of a few rows, and blocks of 8
    rows over blocks of 32 positions in a long pass (with what is left of either) give every row the bits it gets
    alone as a one-token step at its position: a prefill of 80 rows, one row at a time, and rows beside another
    session all agree; the context lengths 1..80 cross every block's edges."""
    heads, kv_heads, rows = 4, 2, 80
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)

    def cache():
        return torch.zeros(1, kv_heads, rows, dim), torch.zeros(1, kv_heads, rows, dim)

    keys, values = cache()
    prefill = kernels().attend_sessions(q, k, v, [keys], [values], [0], [rows], dim**-0.5, 0, 0.0)
    keys, values = cache()
    steps = torch.cat(
        [
            kernels().attend_sessions(q[i : i + 1], k[i : i + 1], v[i : i + 1], [keys], [values], [i], [1], dim**-0.5, 0, 0.0)
            for i in range(rows)
        ]
    )
    assert torch.equal(prefill, steps)
    (keys, values), (other_keys, other_values) = cache(), cache()
    beside = kernels().attend_sessions(
        torch.cat([q[:7], q[:20]]),
        torch.cat([k[:7], k[:20]]),
        torch.cat([v[:7], v[:20]]),
        [other_keys, keys],
        [other_values, values],
        [0, 0],
        [7, 20],
        dim**-0.5,
        0,
        0.0,
    )
    assert torch.equal(beside[7:], prefill[:20])
    mask = torch.arange(rows)[None, :] <= torch.arange(rows)[:, None]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(),
        k.transpose(0, 1)[None].double(),
        v.transpose(0, 1)[None].double(),
        attn_mask=mask,
        scale=dim**-0.5,
        enable_gqa=True,
    )
    assert torch.allclose(prefill.double(), expected[0].transpose(0, 1).reshape(rows, heads * dim), atol=2e-6)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_attention_on_512_bit_registers_gives_the_bits_of_256_bit_ones(dim):
    """On an AVX-512 machine a pass's attention runs two 8-lane chains a register (attention_avx512.h); every row's
    bits equal those of the AVX2 kernels: long passes in blocks of 8 rows (chunks of 1-8 heads, keys left over from
    groups of 4), a few rows, one-row steps, several sessions, a sliding window and soft-capped scores. On 2
    threads, which decide how a call splits into blocks."""
    ops = kernels()
    if ops.isa() == "avx2":
        pytest.skip("this CPU has no AVX-512: its attention runs on 256-bit registers only")
    generator = torch.Generator().manual_seed(dim)
    heads, kv_heads = 6, 2
    # rows, each session's cached positions and new rows, window, soft cap
    cases = [
        (70, [0], [70], 0, 0.0),
        (5, [33], [5], 0, 0.0),
        (1, [41], [1], 0, 0.0),
        (50, [0, 9], [23, 27], 0, 0.0),
        (40, [3], [40], 16, 30.0),
    ]
    for rows, starts, lengths, window, softcap in cases:
        q, k, v = (torch.randn(rows, n, dim, generator=generator) for n in (heads, kv_heads, kv_heads))
        sizes = [start + length for start, length in zip(starts, lengths, strict=True)]
        buffers = [torch.randn(2, 1, kv_heads, size, dim, generator=generator) for size in sizes]

        def attend(q=q, k=k, v=v, buffers=buffers, starts=starts, lengths=lengths, window=window, softcap=softcap):
            keys, values = [b[0].clone() for b in buffers], [b[1].clone() for b in buffers]
            return ops.attend_sessions(q, k, v, keys, values, starts, lengths, dim**-0.5, window, softcap)

        with switched(torch.get_num_threads, torch.set_num_threads, 2):  # the kernels' parallel_for too
            wide = attend()
            with kernel_settings("avx2", ops.numerics()):
                narrow = attend()
        assert torch.equal(wide, narrow), (rows, starts, lengths, window, softcap)


def test_sliding_window_attention_with_soft_capped_scores_matches_its_definition_on_each_session():
    """A sliding-window layer's row at position p sees positions p - window + 1 .. p (transformers' sliding window
    mask), its scores soft-capped (cap * tanh(score / cap)) before the softmax; sessions start before and past the
    window."""
    heads, kv_heads, dim, window, cap = 4, 1, 256, 6, 3.0
    starts, lengths = [0, 9, 3], [9, 3, 1]
    caches = [
        (torch.randn(1, kv_heads, s + n, dim, dtype=torch.float64), torch.randn(1, kv_heads, s + n, dim, dtype=torch.float64))
        for s, n in zip(starts, lengths, strict=True)
    ]
    rows = sum(lengths)
    q, k, v = (torch.randn(rows, h, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    out = kernels().attend_sessions(
        q.float(),
        k.float(),
        v.float(),
        [c[0].float() for c in caches],
        [c[1].float() for c in caches],
        starts,
        lengths,
        dim**-0.5,
        window,
        cap,
    )
    full = kernels().attend_sessions(
        q.float(),
        k.float(),
        v.float(),
        [c[0].float() for c in caches],
        [c[1].float() for c in caches],
        starts,
        lengths,
        dim**-0.5,
        0,
        0.0,
    )
    row = 0
    for (keys, values), start, n in zip(caches, starts, lengths, strict=True):
        keys[0, :, start : start + n], values[0, :, start : start + n] = (
            k[row : row + n].transpose(0, 1),
            v[row : row + n].transpose(0, 1),
        )
        positions = torch.arange(start, start + n)[:, None]
        seen = torch.arange(start + n)[None, :]
        visible = (seen <= positions) & (seen > positions - window)
        scores = torch.einsum("qhd,hkd->hqk", q[row : row + n], keys[0].expand(heads, -1, -1)) * dim**-0.5
        weights = (cap * torch.tanh(scores / cap)).masked_fill(~visible, -torch.inf).softmax(-1)
        expected = torch.einsum("hqk,hkd->qhd", weights, values[0].expand(heads, -1, -1)).reshape(n, heads * dim)
        assert torch.allclose(out[row : row + n].double(), expected, atol=1e-5)
        row += n
    # The test can fail: rows past the window see fewer positions than full attention does.
    assert not torch.allclose(out[8:12], full[8:12], atol=1e-3)


def test_attention_refuses_buffers_that_cannot_hold_the_pass():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    small = torch.zeros(1, 1, 3, 64)
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels().attend_sessions(q, k, k, [small], [small], [0], [4], 0.125, 0, 0.0)


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


def stacked_products(model) -> list[tuple[StackedProducts, StackedProducts]]:
    """Each layer's (q, k, v) and (gate, up) products, stacked once."""
    return [
        (
            StackedProducts([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
            StackedProducts([layer.mlp.gate_proj, layer.mlp.up_proj]),
        )
        for layer in model.get_decoder().layers
    ]


def python_loop_pass(model, products, caches, token_ids, logits_to_keep) -> list[torch.Tensor]:
    """The pass with its layer loop in Python, one kernel call per op, as decoder.py ran it before the loop moved into
    C++ (decoder_layers.h): the same functions in the same order, so the C++ loop must match it bit for bit."""
    ops, decoder = kernels(), model.get_decoder()
    text = model.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    lengths = [len(ids) for ids in token_ids]
    starts = [cache.get_seq_length() for cache in caches]
    rows = sum(lengths)
    ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    hidden = decoder.embed_tokens(ids).contiguous()
    (cos,), (sin,) = RotaryTables(decoder, text)(positions)
    for index, (layer, (qkv, gate_up)) in enumerate(zip(decoder.layers, products, strict=True)):
        attention, mlp = layer.self_attn, layer.mlp
        prototype = hidden.new_empty(1, kv_heads, 0, attention.head_dim)
        buffers = [cache.layers[index] for cache in caches]
        for cache_layer, start, n in zip(buffers, starts, lengths, strict=True):
            if not cache_layer.is_initialized:
                cache_layer.lazy_initialization(prototype, prototype)
            cache_layer.reserve(prototype, prototype, start + n)
        norm = layer.input_layernorm
        h = ops.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        q, k, v = qkv(h)
        q = q.contiguous().view(rows, heads, attention.head_dim)
        k = k.contiguous().view(rows, kv_heads, attention.head_dim)
        v = v.contiguous().view(rows, kv_heads, attention.head_dim)
        ops.rotary(q, cos, sin)
        ops.rotary(k, cos, sin)
        keys, values = [b.key_buffer for b in buffers], [b.value_buffer for b in buffers]
        hidden += attention.o_proj.product(ops.attend_sessions(q, k, v, keys, values, starts, lengths, attention.scaling, 0, 0.0))
        norm = layer.post_attention_layernorm
        h = ops.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        gate, up = gate_up(h)
        hidden += mlp.down_proj.product(F.silu(gate).mul_(up))
    for cache, start, n in zip(caches, starts, lengths, strict=True):
        for cache_layer in cache.layers:
            cache_layer.set_length(start + n)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    keep = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, logits_to_keep, strict=True)])
    last = ops.rms_norm(hidden[keep].contiguous(), decoder.norm.weight, decoder.norm.variance_epsilon)
    return list(model.get_output_embeddings()(last).split(logits_to_keep))


@pytest.mark.parametrize("spec", [SMOLLM2, "qwen2.5-coder-0.5b#layers=4"])
def test_the_layers_in_one_cpp_call_equal_the_loop_of_kernel_calls_bit_for_bit(spec):
    """Several sessions at once (a prefill, a verification, a one-token step), then a step each: every logits row of
    the C++ layer loop equals the Python loop's, and so do the caches they leave. The Qwen layers have biases and
    a v product in another format than q and k."""
    loaded = load_model(spec, engine="gguf")
    runner = loaded.runner
    with torch.inference_mode():
        passes = [
            ([list(range(300, 340)), list(range(500, 520)), [7, 8, 9]], [40, 3, 1]),
            ([[11, 12, 13, 14], [21], [31, 32]], [4, 1, 2]),
            ([[15], [22], [33]], [1, 1, 1]),
        ]
        results = []
        products = stacked_products(loaded.model)
        for forward in (runner.forward, lambda *a: python_loop_pass(loaded.model, products, *a)):
            caches = [runner.new_cache() for _ in range(3)]
            logits = [row for ids, keep in passes for row in forward(caches, ids, keep)]
            results.append((logits, caches))
    (ours, our_caches), (reference, reference_caches) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    for mine, theirs in zip(our_caches, reference_caches, strict=True):
        assert mine.get_seq_length() == theirs.get_seq_length() > 0
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not torch.equal(ours[0][-1], ours[1][-1])  # the test can fail: different sessions give different rows
