"""Shared fixtures: tiny random models (fast, exact) and real gRPC services on loopback."""

import asyncio
import contextlib
import inspect
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import pytest

from common.models import load_model
from coordinator.config import CoordinatorConfig
from coordinator.gamma_policy_factory import gamma_policy_for
from coordinator.server import build_engine, start_coordinator_server
from coordinator.worker_clients import GrpcWorkers
from draft_worker.engine import DraftEngine
from draft_worker.hybrid import HybridProposer
from draft_worker.model_proposer import ModelProposer
from draft_worker.ngram import PromptLookupProposer
from draft_worker.server import start_draft_server
from draft_worker.suffix import SuffixProposer
from specdec.v1 import generation_pb2_grpc
from target_worker.engine import TargetEngine
from target_worker.server import start_target_server

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"


def prefilled(runner, prompt: list[int]):
    """A new cache of the runner's holding the prompt."""
    cache = runner.new_cache()
    runner.forward([cache], [prompt], [1])
    return cache


def draft_spec(noise: float) -> str:
    return f"{TARGET},noise={noise}"


@pytest.fixture(scope="session")
def target_model():
    return load_model(TARGET)


@pytest.fixture(scope="session")
def draft_models():
    """Drafts of several qualities: identical weights, close, half agreeing, mostly wrong."""
    return {noise: load_model(draft_spec(noise)) for noise in (0.0, 0.1, 0.5, 1.0)}


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


def wait_until(condition, timeout: float = 5.0, interval: float = 0.02, message: str = ""):
    """The one way a test waits for a state: polls condition() every `interval` seconds until it returns something
    true, and returns that; fails the test once `timeout` seconds have passed (with `message`, or the condition's
    name). In a coroutine, `await wait_until(...)`: it then sleeps on the event loop, and condition may be async.
    Anywhere else (a plain test, a thread) it blocks."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return wait_blocking(condition, timeout, interval, message)
    return wait_async(condition, timeout, interval, message)


def timed_out(condition, timeout: float, message: str) -> AssertionError:
    what = message
    if not what:
        try:
            what = inspect.getsource(condition).strip()  # a lambda: the line that waited
        except (OSError, TypeError):
            what = getattr(condition, "__qualname__", repr(condition))
    return AssertionError(f"waited {timeout} s in vain: {what}")


def wait_blocking(condition, timeout: float, interval: float, message: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise timed_out(condition, timeout, message)
        time.sleep(interval)
    return value


async def wait_async(condition, timeout: float, interval: float, message: str):
    async def check():
        value = condition()
        return await value if inspect.isawaitable(value) else value

    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() > deadline:
            raise timed_out(condition, timeout, message)
        await asyncio.sleep(interval)
    return value


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


def run_quick_bench(output_root: pathlib.Path, suite: str, *extra: str, max_new_tokens: int = 12) -> pathlib.Path:
    """`specdec bench --suite SUITE --quick` as a user runs it, on the tiny pair (target TARGET, draft
    TARGET,noise=0.3); returns the folder of its results."""
    command = [
        sys.executable, "-m", "cli", "bench", "--suite", suite, "--quick", "--name", suite,
        "--output-root", str(output_root), "--target-model", TARGET, "--draft-model", draft_spec(0.3),
        "--max-new-tokens", str(max_new_tokens), *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return output_root / suite
