"""The least a round over gRPC can cost beyond compute on this machine: the same two sequential round trips as a
speculation round (draft, then target), between minimal servers that do nothing but answer (the target after
computing for as long as a real verification took), in processes of their own, over Unix sockets.

    python -m specdec.bench.transport_floor serve draft|target SOCKET WORK_US   (started by measure_floor)
"""

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from specdec.bench.runner import percentile
from specdec.common.grpc_options import CHANNEL_OPTIONS, GRPC_OPTIONS
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc, worker_pb2


def compute_for(seconds: float) -> None:
    """Keeps the cores busy in torch, as a forward pass does (sleeping instead would leave them idle)."""
    weight, x = torch.randn(256, 256), torch.randn(8, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = torch.tanh(x @ weight)


class EchoDraft(draft_pb2_grpc.DraftServiceServicer):
    async def Draft(self, request_iterator, context):
        async for _ in request_iterator:
            yield draft_pb2.DraftResponse(proposal=draft_pb2.DraftProposal())


class ComputingTarget(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, work_us: int):
        self.work_us = work_us

    async def Verify(self, request_iterator, context):
        async for _ in request_iterator:
            compute_for(self.work_us / 1e6)
            timing = worker_pb2.WorkerTiming(compute_us=self.work_us)
            yield target_pb2.VerifyResponse(result=target_pb2.VerifyResult(timing=timing))


async def serve(role: str, socket: str, work_us: int) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    if role == "draft":
        draft_pb2_grpc.add_DraftServiceServicer_to_server(EchoDraft(), server)
    else:
        target_pb2_grpc.add_TargetServiceServicer_to_server(ComputingTarget(work_us), server)
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    await server.wait_for_termination()


async def rounds(draft_socket: str, target_socket: str, count: int) -> list[int]:
    """Each round's wall time minus the target's compute (µs), the first tenth left out as warm-up."""
    async with (
        grpc.aio.insecure_channel(f"unix:{draft_socket}", options=CHANNEL_OPTIONS) as draft_channel,
        grpc.aio.insecure_channel(f"unix:{target_socket}", options=CHANNEL_OPTIONS) as target_channel,
    ):
        draft = draft_pb2_grpc.DraftServiceStub(draft_channel).Draft(wait_for_ready=True)
        target = target_pb2_grpc.TargetServiceStub(target_channel).Verify(wait_for_ready=True)
        overheads = []
        for _ in range(count):
            start = time.perf_counter()
            await draft.write(draft_pb2.DraftRequest(step=draft_pb2.DraftStep(num_tokens=4)))
            await draft.read()
            await target.write(target_pb2.VerifyRequest(step=target_pb2.VerifyStep(draft_token_ids=[1, 2, 3, 4])))
            response = await target.read()
            overheads.append(int((time.perf_counter() - start) * 1e6) - response.result.timing.compute_us)
        draft.cancel()
        target.cancel()
    return overheads[count // 10 :]


def measure_floor(work_us: int, count: int = 300) -> dict[str, float]:
    """Median and p95 (µs) of a round's time beyond compute between minimal servers."""
    with tempfile.TemporaryDirectory(prefix="specdec-floor-") as folder:
        sockets = {role: str(Path(folder) / f"{role}.sock") for role in ("draft", "target")}
        servers = [
            subprocess.Popen([sys.executable, "-m", "specdec.bench.transport_floor", "serve", role, sockets[role], str(work_us)])
            for role in ("draft", "target")
        ]
        try:
            overheads = asyncio.run(rounds(sockets["draft"], sockets["target"], count))
        finally:
            for server in servers:
                server.kill()
                server.wait()
    return {
        "work_us": work_us,
        "rounds": len(overheads),
        "median_us": statistics.median(overheads),
        "p95_us": percentile(overheads, 0.95),
    }


if __name__ == "__main__":
    _, command, role, socket, work = sys.argv
    asyncio.run(serve(role, socket, int(work)))
