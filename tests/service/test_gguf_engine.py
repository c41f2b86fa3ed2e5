"""The gguf engine: kernels on GGUF's own quantized blocks, exact against a float64 reference, bit-identical
whatever the row count or the batch, and lossless speculation on top of them (greedy equality through gRPC, the
exact distribution by chi-square)."""

import asyncio
import ctypes
import functools
import os
import re
import subprocess
import sys
import threading
import time

import gguf
import numpy as np
import pytest
import torch

from specdec.common import memory
from specdec.common.memory import keep_freed_memory
from specdec.common.errors import InvalidArgument, ResourceExhausted
from specdec.common.model_specs import gguf_path
from specdec.common.models import load_model, resolve_engine
from specdec.common.quantized import formats
from specdec.common.quantized.gguf_file import read_tensors
from specdec.common.quantized.kernels import kernels
from specdec.common.quantized.decoder import StackedProducts
from specdec.common.quantized.layers import QuantizedLinear
from specdec.common.sampling import SamplingParams, logits_to_probs
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.kernel_settings import kernel_settings, switched
from tests.support.services import prefilled, running_services
from tests.support.statistics import chi_square_p_value, sample_sequences
from tests.support.generation import generate_ids
from specdec.coordinator.client import build_request

SMOLLM2 = "smollm2-135m"
QWEN = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
# One tensor of every block format the kernels take, from the files the project ships.
TENSORS = [
    (SMOLLM2, "blk.0.ffn_up.weight"),  # Q4_1
    (SMOLLM2, "token_embd.weight"),  # Q8_0 (SmolLM2's tied head)
    ("qwen2.5-coder-1.5b", "blk.0.ffn_gate.weight"),  # Q4_K
    ("qwen2.5-coder-1.5b", "blk.0.ffn_down.weight"),  # Q6_K
    ("qwen2.5-coder-0.5b", "blk.0.ffn_up.weight"),  # Q5_0
]
ROWS = 100  # output features of each tensor: every code path (a partial 16-column tile too), small enough for float64


@functools.cache
def tensors_of(spec: str) -> dict:
    return read_tensors(gguf_path(spec))


def tensor_of(spec: str, name: str):
    return tensors_of(spec)[name]


def packed_slice(spec: str, name: str) -> tuple[formats.PackedWeight, torch.Tensor, gguf.GGMLQuantizationType]:
    t = tensor_of(spec, name)
    k = int(t.shape[0])
    raw = np.asarray(t.data)[:ROWS]
    reference = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).astype(np.float64)).reshape(ROWS, k)
    return formats.pack(raw, t.tensor_type, ROWS, k), reference, t.tensor_type


@pytest.mark.parametrize("spec,name", TENSORS, ids=lambda v: v)
def test_packed_blocks_stand_for_the_files_weights_exactly(spec, name):
    weight, reference, _ = packed_slice(spec, name)
    assert torch.equal(formats.dequantize(weight), reference)


