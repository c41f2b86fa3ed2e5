"""Qwen3 and Llama 3 on the gguf engine. No weights of these ship offline: each test writes a small GGUF file as
llama.cpp's converter lays it out (its tensor names, llama's permuted q and k rows, Llama 3's RoPE scaling as
rope_freqs.weight) from random weights in the real models' ratios, quantized with the gguf package, and checks the
engine against transformers' own model on the de-quantised weights and against the float64 reference: the logits,
greedy output, and rows bit-identical in any pass and batch."""

import asyncio
import os
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3Config

from specdec.common.loaded_model import LoadedModel
from specdec.common.quantized.decoder import GgufRunner
from specdec.common.models import apply_file_rope_factors
from specdec.common.quantized.loader import build_quantized_model
from specdec.common.tokenizer import ByteTokenizer
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.services import running_services
from tests.support.gguf_reference import float64_logits
from tests.support.generation import generate_ids

VOCAB = 512
# The real models' ratios at a small width: Qwen3-0.6B (16 heads of 128 over 8 kv heads, q wider than the hidden
# size, QK-norm) and Llama 3.2-1B (32 heads of 64 over 8 kv heads, RoPE base 500,000, llama3 scaling x32).
CONFIGS = {
    "qwen3": Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    "llama": LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
# Block formats of the products (Q4_K and Q6_K have no quantizer in the gguf package; the real files' tensors of those
# formats are tested in test_gguf_engine.py).
FORMATS = {
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q5_0,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q4_1,
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
}
HF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of a llama q or k projection (convert_hf_to_gguf's LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def quantized(weights: np.ndarray, qtype) -> tuple[np.ndarray, torch.Tensor]:
    """(the blocks, the weights they stand for)."""
    blocks = quants.quantize(weights, qtype)
    return blocks, torch.from_numpy(quants.dequantize(blocks, qtype).reshape(weights.shape).copy())


def write_gguf(path, architecture: str, config, model) -> None:
    """The model's weights as llama.cpp's converter writes them; model's own weights become the de-quantised ones."""
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    decoder = model.get_decoder()
    for i, layer in enumerate(decoder.layers):
        for gguf_name, module_path in HF_LINEARS.items():
            heads = None
            if architecture == "llama" and gguf_name in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if gguf_name == "attn_q" else config.num_key_value_heads
            module = layer.get_submodule(module_path)
            # Blocks hold whole rows, so permuting rows and quantizing commute: the file holds the permuted rows of
            # the blocks whose weights transformers' model gets in its own order.
            blocks, module.weight.data = quantized(module.weight.detach().float().numpy(), FORMATS[gguf_name])
            writer.add_tensor(
                f"blk.{i}.{gguf_name}.weight", permute(blocks, heads) if heads else blocks, raw_dtype=FORMATS[gguf_name]
            )
        for gguf_name, module_path in HF_NORMS.items():
            if gguf_name in ("attn_q_norm", "attn_k_norm") and architecture != "qwen3":
                continue
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", layer.get_submodule(module_path).weight.detach().float().numpy())
    writer.add_tensor("output_norm.weight", decoder.norm.weight.detach().float().numpy())
    blocks, decoder.embed_tokens.weight.data = quantized(
        decoder.embed_tokens.weight.detach().float().numpy(), FORMATS["token_embd"]
    )
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=FORMATS["token_embd"])
    if not config.tie_word_embeddings:
        head = model.get_output_embeddings()
        blocks, head.weight.data = quantized(head.weight.detach().float().numpy(), FORMATS["output"])
        writer.add_tensor("output.weight", blocks, raw_dtype=FORMATS["output"])
    rotary = decoder.rotary_emb
    if rotary.rope_type == "llama3":  # llama.cpp writes the scaling as a divisor per frequency
        default = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        writer.add_tensor("rope_freqs.weight", (default / rotary.inv_freq).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(the gguf engine's model of a written file, transformers' model on its de-quantised weights)."""
    architecture, config = request.param, CONFIGS[request.param]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1, so that a norm applied wrongly shows
        for name, parameter in reference.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(architecture) / f"{architecture}.gguf"
    write_gguf(path, architecture, config, reference)
    assert AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).model_type == architecture
    return engine_model(path), reference


def engine_model(path) -> LoadedModel:
    """The gguf engine's model of a written file, with a byte-level tokenizer (the file holds no vocabulary)."""
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)  # what the engine reads
    model = build_quantized_model(str(path), config)
    return LoadedModel(str(path), model, ByteTokenizer(VOCAB), VOCAB, 4096, torch.device("cpu"), torch.float32, "gguf")


def test_logits_match_the_float64_reference_and_transformers_on_the_dequantised_weights(pair):
    loaded, reference = pair
    ids = [int(t) for t in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]
    ours = loaded.runner.forward([loaded.runner.new_cache()], [ids], [len(ids)])[0].double()
    exact = float64_logits(loaded.model, ids, torch.arange(VOCAB))
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits[0].double()
    scale = exact.std(-1, keepdim=True)
    assert ((theirs - exact).abs() / scale).max() < 1e-4  # the reference is transformers' model, rope scaling included
    error = (ours - exact).abs().amax(-1) / scale[:, 0]
    # 8-bit activations' rounding: about 0.05 of the logits' spread here (q and k rows left in llama.cpp's order: 0.23)
    assert error.median() < 0.1 and error.max() < 0.2, error
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.95


def test_the_rotary_frequencies_are_transformers_own_with_llama3_scaling_from_rope_freqs(pair):
    """On both engines: the gguf engine's model, and the torch engine's (transformers' GGUF loading, which leaves
    rope_freqs.weight out, then apply_file_rope_factors)."""
    loaded, reference = pair
    ours, theirs = loaded.model.get_decoder().rotary_emb, reference.get_decoder().rotary_emb
    assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    path = loaded.name
    torch_engine = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    )
    apply_file_rope_factors(torch_engine, path)
    assert torch.allclose(torch_engine.get_decoder().rotary_emb.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    if theirs.rope_type == "llama3":  # the test can fail: the scaling changes the low frequencies
        config = reference.config
        default = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        assert not torch.allclose(default, theirs.inv_freq)


def test_greedy_output_equals_transformers_on_the_dequantised_weights(pair):
    loaded, reference = pair
    prompt = [int(t) for t in torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))]
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    runner = loaded.runner
    cache, tokens = runner.new_cache(), []
    out = runner.forward([cache], [prompt], [1])[0]
    for _ in range(12):
        tokens.append(int(out[-1].argmax()))
        out = runner.forward([cache], [tokens[-1:]], [1])[0]
    assert tokens == expected


