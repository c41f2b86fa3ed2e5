"""`specdec bench --suite performance`: what batching, adaptive gamma and overlap buy, side by side.

Three experiments, on clusters started here, systems interleaved per prompt and repeat (one pass over the first
prompt warms everything up first and is not counted), medians reported:

1. schedules: the default pair (target + its default draft) at fixed gammas, auto (cost model), Hugging Face's
   heuristic schedule run by our coordinator, auto with overlap, and Hugging Face's own generate (plain and with
   the same draft) in this process;
2. concurrency: 1, 2, 4, 8, 16 clients sending at once, target-only and auto: aggregate tokens/s, and each
   request's milliseconds per token against the single-client figure;
3. overlap: the target and a model draft pinned to separate cores (one thread each), with and without overlap:
   tokens/s, and the share of drafting hidden behind verification.
"""

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from specdec.bench.runner import grpc_run, hf_run, load_prompts, machine_description, run_to_dict
from specdec.common.model_specs import base_model
from specdec.common.models import load_model
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, default_draft_for, free_port
from specdec.draft_worker.specs import is_ngram

QUICK_PROMPTS = ["fix-typos", "palindrome", "capital"]


@dataclass
class PerformanceConfig:
    name: str
    target_model: str = "smollm2-135m"
    draft_model: str | None = None  # default: the target's default draft
    overlap_draft_model: str = "smollm2-135m#int8"
    device: str = "cpu"
    quick: bool = False
    max_new_tokens: int = 48
    repeats: int = 1
    fixed_gammas: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    overlap_gammas: list[int] = field(default_factory=lambda: [1, 2, 3])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 2
    prompt_ids: list[str] | None = None
    output_root: str = "bench/results"

    def __post_init__(self):
        self.draft_model = self.draft_model or default_draft_for(self.target_model)
        if self.quick:
            self.max_new_tokens, self.repeats = min(self.max_new_tokens, 24), 1
            self.fixed_gammas, self.overlap_gammas, self.concurrency = [1, 4], [2], [1, 4]
            self.prompt_ids = self.prompt_ids or QUICK_PROMPTS


def schedules(config: PerformanceConfig, client: GenerationClient, prompts: list[dict], progress: tqdm) -> list[dict]:
    # Hugging Face's baselines run what a transformers user runs: its own linear layers, not the workers' packed ones.
    target = load_model(config.target_model, config.device, linear="eager")
    ngram = is_ngram(config.draft_model)
    draft = None if ngram else load_model(base_model(config.draft_model), config.device, linear="eager")
    eos = target.tokenizer.eos_token_ids
    runs = []
    for repeat, prompt in passes(config, prompts):
        ids = target.tokenizer.render_chat([{"role": "user", "content": prompt["prompt"]}])
        n = config.max_new_tokens
        done = [grpc_run(client, "target-only", prompt, 0, 0.0, repeat, n)]
        done += [grpc_run(client, "fixed", prompt, g, 0.0, repeat, n) for g in config.fixed_gammas]
        done.append(grpc_run(client, "auto", prompt, -1, 0.0, repeat, n))
        done.append(grpc_run(client, "heuristic", prompt, -1, 0.0, repeat, n, gamma_schedule="heuristic"))
        done.append(grpc_run(client, "auto + overlap", prompt, -1, 0.0, repeat, n, overlap=True))
        done.append(hf_run(target.model, None, "HF generate", prompt, ids, 0, n, eos, True))
        hf_label = "HF prompt lookup" if ngram else "HF assisted"
        done.append(hf_run(target.model, draft.model if draft else None, hf_label, prompt, ids, 4, n, eos, ngram))
        progress.update(len(done))
        if repeat:
            runs += [run_to_dict(r) for r in done]
    return runs


def passes(config: PerformanceConfig, prompts: list[dict]):
    """(repeat, prompt) in order: repeat 0 is the warm-up on the first prompt, then every prompt per repeat."""
    yield 0, prompts[0]
    for repeat in range(1, config.repeats + 1):
        for prompt in prompts:
            yield repeat, prompt


def one_client(address: str, prompts: list[dict], first: int, count: int, gamma: int, max_new_tokens: int) -> list[dict]:
    out = []
    with GenerationClient(address) as client:
        for k in range(count):
            prompt = prompts[(first + k) % len(prompts)]
            start = time.perf_counter()
            response = client.generate(
                [{"role": "user", "content": prompt["prompt"]}],
                max_new_tokens=max_new_tokens,
                temperature=0,
                ignore_eos=True,
                num_speculative_tokens=gamma,
                include_rounds=True,
            )
            seconds = time.perf_counter() - start
            batch = [r.target_batch_size for r in response.rounds]
            out.append(
                {
                    "prompt_id": prompt["id"],
                    "tokens": len(response.token_ids),
                    "seconds": seconds,
                    "ms_per_token": 1e3 * seconds / max(len(response.token_ids), 1),
                    "mean_target_batch": statistics.mean(batch) if batch else 0,
                    "drafted": response.speculation.drafted_tokens,
                    "accepted": response.speculation.accepted_tokens,
                    "rounds": response.speculation.rounds,
                    "token_ids": list(response.token_ids),
                }
            )
    return out