def test_q4_k_codes_are_stored_in_grouped_lane_order_and_the_amx_unpacking_reads_the_files_order_back():
    """Q4_K's codes are permuted at load (formats.Q4_K_GROUPED): lane j of each 32 stored bytes holds group pair j % 4.
    q4k_file_chunks, through which the AMX tiles unpack them (this CPU may have none), gives the file's bytes back."""
    t = tensor_of("qwen2.5-coder-1.5b", "blk.0.ffn_gate.weight")
    k = int(t.shape[0])
    raw = np.asarray(t.data)[:ROWS]
    file_codes = raw.reshape(ROWS, k // 256, 144)[..., 16:].reshape(ROWS, k // 2)
    stored = formats.pack(raw, t.tensor_type, ROWS, k).tensors[0]
    assert not np.array_equal(stored.numpy(), file_codes)  # the test can fail: the order differs from the file's
    # Stored element 8k + j of a superblock is the file's element 8 (j % 4) + 2k + j // 4 (four bytes each).
    elements = stored.numpy().reshape(ROWS, k // 256, 32, 4)
    assert np.array_equal(elements[:, :, 8 * 1 + 5], file_codes.reshape(ROWS, k // 256, 32, 4)[:, :, 8 * 1 + 2 + 1])
    assert np.array_equal(kernels().q4k_file_order(stored).numpy(), file_codes)


@pytest.mark.parametrize("spec,name", TENSORS, ids=lambda v: v)
def test_kernel_matches_a_float64_reference_of_the_dequantised_weights(spec, name):
    weight, reference, _ = packed_slice(spec, name)
    layer = QuantizedLinear(weight)
    x = torch.randn(5, weight.in_features, generator=torch.Generator().manual_seed(0))
    y = layer(x).double()
    # Against the same product on the activations as the kernel quantizes them (int8 per block): float32 rounding.
    block = 256 if weight.kernel in ("q4k", "q6k") else 32
    codes, scales = kernels().quantize_activations(x, block)
    x_quantized = (codes.double().reshape(5, -1, block) * scales.double()[..., None]).reshape(5, -1)
    exact = x_quantized @ reference.T
    assert (y - exact).abs().max() <= 1e-5 * exact.abs().max()
    # Against float activations: what quantizing them costs, about half a percent (llama.cpp's Q8 activations too).
    float_exact = x.double() @ reference.T
    assert (y - float_exact).norm() / float_exact.norm() < 0.02


@pytest.mark.parametrize("block", [32, 256])
def test_activations_quantize_to_the_nearest_code_of_their_blocks_maximum(block):
    """Each block of activations: codes round(x * (127 / amax)) in float32, halves to even, and the scale amax / 127;
    a block of zeros gives zero codes and scale; halves on the codes' grid round to even, as nearbyint does."""
    x = torch.randn(37, 2 * 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 37)[:, None]
    x[1, :block] = 0
    x[2, :block] = torch.arange(block) % 64 - 31.5  # halves, and with amax 127 (below) each code is x itself
    x[2, 0] = -127.0
    codes, scales = kernels().quantize_activations(x, block)
    blocks = x.reshape(37, -1, block)
    amax = blocks.abs().amax(dim=2)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    expected = torch.round(blocks * inverse[..., None]).to(torch.int8).reshape(37, -1)
    assert torch.equal(codes, expected)
    assert torch.equal(scales, amax / 127.0)
    assert not codes[1, :block].any() and scales[1, 0] == 0
    assert codes[2, 1:block].tolist() == [round(v) for v in x[2, 1:block].tolist()]  # Python's round: halves to even
    assert codes[2, 1].item() == -30


MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2: the main arena's statistics in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def test_a_process_running_the_kernels_keeps_freed_memory_for_the_next_pass():
    """Loading the kernels (and starting a worker) raises glibc's mmap and trim thresholds: a freed 256 MB block (a
    long pass's activations) stays in malloc's free bytes for the next layer, where glibc's defaults hand it back to
    the kernel at once."""
    kernels()
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None or not keep_freed_memory():
        pytest.skip("the C library is not a glibc (2.33 or later) that takes these settings")
    mallinfo2.restype = Mallinfo2
    block = torch.ones(256 << 20, dtype=torch.uint8)
    free_before = mallinfo2().fordblks
    del block
    assert mallinfo2().fordblks - free_before >= 256 << 20


def test_the_kernels_compute_without_holding_the_gil():
    """A worker's event loop reads and answers its streams while its compute thread runs a pass: the kernels release
    the GIL. This thread sleeps while a product runs on another; holding the GIL, the product kept it from waking
    until the product returned."""
    weight, _, _ = packed_slice(SMOLLM2, "blk.0.ffn_up.weight")
    layer = QuantizedLinear(weight)
    x = torch.randn(16384, weight.in_features)  # a product of 25-100 ms on 2 cores, by machine
    started = time.perf_counter()
    layer.product(x)
    # This thread's nap: a small part of the product, so that it wakes well before the product's middle on a fast
    # machine too (a fixed 20 ms nap outlasted half of a 25 ms product, and the test failed with the GIL released).
    nap = (time.perf_counter() - started) / 8

    def woke_during_a_product() -> bool:
        span = []
        go = threading.Event()

        def compute():
            go.wait()
            started = time.perf_counter()
            layer.product(x)
            span.extend([started, time.perf_counter()])

        thread = threading.Thread(target=compute)
        thread.start()
        go.set()
        time.sleep(nap)  # the product starts meanwhile (this thread has let go of the GIL)
        woke = time.perf_counter()
        thread.join()
        started, ended = span
        # Held, the GIL lets this thread wake only once the product returns, near its end.
        return started < woke < started + (ended - started) / 2

    # A few tries: on 2 busy cores the product may start after this thread wakes; the GIL stops it every time.
    assert any(woke_during_a_product() for _ in range(5))


def isas_of_this_cpu(numerics: str) -> list[str]:
    """The instruction sets this CPU runs a numerics on: AVX2 always, VNNI where it has it, AMX (totals only)."""
    isas = ["avx2", "vnni", "amx"]
    best = isas.index(kernels().isa()) if kernels().isa() != "amx" else (2 if numerics == "totals" else 1)
    return isas[: best + 1]


@pytest.mark.parametrize("numerics", ["lanes", "totals"])
@pytest.mark.parametrize("spec,name", TENSORS, ids=lambda v: v)
def test_kernel_rows_are_bit_identical_at_every_row_count_and_beside_any_rows(spec, name, numerics):
    weight, _, _ = packed_slice(spec, name)
    layer = QuantizedLinear(weight)
    # Up to 40 rows: the AMX tiles (16 rows and more, where the CPU has them) in pairs of row tiles and alone.
    x = torch.randn(40, weight.in_features, generator=torch.Generator().manual_seed(1))
    with kernel_settings(isas_of_this_cpu(numerics)[-1], numerics):
        alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        for rows in [*range(1, 18), 31, 32, 33, 40]:
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
        order = torch.randperm(40, generator=torch.Generator().manual_seed(2))
        assert torch.equal(layer(x[order]), alone[order])
    # The test can fail: a different row gives a different result.
    assert not torch.equal(alone[0], alone[1])


@pytest.mark.parametrize("spec,name", TENSORS, ids=lambda v: v)
def test_the_prefetch_distance_changes_no_result(spec, name):
    weight, _, _ = packed_slice(spec, name)
    layer, ops = QuantizedLinear(weight), kernels()
    x = torch.randn(5, weight.in_features, generator=torch.Generator().manual_seed(4))
    default = ops.prefetch_distance()
    try:
        results = []
        for distance in (64, default, 1 << 20):  # a line ahead, the default, far past every weight here
            ops.set_prefetch_distance(distance)
            results.append(layer(x))
    finally:
        ops.set_prefetch_distance(default)
    assert all(torch.equal(r, results[1]) for r in results)
    with pytest.raises(RuntimeError, match="positive"):
        ops.set_prefetch_distance(0)


@pytest.mark.parametrize("numerics", ["lanes", "totals"])
def test_products_stacked_into_one_call_equal_their_own_calls_bit_for_bit(numerics):
    """The decoder computes q, k and v (and gate and up) in one kernel call where their formats match: each output
    must be exactly what its own layer computes, at any row count, with the weights held once."""
    qwen = "qwen2.5-coder-1.5b"
    q6k_v = next(n for n, t in tensors_of(qwen).items() if n.endswith("attn_v.weight") and t.tensor_type.name == "Q6_K")
    seeded = torch.Generator().manual_seed(3)
    layers = [
        QuantizedLinear(packed_slice(qwen, name)[0], bias)
        for name, bias in [
            ("blk.0.attn_q.weight", torch.randn(ROWS, generator=seeded)),  # Q4_K, with a bias
            ("blk.0.attn_k.weight", torch.randn(ROWS, generator=seeded)),  # Q4_K, with a bias: stacked with q
            (q6k_v, torch.randn(ROWS, generator=seeded)),  # Q6_K: a call of its own
            ("blk.0.ffn_gate.weight", None),  # Q4_K without a bias: a call of its own
        ]
    ]
    x = torch.randn(33, layers[0].in_features, generator=seeded)
    with kernel_settings(isas_of_this_cpu(numerics)[-1], numerics):
        own = [layer.product(x) for layer in layers]
        products = StackedProducts(layers)
        assert [sizes for _, sizes in products.calls] == [[ROWS, ROWS], [ROWS], [ROWS]]
        for rows in (1, 2, 3, 5, 8, 17, 33):
            stacked = products(x[:rows])
            assert all(torch.equal(s, o[:rows]) for s, o in zip(stacked, own, strict=True)), f"{rows} rows"
        assert torch.equal(layers[1].product(x), own[1])  # the layers still compute alone, on the stacked weights
    stacked_q_k = products.calls[0][0]
    assert layers[0].w0.untyped_storage().data_ptr() == stacked_q_k.w0.untyped_storage().data_ptr(), "held twice"
    assert not torch.equal(own[0], own[1])  # the test can fail: different layers give different outputs


@pytest.mark.parametrize("numerics", ["lanes", "totals"])
@pytest.mark.parametrize("spec,name", TENSORS, ids=lambda v: v)
def test_every_instruction_set_computes_the_same_bits(spec, name, numerics):
    """AVX2, AVX512-VNNI and AMX (those this CPU has) agree bit for bit at every row count in each numerics, so which
    one a machine runs never changes a result."""
    isas = isas_of_this_cpu(numerics)
    if len(isas) == 1:
        pytest.skip("this CPU has AVX2 only: there is nothing to compare")
    weight, _, _ = packed_slice(spec, name)
    layer = QuantizedLinear(weight)
    x = torch.randn(40, weight.in_features, generator=torch.Generator().manual_seed(3))
    results = {}
    for isa in isas:
        with kernel_settings(isa, numerics):
            results[isa] = [layer(x[:rows]) for rows in (1, 2, 3, 11, 16, 17, 40)]
    for isa in isas[1:]:
        for a, b in zip(results["avx2"], results[isa], strict=True):
            assert torch.equal(a, b), isa


def test_the_two_numerics_differ_only_in_float_rounding():
    """Lanes and totals are two orders of the same float sums: their results differ (so the settings take effect), by
    float32 rounding only."""
    weight, _, _ = packed_slice("qwen2.5-coder-1.5b", "blk.0.ffn_gate.weight")
    layer = QuantizedLinear(weight)
    x = torch.randn(5, weight.in_features, generator=torch.Generator().manual_seed(4))
    with kernel_settings("avx2", "lanes"):
        lanes = layer(x)
    with kernel_settings("avx2", "totals"):
        totals = layer(x)
    assert not torch.equal(lanes, totals)
    assert (lanes - totals).abs().max() <= 1e-5 * lanes.abs().max()


def test_the_tensor_index_reads_what_ggufs_own_reader_reads():
    ours = read_tensors(gguf_path(SMOLLM2))
    theirs = gguf.GGUFReader(gguf_path(SMOLLM2)).tensors
    assert list(ours) == [t.name for t in theirs]
    for t in theirs:
        mine = ours[t.name]
        assert (mine.tensor_type, mine.shape) == (t.tensor_type, [int(v) for v in t.shape]), t.name
        assert mine.data.shape == t.data.shape and np.array_equal(mine.data, t.data), t.name


def test_an_unsupported_block_format_is_refused_by_name():
    with pytest.raises(formats.UnsupportedFormat, match="Q5_K"):
        formats.pack(np.zeros((1, 176), np.uint8), gguf.GGMLQuantizationType.Q5_K, 1, 256)


def test_a_matrix_in_a_block_format_the_kernels_lack_is_refused_from_the_tensor_index_naming_it(tmp_path):
    path = tmp_path / "q5_1.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # no tokenizer: refused before any metadata is converted
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))  # lookups only: any format
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("output.weight", gguf.quants.quantize(np.ones((8, 64), np.float32), q8_0), raw_dtype=q8_0)
    blocks = gguf.quants.quantize(np.ones((8, 64), np.float32), gguf.GGMLQuantizationType.Q5_1)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q5_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidArgument, match=r"q5_1\.gguf: blk\.0\.ffn_up\.weight: block format Q5_1"):
        load_model(str(path), engine="gguf")


def test_a_truncated_gguf_file_is_a_clear_error_naming_it(tmp_path):
    broken = tmp_path / "truncated.gguf"
    with open(gguf_path(SMOLLM2), "rb") as source:
        broken.write_bytes(source.read(3 << 20))
    with pytest.raises(InvalidArgument) as error:
        load_model(str(broken), engine="gguf")
    assert "truncated.gguf" in str(error.value)


def test_auto_picks_gguf_for_gguf_models_on_the_cpu_and_torch_otherwise():
    assert resolve_engine("auto", SMOLLM2, "cpu", "auto") == "gguf"
    assert resolve_engine("auto", SMOLLM2 + "#layers=3", "cpu", "auto") == "gguf"
    assert resolve_engine("auto", SMOLLM2 + "#int8", "cpu", "auto") == "torch"
    assert resolve_engine("auto", SMOLLM2, "cpu", "bfloat16") == "torch"
    assert resolve_engine("auto", "tiny-random:vocab=64", "cpu", "auto") == "torch"
    with pytest.raises(InvalidArgument, match="engine"):
        resolve_engine("gguf", "tiny-random:vocab=64", "cpu", "auto")


def test_a_sessions_logits_are_bit_identical_alone_in_any_pass_and_in_any_batch(smollm2):
    runner = smollm2.runner
    prompt, feed = list(range(300, 340)), list(range(500, 516))

    def stepped() -> torch.Tensor:
        cache = prefilled(runner, prompt)
        return torch.stack([runner.forward([cache], [[t]], [1])[0][0] for t in feed])

    steps = stepped()
    # The model's first passes (its layers built) and later ones compute the same bits: the pass is deterministic.
    assert torch.equal(stepped(), steps), "the same prompt and steps gave other logits the second time"
    for k in range(2, 17):
        cache = prefilled(runner, prompt)
        assert torch.equal(runner.forward([cache], [feed[:k]], [k])[0], steps[:k]), f"a pass of {k} tokens"
    others = [prefilled(runner, list(range(10 + 3 * j, 30 + 7 * j))) for j in range(3)]
    cache = prefilled(runner, prompt)
    batch = runner.forward([others[0], cache, others[1], others[2]], [[1, 2], feed[:5], [5], [7] * 12], [2, 5, 1, 12])
    assert torch.equal(batch[1], steps[:5])


@pytest.mark.slow
def test_greedy_speculation_on_the_gguf_engine_equals_target_only(smollm2):
    drafts = [
        DraftEngine(PromptLookupProposer(), "ngram"),
        DraftEngine(ModelProposer(load_model(SMOLLM2 + "#layers=12", engine="gguf")), SMOLLM2 + "#layers=12"),
    ]
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef"

    async def run():
        for draft in drafts:
            async with running_services(TargetEngine(smollm2), draft) as services:
                reference, _ = await generate_ids(services.stub, prompt, gamma=0, max_new_tokens=32)
                for gamma in (1, 3, 6):
                    ids, stats = await generate_ids(services.stub, prompt, gamma, max_new_tokens=32)
                    assert ids == reference, f"{draft.name} gamma={gamma} diverged from target-only"
                    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0 and not stats.fallback_reason

    asyncio.run(run())


def products_of(loaded) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in loaded.model.named_modules() if isinstance(m, QuantizedLinear)}


