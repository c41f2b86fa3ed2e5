"""The product as users run it: separate `specdec serve` processes, the real SmolLM2-135M, the CLI."""

import json
import subprocess
import sys

import pytest

from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port, is_serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # SmolLM2 in separate processes

GROUNDED = (
    "Repeat this sentence exactly, then stop: The Rhine begins in the Swiss Alps, flows through six countries "
    "and empties into the North Sea."
)


@pytest.fixture(scope="module")
def smollm2_cluster():
    with Cluster(target_model="smollm2-135m", draft_model="ngram", port=free_port()) as cluster:
        yield cluster


def test_greedy_output_matches_target_only_on_smollm2(smollm2_cluster):
    messages = [{"role": "user", "content": GROUNDED}]
    with GenerationClient(smollm2_cluster.address) as client:
        reference = client.generate(messages, max_new_tokens=40, temperature=0, num_speculative_tokens=0)
        assert reference.speculation.drafted_tokens == 0
        for gamma in (1, 2, 4):
            response = client.generate(messages, max_new_tokens=40, temperature=0, num_speculative_tokens=gamma)
            assert list(response.token_ids) == list(reference.token_ids), f"gamma={gamma}"
            assert response.text == reference.text
        assert response.speculation.accepted_tokens > 0, "prompt lookup should find the repeated sentence"
        assert response.speculation.rounds < len(reference.token_ids)


def test_generate_command_prints_the_json_result(smollm2_cluster):
    base = [
        sys.executable,
        "-m",
        "cli",
        "generate",
        "--endpoint",
        smollm2_cluster.address,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]
    prompt = "The capital of France is"
    result = json.loads(
        subprocess.run([*base, "--json", "--gamma", "2", prompt], capture_output=True, text=True, check=True).stdout
    )
    assert set(result) >= {"text", "token_ids", "finish_reason", "usage", "speculation"}
    assert result["finish_reason"] in ("length", "stop") and result["usage"]["completion_tokens"] == len(result["token_ids"])
    assert set(result["speculation"]) >= {"rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate"}
    streamed = subprocess.run([*base, "--gamma", "0", prompt], capture_output=True, text=True, check=True).stdout
    assert streamed.strip() == result["text"].strip()


def test_coordinator_refuses_a_pair_whose_tokenizers_differ():
    target_port, draft_port = free_port(), free_port()
    serve = [sys.executable, "-m", "specdec.cli", "serve"]
    workers = [
        subprocess.Popen(
            [*serve, "target", "--model", "tiny-random:vocab=256", "--port", str(target_port)], stderr=subprocess.DEVNULL
        ),
        subprocess.Popen(
            [*serve, "draft", "--model", "tiny-random:vocab=128", "--port", str(draft_port)], stderr=subprocess.DEVNULL
        ),
    ]
    try:
        wait_until(
            lambda: is_serving(f"localhost:{target_port}") and is_serving(f"localhost:{draft_port}"),
            timeout=120,
            interval=0.2,
            message="workers did not start",
        )
        coordinator = subprocess.run(
            [
                *serve,
                "coordinator",
                "--port",
                str(free_port()),
                "--target",
                f"localhost:{target_port}",
                "--draft",
                f"localhost:{draft_port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert coordinator.returncode == 2
        assert one_line_error(coordinator.stderr, "different tokenizers")
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(timeout=15)


def one_line_error(stderr: str, *words: str) -> bool:
    """A start-up failure as users see it: one line naming the problem, no traceback or event-loop noise."""
    errors = [line for line in stderr.splitlines() if "cannot start" in line]
    noise = ("Traceback", "Event loop is closed", "never awaited", "Exception ignored")
    return len(errors) == 1 and all(w in errors[0] for w in words) and not any(n in stderr for n in noise)


def write_gguf(path, architecture: str) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", ["unsupported architecture", "missing file", "corrupt file"])
def test_a_worker_that_cannot_start_says_why_in_one_line_naming_the_file_and_exits_2(tmp_path, case):
    path = tmp_path / "model.gguf"
    if case == "unsupported architecture":
        write_gguf(path, "mamba")
        reason = "not mamba"
    elif case == "corrupt file":
        path.write_bytes(b"GGML" + bytes(100))
        reason = "not a readable GGUF file"
    else:
        reason = "no such file"
    serve = ["serve", "target", "--model", str(path), "--engine", "gguf", "--port", "0"]
    done = subprocess.run([sys.executable, "-m", "specdec.cli", *serve], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and one_line_error(done.stderr, str(path), reason), done.stderr
    # The traceback is in the debug log.
    debug = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "--log-level", "DEBUG", *serve], capture_output=True, text=True, timeout=300
    )
    assert debug.returncode == 2 and "Traceback" in debug.stderr
