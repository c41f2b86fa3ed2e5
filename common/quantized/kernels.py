"""The C++ kernels (kernels.cpp), compiled once per machine with the compiler on it and cached.

The first use builds them (about a minute with 2 cores) into the specdec cache directory, where later processes
find them; `python -m specdec.common.quantized.kernels` builds them ahead of time (the Makefile and the Docker image do).
They need an x86-64 CPU with AVX2 and FMA, and a C++ compiler.
"""

import functools
import hashlib
import importlib.util
import logging
import os
import time
from pathlib import Path

import torch

from specdec.common.memory import keep_freed_memory
from specdec.common.model_files import cache_dir

log = logging.getLogger("specdec")

SOURCE = Path(__file__).with_name("kernels.cpp")
# Included by SOURCE.
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "kernel_rows.h",
        "kernel_columns.h",
        "kernel_wide_columns.h",
        "kernel_wide_tiles.h",
        "kernel_amx.h",
        "attention_avx512.h",
        "decoder_ops.h",
        "decoder_layers.h",
    )
]
NAME = "specdec_gguf_kernels"
# Flags every AVX2 machine has, never -march=native: one cache directory (a Docker image, a shared volume) may
# serve machines of different CPUs. -ffp-contract=off keeps each product's float operations exactly as written,
# which is what makes a row's result independent of the row tile it is computed in.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
# at::parallel_for is OpenMP in torch's CPU build: the extension must be built with it to run on torch's threads (the
# libgomp it links is the one torch has loaded, so torch.set_num_threads governs both).
LDFLAGS = ["-fopenmp"]


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def build_directory() -> Path:
    """Where the compiled module lives: SPECDEC_KERNELS_DIR (a Docker image builds it there at image build time),
    else the specdec cache."""
    base = os.environ.get("SPECDEC_KERNELS_DIR")
    return Path(base) if base else cache_dir() / "kernels" / f"torch-{torch.__version__}"


def fingerprint() -> str:
    """What a built module was built from: the sources, the flags and torch's version."""
    text = b"".join(f.read_bytes() for f in [SOURCE, *HEADERS]) + " ".join(CFLAGS + LDFLAGS).encode() + torch.__version__.encode()
    return hashlib.sha256(text).hexdigest()


def import_built(build: Path):
    """The module built earlier from this very source, imported without torch's build machinery (which takes a lock
    file in the folder: a read-only image could not run it), or None."""
    stamp, library = build / "fingerprint", build / f"{NAME}.so"
    if not (stamp.is_file() and library.is_file() and stamp.read_text() == fingerprint()):
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The float numerics each instruction set computes Q4_K and Q6_K in by default (kernels.cpp): a machine pinned to
# a lesser instruction set computes the bits a machine of that kind computes.
ISA_NUMERICS = {"avx2": "totals", "vnni": "lanes", "amx": "totals"}
NUMERICS = ("lanes", "totals")


def pin_isa(module) -> None:
    """SPECDEC_KERNEL_ISA (avx2, vnni or amx): run the kernels on that instruction set, in its numerics, instead of
    the best this CPU has. SPECDEC_KERNEL_NUMERICS (lanes or totals): compute Q4_K and Q6_K in those numerics, on
    the pinned instruction set or this CPU's own. A VNNI machine without AMX in totals computes the same bits as
    the AVX2 and AMX machines of a fleet, and its prefill on the VNNI column tiles (docs/engines.md)."""
    isa, numerics = os.environ.get("SPECDEC_KERNEL_ISA"), os.environ.get("SPECDEC_KERNEL_NUMERICS")
    if isa and isa not in ISA_NUMERICS:
        raise RuntimeError(f"SPECDEC_KERNEL_ISA must be one of {', '.join(ISA_NUMERICS)}, not {isa!r}")
    if numerics and numerics not in NUMERICS:
        raise RuntimeError(f"SPECDEC_KERNEL_NUMERICS must be one of {', '.join(NUMERICS)}, not {numerics!r}")
    if not (isa or numerics):
        return
    isa = isa or module.isa()
    numerics = numerics or ISA_NUMERICS[isa]
    if isa == "amx" and numerics != "totals":
        raise RuntimeError("SPECDEC_KERNEL_NUMERICS=lanes: AMX computes in totals; set SPECDEC_KERNEL_ISA=vnni with it")
    use_kernels(module, isa, numerics)


def use_kernels(module, isa: str, numerics: str) -> None:
    """Run the kernels on `isa` in `numerics`: through AVX2, which neither AMX nor its numerics constraint binds."""
    module.set_isa("avx2")
    module.set_numerics(numerics)
    module.set_isa(isa)


@functools.cache
def kernels():
    """The compiled module (built on first use), on the instruction set and numerics the environment pins, if any,
    in a process whose malloc keeps freed memory for the next pass (keep_freed_memory)."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"the gguf kernels cannot run here: {reason}")
    keep_freed_memory()
    build = build_directory()
    module = import_built(build) or build_module(build)
    pin_isa(module)
    return module


def build_module(build: Path):
    """Compile SOURCE into `build` (about a minute with 2 cores)."""
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    module = load(
        name=NAME,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build),
        verbose=bool(os.environ.get("SPECDEC_VERBOSE_BUILD")),
    )
    (build / "fingerprint").write_text(fingerprint())
    log.info("gguf kernels built in %.1f s (%s)", time.monotonic() - started, build)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    kernels()
