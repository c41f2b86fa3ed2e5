"""The contract every model runner keeps (common.model_runner): one pass over several sessions returns each the
rows it asked for, as that session alone would get them; a rollback is a crop that scores as a fresh prefill; a
copied cache scores as its source. Run on every runner: torch (float32, packed), torch #int8 (batch-variant: one
pass per session; its activations' scale spans the rows of a pass, so a cache rolled back is not one prefilled
afresh: a draft's cost only, since exactness never depends on the draft) and the gguf engine."""

import pytest
import torch

from specdec.common.model_runner import TorchRunner
from specdec.common.quantized.decoder import GgufRunner
from specdec.common.models import load_model
from tests.support.services import prefilled

RUNNERS = {
    "torch": "tiny-random:seed=0,vocab=256,layers=2,hidden=64",
    "torch-int8": "tiny-random:seed=0,vocab=256,layers=2,hidden=64#int8",
    "gguf": "smollm2-135m",
}
PROMPTS = [[(11 * i + j) % 200 + 5 for j in range(n)] for i, n in enumerate([7, 30, 2, 15])]


@pytest.fixture(scope="module", params=list(RUNNERS))
def loaded(request):
    return load_model(RUNNERS[request.param], engine="gguf" if request.param == "gguf" else "torch")


def same(a: torch.Tensor, b: torch.Tensor, runner) -> bool:
    """Bit-identical where the runner promises it (the gguf engine, and any runner's session in a pass of its
    own); float32 torch passes of different row counts agree to rounding."""
    return torch.equal(a, b) if isinstance(runner, GgufRunner) else torch.allclose(a, b, atol=1e-5)


def test_each_engine_gets_its_runner(loaded):
    runner = loaded.runner
    assert runner is loaded.runner  # made once
    assert isinstance(runner, GgufRunner if loaded.engine == "gguf" else TorchRunner)
    assert runner.batch_invariant is ("#int8" not in loaded.name)
    assert runner.fixed_kernels is (loaded.engine == "gguf")


def test_a_pass_gives_each_session_the_rows_it_would_get_alone(loaded):
    runner = loaded.runner
    feeds, keep = [[9, 8, 7], [5], [3, 4, 5, 6, 7, 8], [1, 2]], [3, 1, 2, 1]
    alone = [runner.forward([prefilled(runner, p)], [f], [k])[0] for p, f, k in zip(PROMPTS, feeds, keep, strict=True)]
    caches = [prefilled(runner, p) for p in PROMPTS]
    together = runner.forward(caches, feeds, keep)
    for a, t, k in zip(alone, together, keep, strict=True):
        assert t.shape == (k, loaded.vocab_size) and same(a, t, runner)
    assert [c.get_seq_length() for c in caches] == [len(p) + len(f) for p, f in zip(PROMPTS, feeds, strict=True)]


def test_a_rollback_is_a_crop_that_scores_as_a_fresh_prefill(loaded):
    runner, prompt = loaded.runner, PROMPTS[1]
    cache = prefilled(runner, prompt)
    runner.forward([cache], [[40, 41, 42, 43]], [4])
    assert runner.crop_to(cache, len(prompt) + 1) == 3 and cache.get_seq_length() == len(prompt) + 1
    assert runner.crop_to(cache, len(prompt) + 5) == 0  # nothing past the end to remove
    if not runner.batch_invariant:
        return  # #int8's keys depend on the rows they were computed with: only a draft runs it (see the module)
    fresh = prefilled(runner, [*prompt, 40])
    assert same(runner.forward([cache], [[50]], [1])[0], runner.forward([fresh], [[50]], [1])[0], runner)


def test_a_copied_cache_scores_as_its_source_and_moves_on_its_own(loaded):
    runner = loaded.runner
    source = prefilled(runner, PROMPTS[0])
    copy = runner.copy_cache(source)
    assert torch.equal(runner.forward([copy], [[60]], [1])[0], runner.forward([source], [[60]], [1])[0])
    runner.forward([copy], [[61, 62]], [1])
    assert (copy.get_seq_length(), source.get_seq_length()) == (len(PROMPTS[0]) + 3, len(PROMPTS[0]) + 1)


def test_the_cost_curve_covers_every_calibrated_row_count(loaded):
    from specdec.common.model_runner import CALIBRATION_TOKENS

    curve = loaded.runner.cost_curve(loaded.vocab_size, repeats=1)
    assert [t for t, _ in curve] == CALIBRATION_TOKENS and all(ms > 0 for _, ms in curve)