def test_q4_1_quantization_in_torch_gives_ggufs_own_quantizers_bytes():
    """The #q4_1 variant quantizes in torch over whole matrices: the same codes, scales and minimums as gguf's numpy
    quantizer, on random rows, tiny ones, a group of one value (d = 0) and all zeros."""
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(100, 896, generator=generator), torch.randn(9, 128, generator=generator) * 1e-3, torch.zeros(8, 64)]
    cases[0][3, 32:64] = 0.25
    for weights in cases:
        raw = gguf.quants.quantize(weights.numpy(), gguf.GGMLQuantizationType.Q4_1)
        expected = formats.pack(raw, gguf.GGMLQuantizationType.Q4_1, *weights.shape)
        computed = formats.pack_q41(*formats.quantize_q4_1(weights), *weights.shape)
        assert all(torch.equal(a, b) for a, b in zip(expected.tensors, computed.tensors, strict=True))


@pytest.mark.slow
def test_a_draft_requantized_to_q4_1_streams_fewer_bytes_and_keeps_the_output_target_only():
    """#q4_1: every product layer but Q4_K's in Q4_1, each weight within about half a Q4_1 step of the file's; as a draft
    of its own original, greedy output equal to target-only, with speculation running."""
    target, draft = load_model(QWEN[1], engine="gguf"), load_model(QWEN[1] + "#q4_1", engine="gguf")
    before, after = products_of(target), products_of(draft)
    assert before.keys() == after.keys() and {m.kernel for m in after.values()} == {"q41", "q4k"}
    assert sum(m.packed.nbytes for m in after.values()) < 0.75 * sum(m.packed.nbytes for m in before.values())
    name = next(n for n, m in before.items() if m.kernel == "q80" and m.out_features < 2000)
    original, requantized = formats.dequantize(before[name].packed), formats.dequantize(after[name].packed)
    packed = after[name].packed
    d = formats.untiled(packed.tensors[1], packed.out_features)  # Q4_1: w = d * code + m, per 32 weights
    error = (requantized - original).abs().reshape(*d.shape, 32)
    assert bool((error <= 0.51 * d.double()[..., None]).all())  # half a step, and d's float16 rounding

    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef"

    async def run():
        proposer = DraftEngine(ModelProposer(draft), draft.name)
        async with running_services(TargetEngine(target), proposer) as services:
            reference, _ = await generate_ids(services.stub, prompt, gamma=0, max_new_tokens=24)
            ids, stats = await generate_ids(services.stub, prompt, 3, max_new_tokens=24)
            assert ids == reference
            assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0 and not stats.fallback_reason

    asyncio.run(run())


