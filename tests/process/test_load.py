"""Load: 32 concurrent clients, 520 requests in four waves, mixed greedy and seeded sampling, some cancelled
mid-stream. Every request that was not cancelled returns exactly the tokens it returns when run alone; the
workers' sessions return to zero; the services' memory does not grow from wave to wave."""

import concurrent.futures
import random

import grpc
import pytest

from specdec.coordinator.client import GenerationClient, build_request
from specdec.coordinator.cluster import Cluster, free_port
from specdec.v1 import draft_pb2_grpc, generation_pb2_grpc, target_pb2_grpc, worker_pb2
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
DRAFT = f"{TARGET},noise=0.3"
CLIENTS = 32
WAVES = 4
REQUESTS_PER_WAVE = 130
PROMPTS = [f"Load test prompt number {i}: {'abc ' * (i % 5)}" for i in range(12)]


def request_spec(index: int) -> dict:
    """Half greedy, half seeded sampling (reproducible), with varied lengths and gamma."""
    rng = random.Random(index)
    spec = {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_new_tokens": rng.choice([4, 8, 16]),
        "num_speculative_tokens": rng.choice([0, 2, 4]),
        "ignore_eos": True,
    }
    if index % 2:
        spec.update(temperature=0.9, top_p=0.95, seed=index % 40)
    else:
        spec.update(temperature=0)
    return spec


def spec_key(spec: dict) -> tuple:
    return tuple(sorted(spec.items()))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def run_one(address: str, index: int, cancel: bool):
    spec = request_spec(index)
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = build_request(spec.pop("prompt"), **spec)
        if cancel:
            call = stub.GenerateStream(request)
            next(call)
            call.cancel()
            return index, None
        response = stub.Generate(request, timeout=120)
        assert response.speculation.fallback_reason == "", f"request {index} fell back: {response.speculation.fallback_reason}"
        return index, list(response.token_ids)


def active_sessions(cluster) -> tuple[int, int]:
    with grpc.insecure_channel(cluster.target_address) as t, grpc.insecure_channel(cluster.draft_address) as d:
        target = target_pb2_grpc.TargetServiceStub(t).GetInfo(worker_pb2.GetInfoRequest()).active_sessions
        draft = draft_pb2_grpc.DraftServiceStub(d).GetInfo(worker_pb2.GetInfoRequest()).active_sessions
    return target, draft


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # 32 clients on 2 cores queue each draft step behind the others: a generous per-round draft deadline keeps this a
    # test of correctness under load (test_faults covers the deadline itself).
    with Cluster(TARGET, DRAFT, free_port(), ["--draft-timeout", "60"], log_dir=tmp_path_factory.mktemp("load")) as running:
        yield running


def test_concurrent_load_with_cancellations_loses_nothing_and_leaks_nothing(cluster):
    specs = {spec_key(request_spec(i)): i for i in range(WAVES * REQUESTS_PER_WAVE)}
    with GenerationClient(cluster.address) as client:
        reference = {}
        for key, index in specs.items():
            spec = request_spec(index)
            reference[key] = list(client.generate(spec.pop("prompt"), **spec).token_ids)

    memory, served, cancelled = [], 0, 0
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        for wave in range(WAVES):
            indices = range(wave * REQUESTS_PER_WAVE, (wave + 1) * REQUESTS_PER_WAVE)
            futures = [pool.submit(run_one, cluster.address, i, cancel=(i % 9 == 4)) for i in indices]
            for future in concurrent.futures.as_completed(futures):
                index, token_ids = future.result()
                if token_ids is None:
                    cancelled += 1
                    continue
                assert token_ids == reference[spec_key(request_spec(index))], f"request {index} differs from its solo run"
                served += 1
            wait_until(lambda: active_sessions(cluster) == (0, 0), interval=0.05, message=f"sessions left after wave {wave}")
            memory.append({role: rss_kib(p.pid) for role, p in cluster.by_role.items()})

    print(
        f"\nserved {served}, cancelled {cancelled}, RSS per wave (MiB): "
        + "; ".join(", ".join(f"{role} {kib / 1024:.0f}" for role, kib in wave.items()) for wave in memory)
    )
    assert served + cancelled == WAVES * REQUESTS_PER_WAVE and cancelled >= 50
    for role in memory[0]:
        # The first wave warms allocator pools and caches; after it, memory must stay flat.
        growth = memory[-1][role] - memory[1][role]
        assert growth < max(0.1 * memory[1][role], 32 * 1024), f"{role} grew by {growth} KiB across waves"
