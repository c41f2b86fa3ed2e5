"""The compose cluster run for real: `docker/run-local.sh up` builds the images and brings docker/compose.yaml up
(with docker/compose.local.yaml: host networking, a Debian-made base image, Phoenix as the trace store), and the
tests talk to it as a user does, on 127.0.0.1:50051 (gRPC) and :8000 (OpenAI API), and read the traces back from
the trace store. Skipped where no container engine can start (none installed, or none running and not root) and
with SPECDEC_DOCKER_TESTS=0. The first build takes about 15 minutes on 2 cores; later runs reuse the cached images
(docs/docker.md)."""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import threading
import urllib.request

import grpc
import pytest

from specdec.coordinator.client import GenerationClient, build_request
from specdec.coordinator.cluster import Cluster, free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "run-local.sh"
TARGET = "smollm2-135m"
# The ports the cluster takes on the host's network: the services', their metrics', Phoenix's.
HOST_PORTS = (50051, 50052, 50053, 8000, 9464, 9465, 9466, 4317, 6006)
TRACES = "http://127.0.0.1:6006"
# Repetitive text, so that prompt lookup (the default draft, ngram) finds its continuations and drafts.
PROMPT = "red green blue, red green blue, red green blue, red green"
GREEDY = dict(max_new_tokens=32, temperature=0, num_speculative_tokens=4, ignore_eos=True)


def engine_unavailable() -> str | None:
    if os.environ.get("SPECDEC_DOCKER_TESTS", "1") == "0":
        return "SPECDEC_DOCKER_TESTS=0 turns the container tests off"
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    if not shutil.which("dockerd"):
        return "no Docker engine installed (docker/run-local.sh up installs one, as root)"
    if os.geteuid() != 0:
        return "no Docker engine is running and only root can start one (docker/run-local.sh up does)"
    return None


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def compose(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        COMPOSE_FILE=f"{ROOT / 'docker' / 'compose.yaml'}:{ROOT / 'docker' / 'compose.local.yaml'}",
        COMPOSE_PROJECT_NAME="specdec",
        SPECDEC_BASE_IMAGE="specdec-base:bookworm",
        SPECDEC_TORCH_SPEC="unused",
    )
    return subprocess.run(["docker", "compose", *args], env=env, capture_output=True, text=True, **kwargs)


def container(service: str) -> dict:
    (state,) = json.loads(subprocess.run(["docker", "inspect", f"specdec-{service}-1"], capture_output=True, check=True).stdout)
    return state


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = engine_unavailable()
    if reason:
        pytest.skip(reason)
    taken = [p for p in HOST_PORTS if port_taken(p)]
    if taken and not compose("ps", "--quiet").stdout.strip():  # taken by something else than this cluster
        pytest.skip(f"the cluster shares the host's network and ports {taken} are taken")
    log = tmp_path_factory.mktemp("docker") / "run-local.log"
    with open(log, "w") as out:
        started = subprocess.run(["bash", str(SCRIPT), "up"], stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    if started.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True)
        pytest.fail(f"docker/run-local.sh up failed:\n{log.read_text()[-4000:]}")
    yield
    subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def reference(cluster):
    """The greedy answers of `specdec up` outside the containers (the same models, on free ports)."""
    with Cluster(TARGET, "ngram", free_port(), http_port=None, local_draft=False) as local:
        with GenerationClient(local.address) as client:
            return client.generate(PROMPT, **GREEDY)


def test_grpc_and_openai_answers_speculate_and_equal_specdec_up_outside_containers(cluster, reference):
    import openai

    with GenerationClient("127.0.0.1:50051", timeout=120) as client:
        answer = client.generate(PROMPT, **GREEDY)
    assert answer.speculation.drafted_tokens > 0
    assert list(answer.token_ids) == list(reference.token_ids) and answer.text == reference.text

    http = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", timeout=120)
    completion = http.completions.create(
        model=TARGET, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"num_speculative_tokens": 4, "ignore_eos": True}
    )
    assert completion.choices[0].text == reference.text
    assert completion.model_extra["speculation"]["drafted_tokens"] > 0


def stored_trace(trace_id: str) -> list[dict]:
    url = f"{TRACES}/v1/projects/default/spans?trace_id={trace_id}&limit=1000"
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]
    except OSError:
        return []


