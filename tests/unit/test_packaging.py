"""specdec installs as one import name: the repository's folders are subpackages of `specdec` (pyproject.toml's
package-dir), so a user's environment gains `specdec` and the `specdec` script, and no `common` or `cli`."""

import ast
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("common", "coordinator", "draft_worker", "target_worker", "cli", "bench")


def bare_imports(path: pathlib.Path) -> list[str]:
    """Imports of a repository folder by its folder name, which would load a second copy of its modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names if name.split(".")[0] in FOLDERS]
    return found


def test_the_code_imports_its_folders_only_through_the_specdec_namespace():
    sources = [p for folder in (*FOLDERS, "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 100
    offenders = [found for path in sources for found in bare_imports(path)]
    assert not offenders, offenders


@pytest.mark.slow
def test_installing_the_wheel_adds_only_the_specdec_package_and_script(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("specdec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"specdec/common/quantized/kernels.cpp", "specdec/bench/prompts.json", "specdec/v1/generation.proto"} <= set(names)

    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    before = {p.name for p in pathlib.Path(purelib).iterdir()}
    scripts_before = {p.name for p in (env / "bin").iterdir()}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)
    added = {p.name for p in pathlib.Path(purelib).iterdir()} - before
    assert {name for name in added if not name.endswith(".dist-info")} == {"specdec"}
    assert {p.name for p in (env / "bin").iterdir()} - scripts_before == {"specdec"}
    assert sysconfig.get_paths()["purelib"] != purelib  # the fresh environment, not this one
