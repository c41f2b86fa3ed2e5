"""The oneDNN-packed linear path computes what transformers' own layers compute, up to float rounding, and the
vocabulary-restricted draft head samples only among the tokens it keeps."""

import pytest
import torch

from specdec.common.batched_forward import forward_sessions, session_cache
from specdec.common.errors import InvalidArgument
from specdec.common.model_variants import RestrictedHead
from specdec.common.models import load_model
from specdec.common.packed_linear import PackedLinear, pack_linear_layers, padded_rows
from specdec.common.sampling import SamplingParams, logits_to_probs, truncate_probs

TINY = "tiny-random:seed=3,vocab=256,layers=2,hidden=64"


def logits_of(loaded, prompt: list[int]) -> torch.Tensor:
    cache = session_cache(loaded.model.config.num_hidden_layers)
    return forward_sessions(loaded.model, [cache], [prompt], [len(prompt)])[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    packed.min_rows = 6  # padded calls must return only their own rows
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        expected, actual = linear(x), packed(x)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_padding_to_the_cheapest_row_count_does_not_change_a_row():
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(64, 128))
    x = torch.randn(1, 64)
    with torch.inference_mode():
        alone = packed(x)
        packed.min_rows = 5
        padded = packed(x)
    torch.testing.assert_close(padded, alone, rtol=1e-6, atol=1e-6)


def test_row_counts_are_bucketed_so_that_the_kernels_a_worker_keeps_stay_few():
    # oneDNN keeps a kernel (about 0.5 MB) for every row count it meets: unbucketed, a worker's memory grew with
    # every new batch or prompt size (the load test caught it).
    assert [padded_rows(c, 1) for c in range(1, 17)] == list(range(1, 17))  # verification rounds run as they are
    assert [padded_rows(c, 5) for c in (1, 4, 5, 6)] == [5, 5, 5, 6]
    counts = range(1, 10_000)
    assert len({padded_rows(c, 1) for c in counts}) <= 100
    assert all(c <= padded_rows(c, 1) <= c * 9 / 8 + 1 for c in counts)


def test_packing_replaces_every_float32_linear_layer():
    loaded = load_model(TINY, linear="eager")
    linears = [m for m in loaded.model.modules() if type(m) is torch.nn.Linear]
    packed = pack_linear_layers(loaded.model)
    assert len(packed) == len(linears) > 0
    assert not [m for m in loaded.model.modules() if type(m) is torch.nn.Linear]
    assert len({layer.min_rows for layer in packed}) == 1


@pytest.mark.parametrize("spec", [TINY, pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def test_packed_model_logits_match_the_plain_model(spec):
    plain, packed = load_model(spec, linear="eager"), load_model(spec, linear="packed")
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    prompt = plain.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    expected, actual = logits_of(plain, prompt), logits_of(packed, prompt)
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= 1e-4 * max(scale, 1.0)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_packed_needs_a_float32_model_on_a_cpu():
    with pytest.raises(InvalidArgument, match="linear"):
        load_model(TINY, dtype="bfloat16", linear="packed")
    with pytest.raises(InvalidArgument, match="linear"):
        load_model(TINY, linear="fast")


def test_auto_keeps_models_the_packed_path_cannot_serve():
    loaded = load_model(TINY, dtype="bfloat16")
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


def test_a_vocab_restricted_draft_puts_all_its_probability_on_the_kept_tokens():
    full = load_model(TINY)
    restricted = load_model(TINY + "#vocab=64")
    head = restricted.model.get_output_embeddings()
    assert isinstance(head, RestrictedHead)
    kept = set(head.token_ids.tolist())
    assert kept == set(range(64)) | set(restricted.tokenizer.eos_token_ids)
    prompt = list(range(100, 140))
    logits, reference = logits_of(restricted, prompt), logits_of(full, prompt)
    # The kept tokens keep exactly the full model's logits; the others can never be drawn.
    ids = head.token_ids
    torch.testing.assert_close(logits[:, ids], reference[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)):
        probs = logits_to_probs(logits, params)
        assert torch.isfinite(probs).all() and probs[:, outside].sum() == 0
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(prompt)))
        assert set(truncate_probs(probs[-1], 64).token_ids.tolist()) <= kept


def test_variants_chain_left_to_right():
    loaded = load_model(TINY + "#vocab=64#int8")
    assert isinstance(loaded.model.get_output_embeddings(), RestrictedHead)
    assert loaded.batch_invariant is False and loaded.runner.batch_invariant is False  # int8: one pass per session
    with pytest.raises(InvalidArgument, match="vocab"):
        load_model(TINY + "#vocab=0")
