"""The bench as a user runs it, on the tiny pair."""

import pathlib
import subprocess
import sys
from tests.support.services import TARGET, draft_spec


def run_quick_bench(output_root: pathlib.Path, suite: str, *extra: str, max_new_tokens: int = 12) -> pathlib.Path:
    """`specdec bench --suite SUITE --quick` as a user runs it, on the tiny pair (target TARGET, draft
    TARGET,noise=0.3); returns the folder of its results."""
    command = [
        sys.executable, "-m", "specdec.cli", "bench", "--suite", suite, "--quick", "--name", suite,
        "--output-root", str(output_root), "--target-model", TARGET, "--draft-model", draft_spec(0.3),
        "--max-new-tokens", str(max_new_tokens), *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return output_root / suite