@pytest.mark.slow
def test_logprobs_are_bit_identical_with_speculation_on_and_off_and_are_the_targets(smollm2):
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a"
    ids = smollm2.tokenizer.encode(prompt)

    def request(gamma: int):
        message = build_request(prompt, max_new_tokens=20, temperature=0, ignore_eos=True, num_speculative_tokens=gamma)
        message.logprobs, message.prompt_logprobs = 5, True
        return message

    async def run():
        target = TargetEngine(smollm2, calibrate=False)  # gamma is fixed: no cost curve needed
        async with running_services(target, DraftEngine(PromptLookupProposer(), "ngram")) as services:
            reference = await services.stub.Generate(request(0))
            assert len(reference.logprobs) == 20 and len(reference.prompt_logprobs) == len(ids) - 1
            for gamma in (2, 6):
                response = await services.stub.Generate(request(gamma))
                assert response.speculation.drafted_tokens > 0 and response.speculation.accepted_tokens > 0
                assert list(response.token_ids) == list(reference.token_ids)
                # Protobuf equality compares the float32 values themselves: bit for bit.
                assert list(response.logprobs) == list(reference.logprobs), f"gamma={gamma}"
                assert list(response.prompt_logprobs) == list(reference.prompt_logprobs)
            return reference

    reference = asyncio.run(run())
    # The target's own distribution, scored one token a step: the first answer token's, and the prompt's last one's.
    runner = smollm2.runner
    row = torch.log_softmax(runner.forward([prefilled(runner, ids[:-1])], [[ids[-1]]], [1])[0][0].float(), dim=-1)
    first = reference.logprobs[0]
    assert (
        first.logprob == float(row[reference.token_ids[0]]) and list(first.top_token_ids) == torch.topk(row, 5).indices.tolist()
    )
    row = torch.log_softmax(runner.forward([prefilled(runner, ids[:-2])], [[ids[-2]]], [1])[0][0].float(), dim=-1)
    assert reference.prompt_logprobs[-1].logprob == float(row[ids[-1]])


