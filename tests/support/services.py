"""The services under test in this process: tiny random models, worker engines and the three gRPC services on loopback."""

import asyncio
import contextlib
from dataclasses import dataclass
import grpc
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.gamma_policy_factory import gamma_policy_for
from specdec.coordinator.server import build_engine, start_coordinator_server
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.hybrid import HybridProposer
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.draft_worker.server import start_draft_server
from specdec.draft_worker.suffix import SuffixProposer
from specdec.v1 import generation_pb2_grpc
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server


TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"


def prefilled(runner, prompt: list[int]):
    """A new cache of the runner's holding the prompt."""
    cache = runner.new_cache()
    runner.forward([cache], [prompt], [1])
    return cache


def draft_spec(noise: float) -> str:
    return f"{TARGET},noise={noise}"


def draft_engine_for(draft_models, kind) -> DraftEngine:
    """A draft worker's engine: a tiny model of the given noise, or a proposer by name (`hybrid`: suffix trees
    before the half-agreeing model)."""
    if kind == "ngram":
        return DraftEngine(PromptLookupProposer(), "ngram")
    if kind == "suffix":
        return DraftEngine(SuffixProposer(), "suffix")
    if kind == "hybrid":
        return DraftEngine(HybridProposer(SuffixProposer(), ModelProposer(draft_models[0.5])), "suffix+" + draft_spec(0.5))
    return DraftEngine(ModelProposer(draft_models[kind]), draft_spec(kind))


@dataclass
class Services:
    """A running cluster: the engines behind the workers and a stub of the coordinator's GenerationService."""

    target: TargetEngine
    draft: DraftEngine | None
    stub: generation_pb2_grpc.GenerationServiceStub
    coordinator_address: str
    target_address: str
    draft_address: str | None


@contextlib.asynccontextmanager
async def running_services(
    target: TargetEngine, draft: DraftEngine | None, config: CoordinatorConfig | None = None, policy_for=gamma_policy_for
):
    """The three gRPC services on loopback ports, in this event loop, over already-loaded engines (policy_for: the
    requests' gamma policies, see GenerationEngine)."""
    target_server, target_port = await start_target_server(target)
    servers = [target_server]
    draft_address = None
    if draft is not None:
        draft_server, draft_port = await start_draft_server(draft)
        servers.append(draft_server)
        draft_address = f"127.0.0.1:{draft_port}"
    workers = GrpcWorkers(f"127.0.0.1:{target_port}", draft_address)
    engine = await build_engine(workers, config or CoordinatorConfig(), tokenizer=target.loaded.tokenizer, policy_for=policy_for)
    coordinator_server, coordinator_port = await start_coordinator_server(engine)
    servers.append(coordinator_server)
    address = f"127.0.0.1:{coordinator_port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield Services(
                target,
                draft,
                generation_pb2_grpc.GenerationServiceStub(channel),
                address,
                f"127.0.0.1:{target_port}",
                draft_address,
            )
    finally:
        await workers.close()
        await asyncio.gather(*(s.stop(0) for s in servers))


class BackgroundServices:
    """running_services in a thread of its own, for tests that call the services with blocking clients."""

    def __init__(self, target: TargetEngine, draft: DraftEngine | None, config: CoordinatorConfig | None = None):
        import threading

        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stopping = None
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self.serve(target, draft, config),), daemon=True
        )
        self.thread.start()
        assert self.ready.wait(60), "services did not start"

    async def serve(self, target, draft, config):
        self.stopping = asyncio.Event()
        async with running_services(target, draft, config) as services:
            self.services = services
            self.ready.set()
            await self.stopping.wait()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(30)
