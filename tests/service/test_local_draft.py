"""A model-free draft run in the coordinator (`--local-draft`): the same output as target-only, rounds that draft
without a draft worker, and sessions freed however a request ends."""

import asyncio
import contextlib
import subprocess
import sys

import grpc
import pytest

from specdec.common.config import ConfigError
from specdec.common.sampling import SamplingParams
from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig, CoordinatorServerConfig
from specdec.coordinator.local_draft import INLINE_PROMPT_TOKENS, LocalDraftWorkers, open_local_draft
from specdec.coordinator.server import build_engine, connect_workers, start_coordinator_server
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.server import model_free_proposer, start_draft_server
from specdec.v1 import generation_pb2_grpc, worker_pb2
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server
from tests.support.services import draft_engine_for
from tests.support.waiting import wait_until


@contextlib.asynccontextmanager
async def local_draft_services(target_model, spec: str):
    """A target worker over gRPC and a coordinator that drafts with `spec` itself."""
    target_server, target_port = await start_target_server(TargetEngine(target_model))
    draft = DraftEngine(model_free_proposer(spec), spec)
    workers = LocalDraftWorkers(GrpcWorkers(f"127.0.0.1:{target_port}", None), draft)
    engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
    server, port = await start_coordinator_server(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generation_pb2_grpc.GenerationServiceStub(channel), draft
    finally:
        await workers.close()
        await asyncio.gather(server.stop(0), target_server.stop(0))


@pytest.mark.parametrize("spec", ["ngram", "suffix"])
def test_a_local_draft_speculates_with_target_only_output(target_model, spec):
    async def run():
        async with local_draft_services(target_model, spec) as (stub, draft):
            prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
            options = dict(max_new_tokens=40, temperature=0, ignore_eos=True, include_rounds=True)
            reference = await stub.Generate(build_request(prompt, num_speculative_tokens=0, **options))
            for gamma in (-1, 4):
                response = await stub.Generate(build_request(prompt, num_speculative_tokens=gamma, **options))
                assert list(response.token_ids) == list(reference.token_ids)
                speculation = response.speculation
                assert speculation.drafted_tokens > 0 and speculation.accepted_tokens > 0 and not speculation.fallback_reason
                assert {r.draft_source for r in response.rounds if r.drafted} <= {
                    worker_pb2.DRAFT_SOURCE_PROMPT_LOOKUP,
                    worker_pb2.DRAFT_SOURCE_SUFFIX_REQUEST,
                    worker_pb2.DRAFT_SOURCE_SUFFIX_GLOBAL,
                }
                # The draft's time is its proposing alone: no exchange with a worker.
                assert response.time_split.draft_us < response.time_split.verify_us
            await wait_until(lambda: len(draft.sessions) == 0)

    asyncio.run(run())


def test_a_cancelled_opening_of_a_long_prompt_still_frees_its_session():
    """A long prompt is indexed on a thread, which a cancellation cannot stop: its session is closed once it
    exists."""
    draft = DraftEngine(model_free_proposer("suffix"), "suffix")
    opened, open_session = [], draft.open_session

    def counted_open_session(*args):
        opened.append(open_session(*args))
        return opened[-1]

    draft.open_session = counted_open_session

    async def run():
        prompt = list(range(1, 50)) * (4 * INLINE_PROMPT_TOKENS // 49)
        opening = asyncio.ensure_future(open_local_draft(draft, prompt, SamplingParams(temperature=0), 0, None, 0))
        await asyncio.sleep(0)  # one turn of the loop: the opening has handed the prompt to its thread
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        # The thread did open the session the cancelled caller never got, and it was closed all the same.
        await wait_until(lambda: opened and draft.sessions.reserved_kv_tokens == 0 and len(draft.sessions) == 0)
        session = await open_local_draft(draft, prompt, SamplingParams(temperature=0), 0, None, 0)
        assert len(draft.sessions) == 1 and session.prefill_us > 0
        await session.close()
        assert len(draft.sessions) == 0

    asyncio.run(run())


def test_a_local_draft_is_model_free_and_excludes_draft_workers():
    assert CoordinatorServerConfig(target=["t:1"], local_draft="suffix:global=0").local_draft == "suffix:global=0"
    with pytest.raises(ConfigError, match="model-free"):
        CoordinatorServerConfig(target=["t:1"], local_draft="smollm2-135m")
    with pytest.raises(ConfigError, match="exclude"):
        CoordinatorServerConfig(target=["t:1"], draft=["d:1"], local_draft="ngram")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--local-draft", "suffix:depth=x"], "--local-draft suffix:depth=x: model:"),
        (["--local-draft", "smollm2-135m"], "model-free"),
        (["--local-draft", "ngram", "--draft", "localhost:2"], "exclude"),
    ],
)
def test_a_coordinator_with_a_bad_local_draft_refuses_to_start_naming_the_flag(flags, message):
    command = [sys.executable, "-m", "specdec.cli", "serve", "coordinator", "--target", "localhost:1", "--port", "0", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.parametrize("argv,local", [(["up"], True), (["up", "--draft-worker"], False)])
def test_specdec_up_runs_a_model_free_draft_in_the_coordinator_unless_asked_for_a_draft_worker(monkeypatch, argv, local):
    import specdec.coordinator.cluster
    from specdec.cli.main import main

    built = []

    class Started(Exception):
        pass

    class Recorder:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)

        def start(self):
            raise Started

        def stop(self):
            pass

    monkeypatch.setattr(specdec.coordinator.cluster, "Cluster", Recorder)
    monkeypatch.setattr(specdec.coordinator.cluster.signal, "signal", lambda *args: None)  # keep pytest's SIGTERM handler
    with pytest.raises(Started):
        main(argv)
    assert [kwargs["local_draft"] for kwargs in built] == [local]


