"""`specdec bench --suite scale`: pools of workers behind coordinators.

1. throughput and spread: the same concurrent load on one target worker and on two, each worker on cores of its
   own (this machine's cores split between them), behind one coordinator; aggregate tokens/s and how the
   sessions spread over the targets, interleaved over repeats, medians.
2. the fault run: 2 target workers, 2 draft workers and 2 coordinators on loopback (tiny random models), 16
   clients each rotating over both coordinators. A first load measures the spread; during a second one a target
   worker is SIGKILLed and a draft worker SIGTERMed. Every output is compared with its solo target-only greedy
   output; the report counts the sessions reopened on the other target and what the fault cost the requests it
   hit. The killed worker is restarted and must get sessions again.
"""

import json
import os
import queue
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.bench.runner import load_prompts, machine_description, percentile
from specdec.common.config import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL, WorkerConfig
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port
from specdec.v1 import generation_pb2, worker_pb2

TINY_TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
TINY_DRAFT = f"{TINY_TARGET},noise=0.1"
FAULT_PROMPTS = [f"Request {i}: a pool of workers must not change a single token." for i in range(20)]


@dataclass
class LoadResult:
    """What a load did: per request its prompt's index, output, why it stopped speculating ("" if it did not),
    start and end (monotonic seconds)."""

    prompt_index: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    fallback_reasons: list[str] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def latencies(self) -> list[float]:
        return [end - start for start, end in zip(self.starts, self.ends, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return sum(len(ids) for ids in self.token_ids) / self.seconds if self.seconds else 0.0


def run_load(addresses: list[str], prompts: list[str], requests: int, clients: int, events=(), **options) -> LoadResult:
    """`requests` requests from `clients` threads, each a client rotating over the coordinators' addresses; request
    i sends prompts[i % len(prompts)]. events: (completed, fn) pairs: fn() runs once `completed` requests are done."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(requests):
        todo.put(i)
    result, lock = LoadResult(), threading.Lock()
    pending = sorted(events, key=lambda e: e[0])

    def client_thread() -> None:
        with GenerationClient(addresses, timeout=120) as client:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                start = time.monotonic()
                try:
                    response = client.generate(prompts[i % len(prompts)], **options)
                except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the load
                    with lock:
                        result.errors.append(f"request {i}: {error}")
                    continue
                end = time.monotonic()
                with lock:
                    result.prompt_index.append(i % len(prompts))
                    result.token_ids.append(list(response.token_ids))
                    result.fallback_reasons.append(response.speculation.fallback_reason)
                    result.starts.append(start)
                    result.ends.append(end)
                    due = [e for e in pending if e[0] <= len(result.ends) + len(result.errors)]
                    for e in due:
                        pending.remove(e)
                for _, fn in due:
                    fn()

    started = time.monotonic()
    threads = [threading.Thread(target=client_thread) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    return result


def placements(coordinators: list[str], role: int = worker_pb2.WORKER_ROLE_TARGET) -> dict[str, int]:
    """Sessions placed on each member of a pool, summed over the coordinators (their GetStatus)."""
    placed: dict[str, int] = {}
    for address in coordinators:
        with GenerationClient(address) as client:
            for pool in client.status().pools:
                if pool.role == role:
                    for member in pool.members:
                        placed[member.address] = placed.get(member.address, 0) + member.sessions_placed
    return placed


def member_health(coordinator: str, address: str) -> int:
    with GenerationClient(coordinator) as client:
        for pool in client.status().pools:
            for member in pool.members:
                if member.address == address:
                    return member.health
    return generation_pb2.MEMBER_HEALTH_UNSPECIFIED


def shares(placed: dict[str, int]) -> dict[str, float]:
    total = sum(placed.values())
    return {address: count / total for address, count in placed.items()} if total else {}


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {address: count - before.get(address, 0) for address, count in after.items()}


def reopened_sessions(log_dir: Path) -> int:
    return sum(path.read_text().count("reopening it on") for path in log_dir.glob("coordinator*.log"))


def fault_run(log_dir: Path, requests: int = 200, clients: int = 16, max_new_tokens: int = 48) -> dict:
    """The fault run (2 above); returns its figures. The first half of the requests measure the spread, the
    second half takes the faults."""
    options = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    cluster = Cluster(
        TINY_TARGET,
        TINY_DRAFT,
        free_port(),
        ["--gamma", "4", "--poll-interval", "0.2", "--resolve-interval", "1"],
        target_args=["--threads", "1"],
        draft_args=["--threads", "1"],
        log_dir=log_dir,
        targets=2,
        drafts=2,
        coordinators=2,
    )
    with cluster:
        coordinators = cluster.coordinator_addresses
        with GenerationClient(coordinators[0]) as client:
            solo = [list(client.generate(p, num_speculative_tokens=0, **options).token_ids) for p in FAULT_PROMPTS]
        first = requests // 2
        before = placements(coordinators)
        spread_load = run_load(coordinators, FAULT_PROMPTS, first, clients, **options)
        spread = difference(placements(coordinators), before)
        draft_spread = placements(coordinators, worker_pb2.WORKER_ROLE_DRAFT)
        killed = f"unix:{cluster.socket_dir}/target-0.sock"
        fault_at: list[float] = []

        def faults() -> None:
            fault_at.append(time.monotonic())
            cluster.kill("target-0")
            cluster.by_role["draft-1"].send_signal(signal.SIGTERM)

        fault_load = run_load(coordinators, FAULT_PROMPTS, requests - first, clients, [(requests // 10, faults)], **options)
        cluster.restart("target-0")
        deadline = time.monotonic() + 120
        while not all(member_health(c, killed) == generation_pb2.MEMBER_HEALTH_SERVING for c in coordinators):
            if time.monotonic() > deadline:
                raise TimeoutError("the restarted target worker was not seen serving again")
            time.sleep(0.2)
        before_restart = placements(coordinators)
        after_load = run_load(coordinators, FAULT_PROMPTS, 16, 4, **options)
        after_restart = difference(placements(coordinators), before_restart)
    loads = (spread_load, fault_load, after_load)
    mismatches = sum(ids != solo[index] for load in loads for index, ids in zip(load.prompt_index, load.token_ids, strict=True))
    hit = [
        end - start
        for start, end in zip(fault_load.starts, fault_load.ends, strict=True)
        if fault_at and start <= fault_at[0] <= end
    ]
    missed = [
        end - start
        for start, end in zip(fault_load.starts, fault_load.ends, strict=True)
        if not fault_at or not start <= fault_at[0] <= end
    ]
    return {
        "requests": sum(len(load.ends) for load in loads),
        # Per load (spread, fault, after the restart): how many requests stopped speculating, by the reason given.
        "fallbacks": [dict(Counter(r for r in load.fallback_reasons if r)) for load in loads],
        "errors": [e for load in loads for e in load.errors],
        "mismatches": mismatches,
        "spread": spread,
        "spread_shares": shares(spread),
        "draft_spread_shares": shares(draft_spread),
        "reopened_sessions": reopened_sessions(log_dir),
        "requests_in_flight_at_fault": len(hit),
        "latency_hit_median_s": statistics.median(hit) if hit else None,
        "latency_hit_max_s": max(hit) if hit else None,
        "latency_others_median_s": statistics.median(missed) if missed else None,
        "latency_spread_load_median_s": statistics.median(spread_load.latencies),
        "killed": killed,
        "placed_on_killed_after_restart": after_restart.get(killed, 0),
        "after_restart": after_restart,
    }


@dataclass
class ScaleConfig:
    name: str
    target_model: str = DEFAULT_TARGET_MODEL
    draft_model: str = DEFAULT_DRAFT_MODEL
    clients: int = 8
    requests: int = 24
    max_new_tokens: int = 64
    repeats: int = 2
    quick: bool = False
    output_root: str = "bench/results"
    device: str = WorkerConfig.device
    prompt_ids: list[str] | None = None

    def __post_init__(self):
        if self.quick:
            self.requests, self.repeats, self.max_new_tokens = 8, 1, min(self.max_new_tokens, 32)


def split_cores(targets: int) -> dict[str, list[str]]:
    """Each target worker on cores of its own; one worker gets them all."""
    cores = sorted(os.sched_getaffinity(0))
    if targets == 1:
        return {"target": ["--threads", str(len(cores))]}
    per = max(1, len(cores) // targets)
    return {
        f"target-{i}": ["--cpus", ",".join(map(str, cores[i * per : (i + 1) * per] or cores[-1:])), "--threads", str(per)]
        for i in range(targets)
    }


def throughput(config: ScaleConfig, targets: int, prompts: list[str], out: Path) -> dict:
    cluster = Cluster(
        config.target_model,
        config.draft_model,
        free_port(),
        device=config.device,
        log_dir=out / f"targets-{targets}",
        targets=targets,
        instance_args=split_cores(targets),
        prefix_cache=False,
    )
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    with cluster:
        options = {"max_new_tokens": config.max_new_tokens, "temperature": 0, "ignore_eos": True}
        run_load([cluster.address], prompts, config.clients, config.clients, **options)  # warm-up
        before = placements([cluster.address])
        load = run_load([cluster.address], prompts, config.requests, config.clients, **options)
        spread = difference(placements([cluster.address]), before)
    return {
        "targets": targets,
        "tokens_per_second": load.tokens_per_second,
        "latency_median_s": statistics.median(load.latencies),
        "latency_p95_s": percentile(load.latencies, 95),
        "errors": len(load.errors),
        "spread_shares": shares(spread),
    }


def write_report(results: dict, out: Path) -> None:
    config, fault = results["config"], results["fault_run"]
    lines = [
        "# Scale: pools of workers behind coordinators",
        "",
        f"Machine: {results['machine']['processor']}, {results['cores']} cores. Target {config['target_model']}, "
        f"draft {config['draft_model']}, {config['clients']} concurrent clients, {config['requests']} requests of "
        f"{config['max_new_tokens']} tokens per run, {config['repeats']} interleaved repeats (medians).",
        "",
        "## One target worker against two",
        "",
        "Each worker on cores of its own (two: one core each, one thread; one: every core).",
        "",
        "| target workers | tokens/s (median) | latency median (s) | sessions per target |",
        "|---|---|---|---|",
    ]
    for targets, runs in results["throughput"].items():
        spread = " / ".join(f"{share:.0%}" for share in runs[-1]["spread_shares"].values())
        lines.append(
            f"| {targets} | {statistics.median(r['tokens_per_second'] for r in runs):.1f} | "
            f"{statistics.median(r['latency_median_s'] for r in runs):.2f} | {spread} |"
        )
    lines += [
        "",
        "## Fault run",
        "",
        "2 target workers, 2 draft workers, 2 coordinators (tiny random models), 16 clients rotating over both "
        "coordinators. During the second half of the load target-0 is SIGKILLed and draft-1 SIGTERMed; target-0 "
        "is then restarted.",
        "",
        f"- requests: {fault['requests']}, errors: {len(fault['errors'])}, outputs different from solo greedy: "
        f"{fault['mismatches']}",
        f"- sessions per target (spread load): {', '.join(f'{share:.0%}' for share in fault['spread_shares'].values())}; "
        f"per draft: {', '.join(f'{share:.0%}' for share in fault['draft_spread_shares'].values())}",
        f"- requests in flight at the fault: {fault['requests_in_flight_at_fault']}; target sessions reopened: "
        f"{fault['reopened_sessions']}",
        f"- latency of those requests: median {fault['latency_hit_median_s']:.2f} s, max {fault['latency_hit_max_s']:.2f} s; "
        f"of the others in that load: median {fault['latency_others_median_s']:.2f} s",
        f"- sessions placed on the restarted worker in the next 16 requests: {fault['placed_on_killed_after_restart']}",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def run_scale(config: ScaleConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt"] for p in load_prompts(config.prompt_ids)]
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for repeat in range(config.repeats):
        for targets in (1, 2) if repeat % 2 == 0 else (2, 1):
            runs[targets].append(throughput(config, targets, prompts, out))
    fault_dir = out / "fault-run"
    fault_dir.mkdir(exist_ok=True)
    results = {
        "config": asdict(config),
        "machine": machine_description(),
        "cores": len(os.sched_getaffinity(0)),
        "throughput": runs,
        "fault_run": fault_run(fault_dir, requests=40 if config.quick else 200),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, out)
    return out
