"""`specdec bench --suite drafting`: drafting sources on an agent's editing loop, on input-grounded prompts, and under
load.

The editing workload (bench/editing_tasks.json) is what a coding agent sends: the same module revised over several
requests, each carrying the original code and the changes asked so far (rename, add a parameter, add docstrings, fix
a bug), so each answer repeats most of the one before it, including the lines that no longer match the prompt. The
input-grounded workload is the bench's own input-grounded prompts (bench/prompts.json).

Systems, greedy, auto gamma (or a fixed gamma given), each on a cluster of its own (the target worker the same model,
with the default deployment's prefix cache, so that each system meets its own earlier prompts and never another's):
target-only, prompt lookup (`ngram`), suffix trees (`suffix`: this request's text and the recent outputs of the
coordinator's requests), both run in the coordinator as the default deployment runs them, and a model draft where
the target has one (on a draft worker). Per task the systems run in turn, each through all of the task's requests in
order; a warm-up request per cluster (a prompt outside both workloads) is not counted. Reported
per workload and system: tokens/s over all requests, the median per-request speedup over target-only, acceptance,
accepted tokens per round, what proposed the drafting rounds, and whether every output equals target-only's.

The concurrency sweep: 1, 2, 4, 8, 16 clients sending at once (the bench's prompts in turn, 48 tokens each, as the
performance suite's sweep), target-only against auto gamma with the model-free drafts on a draft worker and run in
the coordinator (`--local-draft`, no exchange per round): aggregate tokens/s at each level against target-only's, in
several passes with the systems' order rotated, reported as medians. Its systems take turns on the same prompts, two
to a cluster, so their targets keep no prefix cache (a later system would find its prompt cached by an earlier one).
"""

import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from specdec.bench.performance import wave
from specdec.bench.runner import grpc_run, load_prompts, machine_description, rotated, run_to_dict
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port, model_draft_for

TASKS_FILE = Path(__file__).with_name("editing_tasks.json")
WARM_UP_PROMPT = "capital"  # in neither workload
BASELINE = "target-only"
NO_PREFIX_CACHE = "target-only, no prefix cache"  # what target-only costs without the default's prefix cache
SWEEP_TOKENS = 48


@dataclass
class DraftingConfig:
    name: str
    target_model: str = "smollm2-135m"
    draft_model: str | None = None  # a model draft compared too; default: the target's (coordinator.cluster)
    device: str = "cpu"
    quick: bool = False
    max_new_tokens: int = 320
    repeats: int = 1  # counted passes over both workloads
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 2
    # The drafting systems' draft tokens per round; -1 is auto gamma, what a deployment runs. A fixed gamma compares
    # the sources alone, without the cost model's choice of whether to draft.
    gamma: int = -1
    # Passes over the sweep, the systems' order rotated each time: a level's ratio is the median of its passes'
    # (one wave lasts seconds, and this machine's speed drifts by up to 40 % within minutes).
    sweep_passes: int = 3
    output_root: str = "bench/results"

    def __post_init__(self):
        self.draft_model = self.draft_model or model_draft_for(self.target_model)
        if self.gamma == 0 or self.gamma < -1:
            raise ValueError(f"gamma must be -1 (auto) or at least 1, got {self.gamma}")
        if self.quick:
            self.max_new_tokens = min(self.max_new_tokens, 64)
            self.concurrency, self.requests_per_client, self.sweep_passes = [1, 4], 1, 1


def editing_requests(quick: bool) -> list[list[dict]]:
    """Per task, its requests in order: request k asks for the first k changes."""
    tasks = json.loads(TASKS_FILE.read_text())[: 1 if quick else None]
    out = []
    for task in tasks:
        edits = task["edits"][: 2 if quick else None]
        out.append(
            [
                {
                    "id": f"{task['id']}-{k}",
                    "category": "editing",
                    "prompt": f"Here is a Python module:\n\n```python\n{task['code']}```\n\nMake these changes and return the "
                    "whole module:\n" + "\n".join(f"{i + 1}. {edit}" for i, edit in enumerate(edits[:k])),
                }
                for k in range(1, len(edits) + 1)
            ]
        )
    return out