@pytest.mark.parametrize("kind", ["ngram", 0.5])
def test_a_model_free_draft_of_draft_workers_runs_in_the_coordinator_when_asked_and_a_model_draft_stays_there(
    target_model, draft_models, kind
):
    """--model-free-draft-here: the draft workers' ngram runs in the coordinator (the worker opens no session, the
    output is target-only's and drafts were made); a model draft is still proposed by the workers."""

    async def run():
        target_server, target_port = await start_target_server(TargetEngine(target_model))
        draft_engine = draft_engine_for(draft_models, kind)
        draft_server, draft_port = await start_draft_server(draft_engine)
        settings = CoordinatorServerConfig(
            target=[f"127.0.0.1:{target_port}"], draft=[f"127.0.0.1:{draft_port}"], model_free_draft_here=True
        )
        workers = await connect_workers(settings)
        opened = []
        draft_engine.begin_session = lambda *args, open=draft_engine.begin_session, **kwargs: (
            opened.append(1) or open(*args, **kwargs)
        )
        try:
            engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
            server, port = await start_coordinator_server(engine)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
                options = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
                reference = await stub.Generate(build_request(prompt, num_speculative_tokens=0, **options))
                response = await stub.Generate(build_request(prompt, num_speculative_tokens=4, **options))
            await server.stop(0)
        finally:
            await workers.close()
            await asyncio.gather(target_server.stop(0), draft_server.stop(0))
        assert list(response.token_ids) == list(reference.token_ids)
        assert response.speculation.drafted_tokens > 0
        return isinstance(workers, LocalDraftWorkers), len(opened)

    here, worker_sessions = asyncio.run(run())
    assert (here, worker_sessions > 0) == ((True, False) if kind == "ngram" else (False, True))


def test_model_free_draft_here_takes_draft_workers():
    with pytest.raises(ConfigError, match="--model-free-draft-here"):
        CoordinatorServerConfig(target=["t:1"], model_free_draft_here=True)
