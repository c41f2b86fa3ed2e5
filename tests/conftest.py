"""Fixtures every kind of test shares: the tiny random models (fast, exact) and the real SmolLM2 on the gguf engine.
Helpers that start services, wait or generate are in tests/support."""

import pytest

from specdec.common.models import load_model
from tests.support.services import TARGET, draft_spec


def pytest_terminal_summary(terminalreporter):
    """The machine the run ran on, beside the failures (CI machines differ in CPU, and so in the kernels they run)."""
    from specdec.bench.runner import cpu_model

    terminalreporter.write_line(f"machine: {cpu_model()}")


@pytest.fixture(scope="session")
def target_model():
    return load_model(TARGET)


@pytest.fixture(scope="session")
def draft_models():
    """Drafts of several qualities: identical weights, close, half agreeing, mostly wrong."""
    return {noise: load_model(draft_spec(noise)) for noise in (0.0, 0.1, 0.5, 1.0)}


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M (Q4_1) on the gguf engine, one per test module (tests may change its runner's settings)."""
    return load_model("smollm2-135m", engine="gguf")