def grounded_requests(quick: bool) -> list[list[dict]]:
    prompts = [p for p in load_prompts(None) if p["category"] == "input-grounded"]
    return [[p] for p in prompts[: 1 if quick else None]]


class ClusterSpec(NamedTuple):
    draft: str
    local: bool  # the coordinator runs the (model-free) draft
    prefix_cache: bool  # the target keeps one (the default deployment does)
    owner: str = ""  # a system that gets a cluster of its own, the others' alike


def systems(config: "DraftingConfig") -> dict[str, tuple[ClusterSpec, int]]:
    """System -> (its cluster, gamma). Each system has a cluster of its own, with the default deployment's prefix
    cache: an agent's next request repeats its last prompt, and each system then meets its own history, never
    another system's (target-only's cluster runs prompt lookup it never uses)."""
    gamma = config.gamma
    # The model-free drafts run where the default deployment runs them: in the coordinator (coordinator.cluster).
    out = {
        BASELINE: (ClusterSpec("ngram", True, True, BASELINE), 0),
        NO_PREFIX_CACHE: (ClusterSpec("ngram", True, False, NO_PREFIX_CACHE), 0),
        "ngram": (ClusterSpec("ngram", True, True), gamma),
        "suffix": (ClusterSpec("suffix", True, True), gamma),
    }
    if config.draft_model:
        out[f"model ({config.draft_model})"] = (ClusterSpec(config.draft_model, False, True), gamma)
    return out


def sweep_systems(config: "DraftingConfig") -> dict[str, tuple[ClusterSpec, int]]:
    """The sweep's systems take turns on the same prompts, two to a cluster: their targets keep no prefix cache."""
    gamma = config.gamma
    return {
        BASELINE: (ClusterSpec("ngram", False, False), 0),
        "ngram": (ClusterSpec("ngram", False, False), gamma),
        "ngram, local": (ClusterSpec("ngram", True, False), gamma),
        "suffix": (ClusterSpec("suffix", False, False), gamma),
        "suffix, local": (ClusterSpec("suffix", True, False), gamma),
    }


def gamma_text(gamma: int) -> str:
    return "auto gamma" if gamma < 0 else f"gamma {gamma}"


def run_workloads(config: DraftingConfig, clients: dict[ClusterSpec, GenerationClient]) -> list[dict]:
    runs = []
    warm_up = load_prompts([WARM_UP_PROMPT])[0]
    for spec, client in clients.items():
        grpc_run(client, "warm-up", warm_up, -1, 0.0, 0, 16)
        print(f"drafting: warmed up the cluster {spec}", flush=True)
    for repeat in range(1, config.repeats + 1):
        for workload, tasks in (("editing", editing_requests(config.quick)), ("input-grounded", grounded_requests(config.quick))):
            for task in tasks:
                for system, (cluster, gamma) in systems(config).items():
                    for prompt in task:
                        run = grpc_run(clients[cluster], system, prompt, gamma, 0.0, repeat, config.max_new_tokens)
                        runs.append(run_to_dict(run) | {"workload": workload, "repeat": repeat})
                print(f"drafting: {workload} {task[0]['id']} done", flush=True)
    return runs


def concurrency_sweep(config: DraftingConfig, addresses: dict[ClusterSpec, str]) -> list[dict]:
    """Each level: n clients start together, each sending requests_per_client requests one after another; the
    systems in turn at each level, in an order rotated from one level and pass to the next. One row per pass,
    system and level, its ratio against target-only's wave of the same pass and level."""
    prompts = load_prompts(None)
    systems = list(sweep_systems(config).items())
    waves = []
    for sweep_pass in range(config.sweep_passes):
        for i, clients in enumerate(config.concurrency):
            for system, (cluster, gamma) in rotated(systems, sweep_pass + i):
                requests, wall = wave(addresses[cluster], prompts, clients, config.requests_per_client, gamma, SWEEP_TOKENS)
                waves.append(
                    {
                        "system": system,
                        "clients": clients,
                        "pass": sweep_pass,
                        "aggregate_tokens_per_second": sum(r["tokens"] for r in requests) / wall,
                        "median_ms_per_token": statistics.median(r["ms_per_token"] for r in requests),
                        "mean_target_batch": statistics.mean(r["mean_target_batch"] for r in requests),
                        "drafted": sum(r["drafted"] for r in requests),
                        "accepted": sum(r["accepted"] for r in requests),
                        "outputs": {r["prompt_id"]: r["token_ids"] for r in requests},
                    }
                )
            print(f"drafting: pass {sweep_pass + 1}, {clients} clients done", flush=True)
    baseline = {(r["clients"], r["pass"]): r for r in waves if r["system"] == BASELINE}
    reference = {p: ids for r in waves if r["system"] == BASELINE for p, ids in r["outputs"].items()}
    for row in waves:
        row["x_target_only"] = (
            row["aggregate_tokens_per_second"] / baseline[row["clients"], row["pass"]]["aggregate_tokens_per_second"]
        )
        row["identical_to_target_only"] = all(reference[p] == ids for p, ids in row.pop("outputs").items())
    return waves


