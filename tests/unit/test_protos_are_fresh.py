"""The committed stubs are exactly what `make protos` generates from protos/specdec/v1/*.proto."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "specdec" / "v1"


def test_committed_stubs_match_the_proto_files(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in PROTO_DIR.glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted(p.name for p in (tmp_path / "specdec" / "v1").iterdir())
    committed = sorted(p.name for p in PROTO_DIR.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert generated == committed, "run `make protos`"
    stale = [name for name in generated if (tmp_path / "specdec" / "v1" / name).read_bytes() != (PROTO_DIR / name).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run `make protos`"