def test_one_requests_trace_in_the_trace_store_is_one_tree_over_all_three_services(cluster):
    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
    request = build_request(PROMPT, include_rounds=True, **GREEDY)
    with grpc.insecure_channel("127.0.0.1:50051") as channel:
        from specdec.v1 import generation_pb2_grpc

        answer = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            request, timeout=120, metadata=[("traceparent", f"00-{trace_id}-{caller}-01")]
        )
    rounds, drafting = answer.speculation.rounds, sum(r.drafted > 0 for r in answer.rounds)
    assert drafting > 0

    def complete():
        spans = stored_trace(trace_id)
        names = [s["name"] for s in spans]
        arrived = (
            any(s["parent_id"] == caller for s in spans)
            and names.count("target.verify") == rounds
            and names.count("draft.propose") >= drafting
        )
        return spans if arrived else None

    spans = wait_until(complete, 60, interval=1, message=f"trace {trace_id} in the trace store")
    by_id = {s["context"]["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["parent_id"] == caller]
    assert root["name"] == f"text_completion {TARGET}"
    for span in spans:  # one tree: every span reaches the request's root through spans of this trace
        ancestor = span
        while ancestor is not root:
            ancestor = by_id[ancestor["parent_id"]]
    parent = {s["context"]["span_id"]: by_id.get(s["parent_id"], {}).get("name") for s in spans}
    speculate = [s for s in spans if s["name"] == "speculate"]
    assert len(speculate) == rounds and all(parent[s["context"]["span_id"]] == root["name"] for s in speculate)
    # The workers' spans hang under the coordinator's round: the draft worker's proposals under `draft`, the target
    # worker's verifications under `verify`.
    assert {parent[s["context"]["span_id"]] for s in spans if s["name"] == "draft.propose"} == {"draft"}
    assert {parent[s["context"]["span_id"]] for s in spans if s["name"] == "target.verify"} == {"verify"}
    breakdown = ("specdec.time.draft_us", "specdec.time.verify_us", "specdec.time.sync_us", "specdec.time.network_us")
    for span in speculate:
        assert all(key in flatten(span["attributes"]) for key in breakdown), span["attributes"]


def flatten(attributes: dict, prefix: str = "") -> dict:
    """Phoenix returns dotted attribute names as nested objects ({"specdec": {"time": {...}}}) or flat; both read
    as flat keys here."""
    flat = {}
    for key, value in attributes.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_a_killed_worker_container_fails_the_stream_it_served_at_most_and_restarts(cluster):
    restarts = container("target-worker")["RestartCount"]
    outcome = {}
    first_token = threading.Event()

    def stream():
        try:
            with GenerationClient("127.0.0.1:50051", timeout=120) as client:
                for message in client.stream(PROMPT, max_new_tokens=400, temperature=0, ignore_eos=True):
                    first_token.set()
                    if message.HasField("final"):
                        outcome["finish"] = message.final.finish_reason
        except grpc.RpcError as error:
            outcome["error"] = error.code()
        finally:
            first_token.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first_token.wait(60)
    # The worker's process dies (as on a crash or OOM kill); the container's restart policy brings it back.
    subprocess.run(["docker", "exec", "specdec-target-worker-1", "sh", "-c", "kill -KILL -1"], capture_output=True)
    streaming.join(120)
    assert "finish" in outcome or outcome.get("error") == grpc.StatusCode.UNAVAILABLE, outcome
    wait_until(
        lambda: (
            container("target-worker")["RestartCount"] > restarts
            and container("target-worker")["State"].get("Health", {}).get("Status") == "healthy"
        ),
        120,
        interval=1,
        message="the target worker's container restarted and healthy",
    )

    def next_request_succeeds():
        try:
            with GenerationClient("127.0.0.1:50051", timeout=60) as client:
                return client.generate(PROMPT, **GREEDY)
        except grpc.RpcError:
            return None

    assert wait_until(next_request_succeeds, 60, interval=1).usage.completion_tokens == 32


def test_every_service_stops_on_sigterm_before_its_kill_timeout(cluster):
    stopped = compose("stop", "--timeout", "10", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    for service in ("coordinator", "target-worker", "draft-worker"):
        state = container(service)["State"]
        # 137 would be the SIGKILL docker sends when the timeout passes; a drained service exits by itself.
        assert not state["Running"] and state["ExitCode"] != 137, (service, state)
    assert compose("down", "--timeout", "10", timeout=120).returncode == 0