def sweep_levels(waves: list[dict]) -> list[dict]:
    """Per system and level, over the passes: medians of tokens/s, of ms per token, and of the ratio to target-only."""
    levels = []
    for system, clients in dict.fromkeys((r["system"], r["clients"]) for r in waves):
        mine = [r for r in waves if (r["system"], r["clients"]) == (system, clients)]
        drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
        levels.append(
            {
                "system": system,
                "clients": clients,
                "aggregate_tokens_per_second": statistics.median(r["aggregate_tokens_per_second"] for r in mine),
                "x_target_only": statistics.median(r["x_target_only"] for r in mine),
                "x_target_only_by_pass": [r["x_target_only"] for r in mine],
                "median_ms_per_token": statistics.median(r["median_ms_per_token"] for r in mine),
                "mean_target_batch": statistics.mean(r["mean_target_batch"] for r in mine),
                "drafted": drafted,
                "accepted": accepted,
                "identical_to_target_only": all(r["identical_to_target_only"] for r in mine),
            }
        )
    return levels


def analyse(runs: list[dict]) -> dict:
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        baseline = {(r["prompt_id"], r["repeat"]): r for r in mine if r["system"] == BASELINE}
        rows = {}
        for system in dict.fromkeys(r["system"] for r in mine):
            own = [r for r in mine if r["system"] == system]
            tokens, seconds = sum(r["tokens"] for r in own), sum(r["seconds"] for r in own)
            drafted, accepted, rounds = (sum(r[k] for r in own) for k in ("drafted", "accepted", "rounds"))
            ratios = [r["tokens_per_second"] / baseline[(r["prompt_id"], r["repeat"])]["tokens_per_second"] for r in own]
            sources = [s for r in own for s in r["sources"] if s]
            rows[system] = {
                "requests": len(own),
                "tokens": tokens,
                "tokens_per_second": tokens / seconds if seconds else 0.0,
                "median_speedup": statistics.median(ratios),
                "speedup_of_totals": (tokens / seconds)
                / (sum(b["tokens"] for b in baseline.values()) / sum(b["seconds"] for b in baseline.values())),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "accepted_per_round": accepted / rounds if rounds else 0.0,
                "tokens_per_round": tokens / rounds if rounds else 0.0,
                # What proposed the drafting rounds: the hybrid's choices, the suffix trees' request and global shares.
                "rounds_by_source": {s: sources.count(s) for s in sorted(set(sources))},
                # Of the prompt tokens, those the target reused from its prefix cache (its last requests' prompts).
                "prompt_reused": sum(r.get("cached_prompt_tokens", 0) for r in own)
                / max(1, sum(r.get("prompt_tokens", 0) for r in own)),
                "prefill_share": sum(r["split_us"].get("prefill_us", 0) for r in own) / max(1e-9, seconds * 1e6),
                "identical_to_target_only": all(
                    r["token_ids"] == baseline[(r["prompt_id"], r["repeat"])]["token_ids"] for r in own
                ),
            }
        out[workload] = rows
    editing = out.get("editing", {})
    if "suffix" in editing and "ngram" in editing:
        out["suffix_over_ngram_speedup_editing"] = editing["suffix"]["median_speedup"] / editing["ngram"]["median_speedup"]
    grounded = out.get("input-grounded", {})
    if "suffix" in grounded and "ngram" in grounded:
        out["suffix_over_ngram_speedup_grounded"] = grounded["suffix"]["median_speedup"] / grounded["ngram"]["median_speedup"]
    return out


