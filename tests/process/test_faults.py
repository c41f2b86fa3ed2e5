"""A request finishes correctly when a worker misbehaves: real processes on loopback, faults injected with signals."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port, is_serving
from tests.support.waiting import wait_until

# Each test starts (and breaks) a cluster of processes of its own.
pytestmark = pytest.mark.slow

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
DRAFT = f"{TARGET},noise=0.1"
PROMPT = "Faults must not change a single token of this answer."
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


def wait_serving(address: str, timeout: float = 60) -> None:
    wait_until(lambda: is_serving(address), timeout, interval=0.1, message=f"{address} did not come back")


@pytest.fixture
def cluster(tmp_path):
    # A fixed gamma, so that every round uses the draft worker (auto may skip it: these tiny models cost the same).
    with Cluster(TARGET, DRAFT, free_port(), ["--draft-timeout", "0.5", "--gamma", "4"], log_dir=tmp_path) as running:
        yield running


def stream_with_fault(client: GenerationClient, fault, after_messages: int = 3):
    """Streams LONG greedy tokens, calling fault() after a few deltas; returns (token ids, final message)."""
    ids, final = [], None
    for i, message in enumerate(client.stream(PROMPT, **LONG)):
        if message.HasField("delta"):
            ids += list(message.delta.token_ids)
        else:
            final = message.final
        if i == after_messages:
            fault()
    return ids, final


def speculated(response) -> list[int]:
    """The response's tokens, once checked to come from a request that speculated throughout."""
    assert response.speculation.drafted_tokens > 0 and not response.speculation.fallback_reason, response.speculation
    return list(response.token_ids)


def test_killing_the_draft_mid_request_finishes_target_only_with_identical_output(cluster):
    with GenerationClient(cluster.address) as client:
        reference = speculated(client.generate(PROMPT, **LONG))
        ids, final = stream_with_fault(client, lambda: cluster.kill("draft"))
        assert ids == reference == list(final.token_ids)
        assert final.speculation.rounds > final.speculation.drafted_tokens / 4, "rounds after the fault run without a draft"
        assert final.speculation.fallback_reason == "draft_failed"
        # While the draft is down, requests run target-only at once; once it is back they speculate again.
        down = client.generate(PROMPT, max_new_tokens=20, temperature=0, ignore_eos=True)
        assert down.speculation.drafted_tokens == 0 and list(down.token_ids) == reference[:20]
        assert down.speculation.fallback_reason == "draft_unavailable"
        cluster.restart("draft")
        wait_serving(cluster.draft_address)

        def speculating():
            response = client.generate(PROMPT, max_new_tokens=20, temperature=0)
            return response if response.speculation.drafted_tokens > 0 else None

        back = wait_until(
            speculating, timeout=40, interval=0.5, message="the coordinator did not reconnect to the restarted draft worker"
        )
        assert not back.speculation.fallback_reason


def test_a_hanging_draft_misses_its_round_deadline_and_the_request_goes_on(cluster):
    draft = cluster.by_role["draft"]
    with GenerationClient(cluster.address) as client:
        reference = speculated(client.generate(PROMPT, **LONG))
        try:
            started = time.monotonic()
            ids, final = stream_with_fault(client, lambda: os.kill(draft.pid, signal.SIGSTOP))
            assert ids == reference and time.monotonic() - started < 20
            assert final.speculation.fallback_reason == "draft_timeout"
            assert final.speculation.rounds > final.speculation.drafted_tokens / 4, "rounds after the fault run without a draft"
        finally:
            os.kill(draft.pid, signal.SIGCONT)


def test_restarting_the_target_mid_request_finishes_identically(cluster):
    with GenerationClient(cluster.address) as client:
        reference = list(client.generate(PROMPT, **LONG).token_ids)

        def crash_and_restart():
            cluster.kill("target")
            cluster.restart("target")

        ids, final = stream_with_fault(client, crash_and_restart)
        assert ids == reference == list(final.token_ids), "tokens were repeated or lost across the restart"
        assert speculated(final) == reference, "the target's restart turned speculation off"


def test_a_target_that_stays_down_fails_the_request_with_unavailable(cluster):
    with GenerationClient(cluster.address, timeout=4) as client:
        cluster.kill("target")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            client.generate(PROMPT, **LONG)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target worker unavailable" in error.value.details()
        assert time.monotonic() - started < 4.5


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(cluster):
    coordinator = cluster.by_role["coordinator"]
    with GenerationClient(cluster.address) as client, grpc.insecure_channel(cluster.address) as channel:
        reference = list(client.generate(PROMPT, **LONG).token_ids)
        health = health_pb2_grpc.HealthStub(channel)
        refused = []

        def terminate():
            coordinator.send_signal(signal.SIGTERM)
            wait_until(
                lambda: health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING,
                message="the coordinator did not report NOT_SERVING after SIGTERM",
            )
            with pytest.raises(grpc.RpcError) as error:
                client.generate(PROMPT, max_new_tokens=4)
            refused.append(error.value.code())

        ids, final = stream_with_fault(client, terminate)
        assert ids == reference and final is not None
        assert speculated(final) == reference, "draining turned speculation off"
        assert refused == [grpc.StatusCode.UNAVAILABLE]
    assert coordinator.wait(timeout=20) == 0


def test_coordinator_starts_and_serves_while_the_draft_worker_is_down(tmp_path):
    target_port = free_port()
    serve = [sys.executable, "-m", "specdec.cli", "serve"]
    target = subprocess.Popen([*serve, "target", "--model", TARGET, "--port", str(target_port)], stderr=subprocess.DEVNULL)
    port = free_port()
    coordinator = subprocess.Popen(
        [
            *serve,
            "coordinator",
            "--port",
            str(port),
            "--target",
            f"localhost:{target_port}",
            "--draft",
            f"localhost:{free_port()}",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_serving(f"localhost:{port}", timeout=90)
        with GenerationClient(f"localhost:{port}") as client:
            response = client.generate(PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True)
        assert response.usage.completion_tokens == 10 and response.speculation.drafted_tokens == 0
        assert response.speculation.fallback_reason == "draft_unavailable"
    finally:
        for process in (coordinator, target):
            process.terminate()
            process.wait(timeout=20)
