"""`specdec bench --suite overhead`: what a speculation round costs beyond the models' own compute.

1. per-round overhead: the three services on loopback with a tiny random target (2 layers x 64, so compute is
   small) and the prompt-lookup draft at gamma 4; for each round, its wall time (as the coordinator measured it)
   minus the compute, cache sync and batch queueing the workers reported. Median and p95 in microseconds, with
   the rest of the round split into the workers' handling, the transport and the coordinator.
   Beside it, the floor: the same two sequential round trips between minimal gRPC servers that only answer
   (bench.transport_floor), what any round over gRPC costs on this machine.
2. the split's cost: the same speculation loop on SmolLM2, once through the three services and once with both
   engines in this process (coordinator.in_process), interleaved per prompt; the ratio of seconds per token.
"""

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from specdec.bench.runner import load_prompts, machine_description, percentile
from specdec.bench.transport_floor import measure_floor
from specdec.common.config import DEFAULT_TARGET_MODEL, WorkerConfig
from specdec.common.models import load_model
from specdec.common.sampling import SamplingParams
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.server import build_engine
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.types import GenerationParams
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.target_worker.engine import TargetEngine

TINY_TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
QUICK_PROMPTS = ["fix-typos", "palindrome", "capital"]


@dataclass
class OverheadConfig:
    name: str
    target_model: str = DEFAULT_TARGET_MODEL  # of the split's cost (2); the per-round overhead uses TINY_TARGET
    draft_model: str = "ngram"
    gamma: int = 4
    round_tokens: int = 512  # new tokens per request of the per-round measurement
    round_requests: int = 6
    max_new_tokens: int = 64
    repeats: int = 2
    quick: bool = False
    prompt_ids: list[str] | None = None
    output_root: str = "bench/results"
    device: str = WorkerConfig.device

    def __post_init__(self):
        if self.quick:
            self.round_tokens, self.round_requests, self.repeats = 128, 2, 1
            self.max_new_tokens = min(self.max_new_tokens, 32)
            self.prompt_ids = self.prompt_ids or QUICK_PROMPTS


def round_overheads(response) -> list[dict[str, int]]:
    """Each round's time beyond the workers' compute, sync and queueing, and where it went (µs)."""
    rows = []
    for r in response.rounds:
        split = r.time_split
        compute = split.draft_us + split.verify_us + split.sync_us + split.queue_us
        rows.append(
            {
                "overhead_us": split.total_us - compute,
                "handling_us": split.handling_us,
                "network_us": split.network_us,
                "coordinator_us": split.coordinator_us,
                "verify_us": split.verify_us,
            }
        )
    return rows


def summarise(rows: list[dict[str, int]]) -> dict[str, float]:
    summary = {"rounds": len(rows)}
    for key in ("overhead_us", "handling_us", "network_us", "coordinator_us"):
        values = [row[key] for row in rows]
        summary[f"{key.removesuffix('_us')}_median_us"] = statistics.median(values) if values else 0.0
        summary[f"{key.removesuffix('_us')}_p95_us"] = percentile(values, 0.95)
    return summary


def per_round_overhead(config: OverheadConfig, out: Path, progress: tqdm) -> dict:
    """Per-round overhead on loopback with the tiny random target; the first request warms up and is not counted."""
    prompt = list(range(1, 33))
    rows, per_request = [], []
    with Cluster(TINY_TARGET, config.draft_model, free_port(), device=config.device, log_dir=out) as cluster:
        with GenerationClient(cluster.address) as client:
            for i in range(config.round_requests + 1):
                response = client.generate(
                    prompt,
                    max_new_tokens=config.round_tokens,
                    temperature=0,
                    ignore_eos=True,
                    num_speculative_tokens=config.gamma,
                    include_rounds=True,
                )
                progress.update(1)
                if i == 0:
                    continue
                request_rows = round_overheads(response)
                rows.extend(request_rows)
                per_request.append(summarise(request_rows))
    verify_us = statistics.median(r["verify_us"] for r in rows) if rows else 0
    return {"summary": summarise(rows), "requests": per_request, "floor": measure_floor(int(verify_us))}