def sources_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{source} {count}" for source, count in counts.items()) or "-"


def report(results: dict) -> str:
    config, analysis = results["config"], results["analysis"]
    lines = [
        f"# Drafting sources on editing and input-grounded requests: {config['name']}",
        "",
        f"target {config['target_model']} on {config['device']}, greedy, {gamma_text(config['gamma'])}, "
        f"at most {config['max_new_tokens']} new tokens; machine: {results['machine']['processor']}",
        "",
        "Prompt lookup and the suffix trees run in the coordinator, as the default deployment runs them; the model "
        "draft on a draft worker. Each system has a target of its own, with the default prefix cache (prompt "
        "reused: the share of prompt tokens it held; prefill share: of the requests' time).",
        "",
    ]
    for workload in ("editing", "input-grounded"):
        rows = analysis.get(workload)
        if not rows:
            continue
        lines += [
            f"## {workload}",
            "",
            "| system | requests | tokens/s | median speedup | speedup of totals | acceptance | accepted per round | "
            "tokens per round | drafting rounds by source | prompt reused | prefill share | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for system, row in rows.items():
            lines.append(
                f"| {system} | {row['requests']} | {row['tokens_per_second']:.2f} | {row['median_speedup']:.2f} | "
                f"{row['speedup_of_totals']:.2f} | {row['acceptance_rate']:.2f} | {row['accepted_per_round']:.2f} | "
                f"{row['tokens_per_round']:.2f} | {sources_text(row['rounds_by_source'])} | "
                f"{row.get('prompt_reused', 0):.0%} | {row.get('prefill_share', 0):.0%} | {row['identical_to_target_only']} |"
            )
        lines.append("")
    for key in ("suffix_over_ngram_speedup_editing", "suffix_over_ngram_speedup_grounded"):
        if key in analysis:
            lines.append(f"- {key.replace('_', ' ')}: {analysis[key]:.2f}")
    if not results["concurrency"]:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"## Concurrency: clients sending at once, {SWEEP_TOKENS} tokens each, {gamma_text(config['gamma'])}",
        "",
        f"Medians over {config['sweep_passes']} passes (the systems' order rotated); x target-only: the median of each "
        "pass's ratio to target-only's wave at the same level.",
        "",
        "| system | clients | aggregate tok/s | x target-only | by pass | median ms/token | mean target batch | drafted | "
        "acceptance | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(sweep_levels(results["concurrency"]), key=lambda r: (r["system"] != BASELINE, r["system"], r["clients"])):
        acceptance = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
        by_pass = " / ".join(f"{x:.2f}" for x in row["x_target_only_by_pass"])
        lines.append(
            f"| {row['system']} | {row['clients']} | {row['aggregate_tokens_per_second']:.2f} | {row['x_target_only']:.2f} | "
            f"{by_pass} | {row['median_ms_per_token']:.1f} | {row['mean_target_batch']:.2f} | {row['drafted']} | "
            f"{acceptance:.2f} | {row['identical_to_target_only']} |"
        )
    return "\n".join(lines) + "\n"


def run_drafting(config: DraftingConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    sweeping = sweep_systems(config).values() if config.concurrency else []
    wanted = [cluster for cluster, _ in [*systems(config).values(), *sweeping]]
    started = time.perf_counter()
    with ExitStack() as stack:
        clients, addresses = {}, {}
        for i, spec in enumerate(dict.fromkeys(wanted)):
            logs = out / f"cluster-{i}"
            logs.mkdir(exist_ok=True)
            cluster = Cluster(
                config.target_model,
                spec.draft,
                free_port(),
                device=config.device,
                log_dir=logs,
                local_draft=spec.local,
                prefix_cache=spec.prefix_cache,
            )
            cluster.start()
            stack.callback(cluster.stop)
            addresses[spec] = cluster.address
            clients[spec] = stack.enter_context(GenerationClient(cluster.address))
        print(f"drafting: {len(clients)} clusters up in {time.perf_counter() - started:.0f} s", flush=True)
        runs = run_workloads(config, clients)
        sweep = concurrency_sweep(config, addresses)
    results = {"config": asdict(config), "machine": machine_description(), "runs": runs, "concurrency": sweep}
    results["analysis"] = analyse(runs)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    return out
