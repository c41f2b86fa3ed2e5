"""llama-server, llama.cpp's own HTTP server, as a bench peer: its parallel slots (`-np`) batch concurrent
requests the way specdec's workers do, and its `-md` runs speculative decoding with a draft model.

It is built once from the llama.cpp sources vendored in llama-cpp-python's sdist (the same llama.cpp as the
in-process peer, `specdec[peers]`), with the machine's cmake and compiler, into the specdec cache
(`python -m specdec.bench.llama_server` builds it; 10-15 minutes on 2 cores). Nothing is fetched but the sdist, from PyPI.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdec.common.model_files import cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # as pyproject's `peers` extra
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction set, as pip's build of llama-cpp-python
    # ...but no AMX: this VM reports AMX, yet its first tile instruction raises SIGILL (the OS does not grant the
    # tile state), and the in-process peer's build has no AMX code either.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",  # no model downloads
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # the browser UI is not needed (and its prebuilt assets would be downloaded)
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]


def binary_path() -> Path:
    return cache_dir() / "llama-server" / LLAMA_CPP_PYTHON.replace("==", "-") / "llama-server"


def sdist_sources(work: Path) -> Path:
    """The sdist's vendored llama.cpp, downloaded from PyPI (pip's cache answers a second time) and unpacked."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            "-d",
            str(work),
            LLAMA_CPP_PYTHON,
        ],
        check=True,
    )
    archive = next(work.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build(jobs: int = os.cpu_count() or 2) -> Path:
    """llama-server's path, built first when the cache does not have it."""
    target = binary_path()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="specdec-llama-server-") as tmp:
        work = Path(tmp)
        sources = sdist_sources(work)
        build_dir = work / "build"
        subprocess.run(["cmake", "-S", str(sources), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "bin" / "llama-server", target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on one GGUF file (and a draft's, for -md), serving the OpenAI API on localhost."""

    def __init__(
        self, model: str, threads: int, slots: int = 1, draft: str | None = None, context: int = 4096, log: Path | None = None
    ):
        self.port = free_port()
        self.command = [
            str(build()), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            # Every slot gets the full context (-c is shared by the slots); weights read into memory, not mapped
            # (repacked for its CPU kernels: its fastest setting here, as for the in-process peer); no prompt
            # cache across requests (each request also sends cache_prompt false): every prompt is prefilled
            # afresh, as in specdec.
            "-c", str(context * slots), "--load-mode", "none", "--cache-ram", "0", "--no-webui",
        ]  # fmt: skip
        if draft:  # its speculation settings (draft length, minimum probability) left at their defaults
            self.command += ["-md", draft, "-td", str(threads), "-tbd", str(threads)]
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def create_chat_completion(self, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> dict:
        """A chat completion (OpenAI's response object, with llama-server's timings), called as llama-cpp-python's
        Llama.create_chat_completion is, so that one bench function serves both. cache_prompt false: the prompt is
        prefilled afresh even where a slot still holds it from a repeat."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "cache_prompt": False}
        request = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)

    def __enter__(self) -> "LlamaServer":
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {' '.join(self.command)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if json.load(response).get("status") == "ok":
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError("llama-server did not become healthy in 300 s")

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


if __name__ == "__main__":
    print(build())
