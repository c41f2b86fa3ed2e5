"""A Generate request, followed from the coordinator's servicer to the gguf engine's kernel call, passes through at
most 12 files with logic (besides the error mapping around every servicer), and never moves back up a layer."""

import asyncio
import pathlib
import sys

from specdec.common.batcher import Batcher
from specdec.common.quantized.decoder import GgufRunner
from specdec.coordinator.client import build_request
from specdec.coordinator.worker_clients import GrpcTargetSession, StreamSession
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.target_worker.calls import VerifyCall
from specdec.target_worker.engine import TargetEngine
from tests.support import REPO
from tests.support.services import running_services

ERROR_MAPPING = "common/grpc_errors.py"  # the decorator every servicer method is wrapped in
SOURCES = ("common", "coordinator", "draft_worker", "target_worker", "protos")


def repo_files_on_the_stack() -> list[str]:
    """The repository's files on the calling thread's stack, outermost first, tests left out."""
    files, frame = [], sys._getframe(2)
    while frame:
        path = pathlib.Path(frame.f_code.co_filename)
        if any(path.is_relative_to(REPO / folder) for folder in SOURCES):
            files.append(str(path.relative_to(REPO)))
        frame = frame.f_back
    return files[::-1]


def recording(stacks: dict, key: str, method, when=lambda *args: True):
    """method, recording the stack of its first call once stacks["on"] is set."""

    def record(*args, **kwargs):
        if stacks.get("on") and when(*args):
            stacks.setdefault(key, repo_files_on_the_stack())
        return method(*args, **kwargs)

    return record


def is_a_target_step(session, request) -> bool:
    return isinstance(session, GrpcTargetSession) and request.WhichOneof("kind") == "step"


def layers(stack: list[str]) -> list[str]:
    """The files of a stack in the order the call passed through them, each once where it stays in one file."""
    return [path for i, path in enumerate(stack) if i == 0 or stack[i - 1] != path]


def test_a_generate_request_passes_through_at_most_12_files_to_the_kernel_call(smollm2, monkeypatch):
    stacks: dict[str, list[str]] = {}
    monkeypatch.setattr(
        StreamSession,
        "exchange",
        recording(stacks, "coordinator", StreamSession.exchange, lambda session, request, *_: is_a_target_step(session, request)),
    )
    monkeypatch.setattr(
        Batcher, "submit", recording(stacks, "worker's event loop", Batcher.submit, lambda _, call: isinstance(call, VerifyCall))
    )
    monkeypatch.setattr(GgufRunner, "forward", recording(stacks, "compute thread", GgufRunner.forward))

    async def run():
        async with running_services(TargetEngine(smollm2), DraftEngine(PromptLookupProposer(), "ngram")) as services:
            request = build_request("def add(a, b):\n    return a + b\n\ndef add(a, b):", max_new_tokens=8, temperature=0)
            stacks["on"] = True
            response = await services.stub.Generate(request)
            assert response.usage.completion_tokens == 8

    asyncio.run(run())
    del stacks["on"]
    assert set(stacks) == {"coordinator", "worker's event loop", "compute thread"}
    # The recorded stacks end where the call leaves a file: the gRPC exchange, the batcher, the decoder's pass.
    stacks["worker's event loop"].append("common/batcher.py")
    stacks["compute thread"].append("common/quantized/decoder.py")
    for where, stack in stacks.items():
        passed = layers(stack)
        assert len(passed) == len(set(passed)), f"the {where} moves back up a layer: {' -> '.join(passed)}"
    assert stacks["coordinator"][0] == ERROR_MAPPING and stacks["coordinator"][1] == "coordinator/server.py"
    worker = stacks["worker's event loop"] + stacks["compute thread"]
    assert not any(path.startswith("coordinator/") for path in worker)
    files = {path for stack in stacks.values() for path in stack} - {ERROR_MAPPING}
    assert len(files) <= 12, sorted(files)