def grpc_seconds(client: GenerationClient, ids: list[int], gamma: int, max_new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    response = client.generate(ids, max_new_tokens=max_new_tokens, temperature=0, num_speculative_tokens=gamma)
    return time.perf_counter() - start, len(response.token_ids)


async def in_process_seconds(engine, ids: list[int], gamma: int, max_new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    result = await engine.generate_all(GenerationParams(ids, SamplingParams(temperature=0), max_new_tokens, gamma))
    return time.perf_counter() - start, len(result.token_ids)


async def split_cost(config: OverheadConfig, out: Path, progress: tqdm) -> dict:
    """Seconds per token through the services over the same in this process, per prompt, interleaved."""
    prompts = load_prompts(config.prompt_ids)
    target = load_model(config.target_model, config.device)
    engine = await build_engine(
        InProcessWorkers(
            TargetEngine(target), DraftEngine(PromptLookupProposer.from_spec(config.draft_model), config.draft_model)
        ),
        CoordinatorConfig(),
        tokenizer=target.tokenizer,
    )
    chats = {p["id"]: target.tokenizer.render_chat([{"role": "user", "content": p["prompt"]}]) for p in prompts}
    runs = []
    with Cluster(
        config.target_model, config.draft_model, free_port(), device=config.device, log_dir=out, prefix_cache=False
    ) as cluster:
        with GenerationClient(cluster.address) as client:
            for repeat in range(config.repeats + 1):  # repeat 0 warms up and is not counted
                for prompt in prompts:
                    ids = chats[prompt["id"]]
                    grpc_s, grpc_tokens = grpc_seconds(client, ids, config.gamma, config.max_new_tokens)
                    local_s, local_tokens = await in_process_seconds(engine, ids, config.gamma, config.max_new_tokens)
                    progress.update(2)
                    if repeat and grpc_tokens and grpc_tokens == local_tokens:
                        runs.append({"prompt": prompt["id"], "tokens": grpc_tokens, "grpc_s": grpc_s, "in_process_s": local_s})
    ratios = [r["grpc_s"] / r["in_process_s"] for r in runs]
    return {"runs": runs, "grpc_over_in_process_median": statistics.median(ratios) if ratios else None}


def write_report(results: dict, out: Path) -> None:
    s = results["per_round"]["summary"]
    split = results["split"]
    lines = [
        f"# Round overhead: {results['config']['name']}",
        "",
        f"Machine: {results['machine']['processor']}, {results['machine']['torch_threads']} torch threads.",
        "",
        f"## Per-round overhead ({TINY_TARGET}, {results['config']['draft_model']}, gamma {results['config']['gamma']}, "
        f"{results['config']['round_tokens']} tokens, three services on loopback)",
        "",
        "Wall time of a round minus the compute, cache sync and queueing the workers reported.",
        "",
        "| part | median µs | p95 µs |",
        "|---|---|---|",
    ]
    for key in ("overhead", "handling", "network", "coordinator"):
        lines.append(f"| {key} | {s[f'{key}_median_us']:.0f} | {s[f'{key}_p95_us']:.0f} |")
    floor = results["per_round"]["floor"]
    lines += [
        f"| floor: two round trips between minimal gRPC servers (target computing {floor['work_us']} µs) | "
        f"{floor['median_us']:.0f} | {floor['p95_us']:.0f} |",
        "",
        f"Rounds counted: {s['rounds']}.",
        "",
        f"## The split's cost ({results['config']['target_model']}, {results['config']['draft_model']}, gamma "
        f"{results['config']['gamma']}, {results['config']['max_new_tokens']} tokens)",
        "",
        "| prompt | tokens | gRPC s | in-process s | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in split["runs"]:
        lines.append(
            f"| {r['prompt']} | {r['tokens']} | {r['grpc_s']:.3f} | {r['in_process_s']:.3f} | "
            f"{r['grpc_s'] / r['in_process_s']:.3f} |"
        )
    ratio = split["grpc_over_in_process_median"]
    lines += ["", f"Median gRPC / in-process: **{ratio:.3f}**" if ratio else "No comparable runs.", ""]
    (out / "report.md").write_text("\n".join(lines))


def run_overhead(config: OverheadConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prompts = len(load_prompts(config.prompt_ids))
    progress = tqdm(total=config.round_requests + 1 + 2 * prompts * (config.repeats + 1), desc="bench", unit="run")
    per_round = per_round_overhead(config, out, progress)
    split = asyncio.run(split_cost(config, out, progress))
    progress.close()
    results = {
        "config": asdict(config),
        "machine": machine_description(),
        "duration_seconds": time.time() - started,
        "per_round": per_round,
        "split": split,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out)
    return out