def test_a_sessions_rows_are_bit_identical_in_any_pass_and_batch(pair):
    runner: GgufRunner = pair[0].runner
    prompt, feed = list(range(30, 60)), list(range(100, 110))
    cache = runner.new_cache()
    runner.forward([cache], [prompt], [1])
    steps = torch.cat([runner.forward([cache], [[t]], [1])[0] for t in feed])
    runner.crop_to(cache, len(prompt))
    assert torch.equal(runner.forward([cache], [feed], [len(feed)])[0], steps)
    runner.crop_to(cache, len(prompt) + 3)
    other = runner.new_cache()
    runner.forward([other], [[5, 6, 7]], [1])
    assert torch.equal(runner.forward([other, cache], [[8, 9], feed[3:]], [2, 7])[1], steps[3:])
    assert not torch.equal(steps[0], steps[1])


@pytest.mark.slow
def test_greedy_speculation_equals_target_only(pair):
    """Through the services, with a model draft (a second load of the same file: every drafted token is the
    target's, so rounds accept all) and prompt lookup."""
    loaded, _ = pair
    drafts = [
        DraftEngine(ModelProposer(engine_model(pathlib.Path(loaded.name))), "same file"),
        DraftEngine(PromptLookupProposer(), "ngram"),
    ]
    prompt = "abcabcabcabc xyz abcabc"

    async def run():
        for draft in drafts:
            async with running_services(TargetEngine(loaded), draft) as services:
                reference, _ = await generate_ids(services.stub, prompt, gamma=0, max_new_tokens=16)
                ids, stats = await generate_ids(services.stub, prompt, 4, max_new_tokens=16)
                assert ids == reference, draft.name
                assert stats.drafted_tokens > 0 and not stats.fallback_reason, (draft.name, stats)

    asyncio.run(run())
