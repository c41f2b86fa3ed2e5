"""Model specs: tiny-random gives the same weights in any process; bad specs are refused clearly."""

import random
import subprocess
import sys

import pytest
import torch

from specdec.common.errors import InvalidArgument
from specdec.common.model_specs import TINY_RANDOM_DEFAULTS, parse_spec_params
from specdec.common.models import load_model
from specdec.draft_worker.ngram import NgramIndex, find_continuation, parse_ngram

SPEC = "tiny-random:seed=7,vocab=64,layers=1,hidden=32,noise=0.3"
CHECKSUM = (
    "from common.models import load_model; m = load_model('{spec}', linear='eager').model; "
    "print(repr(sum(float(p.double().sum()) for p in m.parameters())))"
)


def weight_checksum(model) -> float:
    return sum(float(p.double().sum()) for p in model.parameters())


def test_same_tiny_random_string_gives_the_same_weights_in_another_process():
    torch.manual_seed(12345)  # the global RNG must not matter
    here = weight_checksum(load_model(SPEC, linear="eager").model)
    there = subprocess.run([sys.executable, "-c", CHECKSUM.format(spec=SPEC)], capture_output=True, text=True, check=True).stdout
    assert float(there) == here


def test_noise_perturbs_the_same_weights():
    base = load_model("tiny-random:seed=7,vocab=64,layers=1,hidden=32", linear="eager").model
    noisy = load_model(SPEC, linear="eager").model
    a, b = dict(base.named_parameters()), dict(noisy.named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[name], b[name])
    assert torch.corrcoef(torch.stack([a[name].flatten(), b[name].flatten()]))[0, 1] > 0.8


def test_tiny_random_reports_its_vocab_and_byte_tokenizer():
    loaded = load_model("tiny-random:vocab=300,hidden=16")
    assert loaded.vocab_size == 300 and loaded.model.config.num_hidden_layers == TINY_RANDOM_DEFAULTS["layers"]
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo ✓")) == "héllo ✓"


@pytest.mark.parametrize("spec", ["tiny-random:seed", "tiny-random:colour=3", "tiny-random:vocab=abc", "tiny-random:hidden=8"])
def test_malformed_tiny_random_specs_are_refused(spec):
    with pytest.raises(InvalidArgument, match="model"):
        load_model(spec)


def test_spec_params_parse_known_keys():
    assert parse_spec_params("ngram:max=5", "ngram", {"max": 3, "min": 1}) == {"max": 5, "min": 1}
    assert parse_ngram("ngram:max=4,min=2") == (4, 2)


def test_prompt_lookup_continues_the_most_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert find_continuation(tokens, 2, max_n=3, min_n=1) == [8, 7]
    assert find_continuation([5, 6, 7, 5], 3, max_n=3, min_n=1) == [6, 7, 5]
    assert find_continuation([1, 2, 3], 2, max_n=3, min_n=1) == []
    assert find_continuation([4, 1, 2, 9, 1, 2], 3, max_n=2, min_n=2) == [9, 1, 2]


def test_prompt_lookup_index_finds_what_the_scan_finds_as_the_sequence_grows_and_is_cut_back():
    rng = random.Random(0)
    for _ in range(300):
        vocab, max_n = rng.choice([3, 5, 20]), rng.choice([1, 2, 3, 4])
        min_n = rng.randint(1, max_n)
        index = NgramIndex([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))], max_n, min_n)
        for _ in range(5):
            wanted = rng.randrange(1, 6)
            assert index.continuation(wanted) == find_continuation(index.tokens, wanted, max_n, min_n)
            index.truncate(rng.randrange(index.undo_start, len(index.tokens) + 1))  # a rejected chain
            if rng.random() < 0.5:
                index.keep(len(index.tokens))  # a sync: what is committed is never cut back
            assert index.follower == NgramIndex(index.tokens, max_n, min_n).follower
            index.extend([rng.randrange(vocab) for _ in range(rng.randrange(0, 8))])


@pytest.mark.parametrize("shape, billions", [("qwen2.5-0.5b", 0.49), ("qwen2.5-1.5b", 1.54)])
def test_random_shapes_have_the_real_models_parameter_counts(shape, billions):
    from transformers import AutoModelForCausalLM

    from specdec.common.random_models import random_shape_config

    config, seed = random_shape_config(f"random-shape:{shape},seed=3")
    assert seed == 3
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02)


def test_unknown_random_shape_is_refused():
    with pytest.raises(InvalidArgument, match="known shapes"):
        load_model("random-shape:gpt-5")


def test_q4_1_requantization_is_refused_off_the_gguf_engine_naming_the_spec():
    with pytest.raises(InvalidArgument, match=r"#q4_1 re-quantizes the gguf engine's layers") as error:
        load_model("tiny-random:seed=7,vocab=64,layers=1,hidden=32#q4_1")
    assert error.value.field == "model"
