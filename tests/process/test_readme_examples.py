"""The README's OpenAI example, run as a user would paste it, against the service `specdec up` starts (SmolLM2-135M,
prompt lookup in the coordinator): every call in it answers, and what it prints is what its comments promise."""

import contextlib
import io
import re
from pathlib import Path

import pytest

from specdec.coordinator.cluster import MODEL_FREE_DRAFT_IN_COORDINATOR, Cluster, free_port

README = Path(__file__).resolve().parents[2] / "README.md"


def openai_example() -> str:
    """The python block of the README's "OpenAI-compatible HTTP" section."""
    section = README.read_text().split("### OpenAI-compatible HTTP", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    http = free_port()
    with Cluster(
        "smollm2-135m",
        None,
        free_port(),
        http_port=http,
        local_draft=MODEL_FREE_DRAFT_IN_COORDINATOR,  # as specdec up
        log_dir=tmp_path_factory.mktemp("readme"),
    ):
        yield f"http://127.0.0.1:{http}/v1"


def test_the_readmes_openai_example_runs_against_specdec_up(service):
    code = openai_example()
    assert 'base_url="http://localhost:8000/v1"' in code, "the example no longer points at specdec up's port"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace("http://localhost:8000/v1", service), str(README), "exec"), {"__name__": "readme"})
    lines = printed.getvalue().splitlines()
    assert "drafted_tokens" in lines[0]  # the speculation record rides on the response
    assert re.search(r"^-?\d+\.\d+", lines[2]), lines[2]  # the prompt's summed log-probability
    assert lines[3].startswith("name=") and "population=" in lines[3]  # the parsed Pydantic object
    assert '"city"' in lines[4]  # the call's arguments, parsed against the tool's schema