def wave(address: str, prompts: list[dict], clients: int, requests_per_client: int, gamma: int, max_new_tokens: int):
    """n clients start together, each sending requests_per_client requests one after another: every request's
    record, and the wall time of the whole wave."""
    with ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        futures = [
            pool.submit(one_client, address, prompts, i, requests_per_client, gamma, max_new_tokens) for i in range(clients)
        ]
        requests = [r for f in futures for r in f.result()]
        return requests, time.perf_counter() - start


def concurrency(config: PerformanceConfig, address: str, prompts: list[dict], progress: tqdm) -> list[dict]:
    """Each level: n clients start together; each sends requests_per_client requests, one after another."""
    levels = []
    for gamma, system in [(0, "target-only"), (-1, "auto")]:
        one_client(address, prompts, 0, 1, gamma, config.max_new_tokens)  # warm-up
        for clients in config.concurrency:
            requests, wall = wave(address, prompts, clients, config.requests_per_client, gamma, config.max_new_tokens)
            levels.append(
                {
                    "system": system,
                    "clients": clients,
                    "wall_seconds": wall,
                    "tokens": sum(r["tokens"] for r in requests),
                    "aggregate_tokens_per_second": sum(r["tokens"] for r in requests) / wall,
                    "median_ms_per_token": statistics.median(r["ms_per_token"] for r in requests),
                    "mean_target_batch": statistics.mean(r["mean_target_batch"] for r in requests),
                    "requests": requests,
                }
            )
            progress.update(clients * config.requests_per_client)
    return levels


def overlap_runs(config: PerformanceConfig, client: GenerationClient, prompts: list[dict], progress: tqdm) -> list[dict]:
    runs = []
    for repeat, prompt in passes(config, prompts):
        n = config.max_new_tokens
        done = [grpc_run(client, "target-only", prompt, 0, 0.0, repeat, n)]
        for g in config.overlap_gammas:
            done.append(grpc_run(client, "fixed", prompt, g, 0.0, repeat, n))
            done.append(grpc_run(client, "fixed + overlap", prompt, g, 0.0, repeat, n, overlap=True))
        done.append(grpc_run(client, "auto", prompt, -1, 0.0, repeat, n))
        done.append(grpc_run(client, "auto + overlap", prompt, -1, 0.0, repeat, n, overlap=True))
        progress.update(len(done))
        if repeat:
            runs += [run_to_dict(r) for r in done]
    return runs


def run_performance(config: PerformanceConfig) -> Path:
    from specdec.bench.performance_report import analyse_performance, write_performance_report

    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(config.prompt_ids)
    started = time.time()
    per_prompt = len(config.fixed_gammas) + 6 + 3 + 2 * len(config.overlap_gammas)
    total = per_prompt * (len(prompts) * config.repeats + 1) + 2 * sum(config.concurrency) * config.requests_per_client
    progress = tqdm(total=total, desc="bench performance", unit="run")
    extra = ["--max-num-speculative-tokens", "8"]
    with Cluster(
        config.target_model, config.draft_model, free_port(), extra, device=config.device, log_dir=out, prefix_cache=False
    ) as cluster:
        with GenerationClient(cluster.address) as client:
            schedule_runs = schedules(config, client, prompts, progress)
        sweep = concurrency(config, cluster.address, prompts, progress)
    # Separate cores, one thread each: what a deployment with the workers on separate devices looks like here.
    separate_cores = len(os.sched_getaffinity(0)) >= 2
    pinned = Cluster(
        config.target_model,
        config.overlap_draft_model,
        free_port(),
        extra,
        device=config.device,
        log_dir=out / "overlap",
        prefix_cache=False,
        target_args=["--cpus", "0", "--threads", "1"] if separate_cores else [],
        draft_args=["--cpus", "1", "--threads", "1"] if separate_cores else [],
    )
    (out / "overlap").mkdir(exist_ok=True)
    with pinned as cluster, GenerationClient(cluster.address) as client:
        overlap = overlap_runs(config, client, prompts, progress)
    progress.close()
    results = {
        "config": asdict(config),
        "machine": machine_description(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_seconds": time.time() - started,
        "schedules": schedule_runs,
        "concurrency": sweep,
        "overlap": overlap,
        "overlap_on_separate_cores": separate_cores,
    }
    results["analysis"] = analyse_performance(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_performance_report(results, out)
    return out