def test_n_choices_share_one_prefill_through_the_prefix_cache(smollm2):
    from tests.support.openai_service import in_process_coordinator

    target = TargetEngine(smollm2, calibrate=False)

    async def scenario(client, server):
        prompt = "A list of fruits: apple, banana, cherry, and"
        response = await client.completions.create(
            model=SMOLLM2, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=5, extra_body={"num_speculative_tokens": 0}
        )
        assert len({choice.text for choice in response.choices}) > 1
        # Every choice's session started from the prompt a prefill-only request computed once (all but its last
        # token, which each session scores itself).
        assert response.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1
        assert target.prefixes.hits == 3

    in_process_coordinator(scenario, target_engine=target)


DIST_PROMPT = [1, 504, 3456, 314]  # "<|im_start|>" and three ordinary tokens
DIST_SAMPLES = 600


def exact_two_token_distribution(loaded, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first two tokens), scored the way the worker scores them: the prompt prefilled, then one token a step (a
    verification's rows are bit-identical to those, as tested above)."""
    runner = loaded.runner
    first = logits_to_probs(runner.forward([prefilled(runner, DIST_PROMPT[:-1])], [[DIST_PROMPT[-1]]], [1])[0].float(), params)[0]
    out = {}
    for a in torch.nonzero(first).flatten().tolist():
        cache = prefilled(runner, DIST_PROMPT[:-1])
        runner.forward([cache], [[DIST_PROMPT[-1]]], [1])
        second = logits_to_probs(runner.forward([cache], [[a]], [1])[0].float(), params)[0]
        for b in torch.nonzero(second).flatten().tolist():
            out[(a, b)] = float(first[a] * second[b])
    return out


@pytest.mark.slow
def test_speculative_samples_on_the_gguf_engine_follow_the_exact_target_distribution(smollm2):
    params = SamplingParams(temperature=1.5, top_k=3)
    draft = load_model(SMOLLM2 + "#layers=6", engine="gguf")
    # gamma 2, fixed: every request drafts (sample_sequences runs the coordinator's real loop in one process).
    samples, _, _ = sample_sequences(smollm2, draft, params, gamma=2, tokens=2, samples=DIST_SAMPLES, prompt=DIST_PROMPT)
    exact = exact_two_token_distribution(smollm2, params)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    assert chi_square_p_value(samples, exact) > 1e-3
    # The test can fail: the draft's own distribution is clearly rejected by the same samples (some fall outside
    # its top-k support, or the counts do not fit it).
    wrong = exact_two_token_distribution(draft, params)
    assert any(s not in wrong for s in samples) or chi_square_p_value(samples, wrong) < 1e-6


@pytest.mark.parametrize("engine", ["gguf", "torch"])
def test_a_model_larger_than_the_memory_left_is_refused_at_load_naming_the_file(monkeypatch, engine):
    monkeypatch.setattr(memory, "available_bytes", lambda: 16 << 20)  # 16 MiB left
    with pytest.raises(ResourceExhausted, match=re.escape(os.path.basename(gguf_path(SMOLLM2))) + ".* GiB"):
        load_model(SMOLLM2, engine=engine)


def test_the_memory_left_is_the_least_of_the_machines_and_the_cgroups(monkeypatch, tmp_path):
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    assert memory.available_bytes() == 600000
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's MemAvailable
    assert memory.available_bytes() > 600000


@pytest.mark.parametrize("k", [64, 576, 1536])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0"])
def test_column_tile_kernels_match_the_reference_and_every_row_count_bit_for_bit(qtype, k):
    """Q4_1, Q8_0 and Q5_0 run in tiles of 8 output columns (kernel_columns.h): fused with the weights' unpacking up
    to 4 rows, from an unpacked tile in groups of 4 rows beyond. Fewer than 8 groups of 32 (k = 64), a group count
    that is not a multiple of 8 (576), a partial last tile (37 columns) and prefill row counts: each row's bits are
    its own alone, and the products match the float64 reference."""
    n = 37
    qt = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(np.random.default_rng(5).standard_normal((n, k), dtype=np.float32), qt)
    weight = formats.pack(raw, qt, n, k)
    layer = QuantizedLinear(weight)
    x = torch.randn(131, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(131)])
    for rows in (2, 3, 4, 5, 7, 8, 9, 64, 131):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    order = torch.randperm(131, generator=torch.Generator().manual_seed(7))
    assert torch.equal(layer(x[order]), alone[order])
    codes, scales = kernels().quantize_activations(x, 32)
    x_quantized = (codes.double().reshape(131, -1, 32) * scales.double()[..., None]).reshape(131, -1)
    exact = x_quantized @ formats.dequantize(weight).T
    assert (alone.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_weights_stored_tile_by_tile_stack_select_and_slice_by_whole_rows():
    """Q4_1's, Q8_0's and Q5_0's codes and scales are stored 8 rows to a tile (formats.TILED). Layers whose rows fill whole
    tiles share a call and one of 37 rows computes alone, each with its own bits; rows selected (a vocabulary cut)
    or sliced out stand for the same weights."""
    rng = np.random.default_rng(8)

    def layer(qtype: str, n: int) -> QuantizedLinear:
        qt = gguf.GGMLQuantizationType[qtype]
        return QuantizedLinear(formats.pack(gguf.quants.quantize(rng.standard_normal((n, 64), dtype=np.float32), qt), qt, n, 64))

    for qtype in ("Q4_1", "Q8_0", "Q5_0"):
        layers = [layer(qtype, 40), layer(qtype, 37), layer(qtype, 16)]
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
        own = [one(x) for one in layers]
        whole = [formats.dequantize(one.packed) for one in layers]
        products = StackedProducts(layers)
        assert [sizes for _, sizes in products.calls] == [[40, 16], [37]], qtype
        assert all(torch.equal(a, b) for a, b in zip(products(x), own, strict=True)), qtype
        assert all(torch.equal(formats.dequantize(one.packed), w) for one, w in zip(layers, whole, strict=True))
        stacked = products.calls[0][0].packed
        assert torch.equal(formats.dequantize(formats.rows_of(stacked, 40, 16)), whole[2])
        rows = torch.tensor([36, 0, 9, 8, 17])
        selected = layers[1].select_rows(rows)
        assert torch.equal(formats.dequantize(selected.packed), whole[1][rows])
        assert torch.equal(selected(x), own[1][:, rows])


# Bytes of one superblock of 256 weights, and where its float16 scales (d, then Q4_K's dmin) sit in it.
K_QUANT_BLOCKS = {"Q4_K": (144, slice(0, 4)), "Q6_K": (210, slice(208, 210))}


def random_k_quant(qtype: str, n: int, k: int, seed: int) -> formats.PackedWeight:
    """n x k weights as Q4_K or Q6_K blocks of random codes and sub-block scales (every value the format holds),
    with superblock scales of a real model's size."""
    rng = np.random.default_rng(seed)
    size, halves = K_QUANT_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    count = (halves.stop - halves.start) // 2
    scales = rng.uniform(1e-3, 1e-2, size=(n, k // 256, count)).astype(np.float16)
    blocks[..., halves] = scales.view(np.uint8).reshape(n, k // 256, 2 * count)
    return formats.pack(blocks.reshape(n, -1), gguf.GGMLQuantizationType[qtype], n, k)


def column_tiles(on: bool):
    ops = kernels()
    return switched(ops.column_tiles, ops.set_column_tiles, on)


@pytest.mark.parametrize("k", [256, 2048, 8960])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_avx2_k_quant_tiles_give_the_row_kernels_bits_at_every_row_count(qtype, k):
    """On AVX2, Q4_K and Q6_K run in tiles of 8 output columns in the totals numerics (a step in the stored layout,
    more rows in column tiles, kernel_columns.h; Q4_K's 2-5 and Q6_K's 2-11 rows on the row kernels): one superblock, a superblock
    count that is a multiple of 8 and one that is not (35), a partial last tile (37 columns), every path's row
    counts. Each row's bits are its own alone, the same as the row kernels', and the products match the float64
    reference."""
    n, ops = 37, kernels()
    layer = QuantizedLinear(random_k_quant(qtype, n, k, seed=k))
    fmt = layer.kernel
    x = torch.randn(131, k, generator=torch.Generator().manual_seed(8))
    with kernel_settings("avx2", "totals"):
        with column_tiles(True):
            assert all(ops.product_kernel(fmt, rows) == "avx2 columns" for rows in (1, 4, 5, 131))
            alone = torch.cat([layer(x[i : i + 1]) for i in range(131)])
            for rows in (2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 64, 131):
                assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
            order = torch.randperm(131, generator=torch.Generator().manual_seed(9))
            assert torch.equal(layer(x[order]), alone[order])
        with column_tiles(False):
            assert ops.product_kernel(fmt, 5) == "avx2 rows"
            for rows in (1, 3, 5, 131):
                assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows on the row kernels"
    codes, scales = ops.quantize_activations(x, 256)
    x_quantized = (codes.double().reshape(131, -1, 256) * scales.double()[..., None]).reshape(131, -1)
    exact = x_quantized @ formats.dequantize(layer.packed).T
    assert (alone.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert not torch.equal(alone[0], alone[1])


def kernels_in_a_process(env: dict) -> subprocess.CompletedProcess:
    """A fresh process that loads the kernels under env and prints their instruction set and numerics."""
    code = "from specdec.common.quantized.kernels import kernels; k = kernels(); print(k.isa(), k.numerics())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_specdec_kernel_isa_pins_the_instruction_set_and_its_numerics():
    """SPECDEC_KERNEL_ISA runs the kernels as a machine of that kind would (AVX2: the totals numerics), and a value
    it does not know is refused by the variable's name."""
    env = {**os.environ, "SPECDEC_KERNEL_ISA": "avx2"}
    pinned = kernels_in_a_process(env)
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == ["avx2", "totals"]
    env["SPECDEC_KERNEL_ISA"] = "sse2"
    refused = kernels_in_a_process(env)
    assert refused.returncode != 0 and "SPECDEC_KERNEL_ISA must be one of avx2, vnni, amx, not 'sse2'" in refused.stderr


def test_specdec_kernel_numerics_pins_the_numerics_on_this_cpus_own_instruction_set():
    """SPECDEC_KERNEL_NUMERICS computes in the numerics it names on this CPU's own kernels (lanes with AMX only
    beside SPECDEC_KERNEL_ISA=vnni), and a value it does not know is refused by the variable's name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_KERNEL_")}
    own = kernels_in_a_process(env)
    assert own.returncode == 0, own.stderr
    isa, numerics = own.stdout.split()
    assert numerics == ("lanes" if isa == "vnni" else "totals")
    other = "totals" if numerics == "lanes" else "lanes"
    env["SPECDEC_KERNEL_NUMERICS"] = other
    if isa == "amx":
        refused = kernels_in_a_process(env)
        assert refused.returncode != 0 and "AMX computes in totals; set SPECDEC_KERNEL_ISA=vnni" in refused.stderr
        env["SPECDEC_KERNEL_ISA"] = isa = "vnni"
    pinned = kernels_in_a_process(env)
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == [isa, other]
    env["SPECDEC_KERNEL_NUMERICS"] = "exact"
    refused = kernels_in_a_process(env)
    assert refused.returncode != 0 and "SPECDEC_KERNEL_NUMERICS must be one of lanes, totals, not 'exact'" in refused.stderr


def assert_the_avx2_tiles_bits_and_each_rows_own(layer, x, results: dict, alone: torch.Tensor) -> None:
    """Each pass's result (results[rows], over x[:rows]) is what the AVX2 column tiles compute for it, in totals,
    and each of its rows is that row's result alone."""
    with kernel_settings("avx2", "totals"):
        for rows, result in results.items():
            assert torch.equal(result, layer(x[:rows])), f"{rows} rows"
    for rows, result in results.items():
        assert torch.equal(result, alone[:rows]), f"{rows} rows"


def test_on_vnni_without_amx_in_totals_q4_k_passes_of_12_rows_or_more_run_on_column_tiles_with_the_same_bits():
    """A VNNI machine without AMX in totals (SPECDEC_KERNEL_NUMERICS) keeps Q4_K's passes of up to 11 rows on its
    row kernels and runs more on the VNNI column tiles: each row's bits are the AVX2 tiles' and its own alone."""
    ops = kernels()
    if "vnni" not in isas_of_this_cpu("totals"):
        pytest.skip("this CPU lacks AVX512-VNNI")
    layer = QuantizedLinear(random_k_quant("Q4_K", 37, 2048, seed=12))
    x = torch.randn(20, 2048, generator=torch.Generator().manual_seed(13))
    with kernel_settings("vnni", "totals"):
        assert [ops.product_kernel("q4k", rows) for rows in (1, 2, 11, 12, 20)] == ["vnni rows"] * 3 + ["vnni columns"] * 2
        alone = torch.cat([layer(x[i : i + 1]) for i in range(20)])
        results = {rows: layer(x[:rows]) for rows in (2, 11, 12, 13, 16, 20)}
    assert_the_avx2_tiles_bits_and_each_rows_own(layer, x, results, alone)


def wide_columns(on: bool):
    """Q4_K's fused column tiles on 512-bit vectors for every matrix, or for none."""
    ops = kernels()
    return switched(ops.wide_columns_from, ops.set_wide_columns_from, 0 if on else 2**62)


@pytest.mark.skipif(kernels().isa() == "avx2", reason="this CPU lacks AVX512-VNNI")
@pytest.mark.parametrize("wide", [True, False], ids=["512-bit", "256-bit"])
@pytest.mark.parametrize("k, n", [(256, 37), (2048, 45), (8960, 37)])
def test_q4_k_vnni_column_tiles_fused_and_unpacked_give_the_row_kernels_bits(k, n, wide):
    """The VNNI column tiles of Q4_K, which machines with AMX run from 5 rows in totals (fused with the codes'
    unpacking up to two row tiles of 8, in groups of nearly equal sizes, on 256-bit vectors a tile at a time; from an
    unpacked tile beyond; on 512-bit vectors two tiles side by side, up to 4 row tiles from one transposition), on
    any VNNI machine: every row count gives
    each row its bits alone (a row kernel's), the AVX2 kernels' and the float64 reference's product. 37 columns
    leave a tile without a pair (computed as both of it), 45 a pair whose second tile is partial."""
    ops = kernels()
    layer = QuantizedLinear(random_k_quant("Q4_K", n, k, seed=k + 1))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(13))
    with kernel_settings("avx2", "totals"):
        avx2 = layer(x)
    with kernel_settings("vnni", "totals"), wide_columns(wide):
        try:
            ops.set_vnni_column_rows(2)
            assert [ops.product_kernel("q4k", rows) for rows in (1, 2, 8, 9)] == ["vnni rows"] + ["vnni columns"] * 3
            alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
            for rows in (2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 25, 32, 33, 40):
                assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
        finally:
            ops.set_vnni_column_rows(0)
    assert torch.equal(alone, avx2)
    codes, scales = ops.quantize_activations(x, 256)
    x_quantized = (codes.double().reshape(40, -1, 256) * scales.double()[..., None]).reshape(40, -1)
    exact = x_quantized @ formats.dequantize(layer.packed).T
    assert (alone.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert not torch.equal(alone[0], alone[1])


def test_with_amx_q4_k_passes_below_the_tiles_run_on_vnni_column_tiles_with_the_same_bits():
    """Where AMX runs the totals numerics, Q4_K's passes of 2-4 rows go to the VNNI row kernels (3-4 rows in the
    pairs form, 2 output columns at a time) and of 5-24 rows to the column tiles in their VNNI form (dpbusd; on
    512-bit vectors for large matrices), from 25 rows to AMX's tiles (Q6_K's from 16): each row's bits are the AVX2
    tiles' and its own alone."""
    ops = kernels()
    if ops.isa() != "amx":
        pytest.skip("this CPU gives no AMX tiles")
    layer = QuantizedLinear(random_k_quant("Q4_K", 37, 8960, seed=10))
    x = torch.randn(29, 8960, generator=torch.Generator().manual_seed(11))
    assert [ops.product_kernel("q4k", rows) for rows in (1, 4, 5, 24, 25)] == ["vnni rows"] * 2 + ["vnni columns"] * 2 + ["amx"]
    assert [ops.product_kernel("q6k", rows) for rows in (15, 16)] == ["vnni rows", "amx"]
    alone = torch.cat([layer(x[i : i + 1]) for i in range(29)])
    results = {rows: layer(x[:rows]) for rows in (2, 3, 4, 5, 6, 8, 9, 15, 16, 17, 20, 24, 25, 29)}
    assert_the_avx2_tiles_bits_and_each_rows_own(layer, x, results, alone)
    with wide_columns(True):  # a matrix this small runs on 256-bit vectors by default
        for rows in (5, 9, 16, 17, 24):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows on 512-bit vectors"
