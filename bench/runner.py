"""Runs every measurement of `specdec bench` side by side: systems interleaved per prompt and repeat, the first
repeat a warm-up that is not counted, medians reported."""

import asyncio
import importlib.resources
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench import analytic
from specdec.common.cached_sequence import CachedSequence
from specdec.common.config import WorkerConfig
from specdec.common.model_specs import base_model
from specdec.common.models import load_model
from specdec.common.protocol import DRAFT_SOURCE_OF
from specdec.common.sampling import SamplingParams
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, default_draft_for, free_port
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.server import build_engine
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.ngram import PromptLookupProposer, find_continuation, parse_ngram
from specdec.draft_worker.specs import is_ngram
from specdec.target_worker.engine import TargetEngine

DEFAULT_GAMMA = 4
QUICK_PROMPTS = ["fix-typos", "palindrome", "capital"]


@dataclass
class BenchConfig:
    name: str
    target_model: str = "smollm2-135m"
    draft_model: str | None = None
    device: str = "cpu"
    quick: bool = False
    max_new_tokens: int = 64
    repeats: int = 2
    gammas: list[int] = field(default_factory=lambda: list(range(1, 9)))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.5, 0.7, 1.0, 1.5])
    prompt_ids: list[str] | None = None
    output_root: str = "bench/results"

    def __post_init__(self):
        self.draft_model = self.draft_model or default_draft_for(self.target_model)
        if self.quick:
            self.max_new_tokens, self.repeats = min(self.max_new_tokens, 32), 1
            self.gammas, self.temperatures = [1, 2, 4], [0.0, 0.7]
            self.prompt_ids = self.prompt_ids or QUICK_PROMPTS


def load_prompts(ids: list[str] | None) -> list[dict]:
    prompts = json.loads(importlib.resources.files("specdec.bench").joinpath("prompts.json").read_text())
    return [p for p in prompts if ids is None or p["id"] in ids]


@dataclass
class Run:
    """One generation: what it produced and how long it took."""

    system: str
    prompt_id: str
    category: str
    gamma: int
    temperature: float
    tokens: int
    seconds: float
    token_ids: list[int]
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    split_us: dict = field(default_factory=dict)
    positions: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per round
    sources: list[str] = field(default_factory=list)  # per round, what proposed its tokens ("" when none drafted)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, reused from the target's prefix cache

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_to_dict(run: Run) -> dict:
    return asdict(run) | {"tokens_per_second": run.tokens_per_second}


def rotated(items: list, turn: int) -> list:
    """items starting at a different one each turn, so that every system takes each place in the order in turn: in a
    fixed order, whatever one system's request leaves behind (its threads still holding the cores, evicted caches)
    always falls on the same next system."""
    start = turn % len(items)
    return items[start:] + items[:start]


def grpc_run(
    client: GenerationClient,
    system: str,
    prompt: dict,
    gamma: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    **options,
) -> Run:
    """One request through the coordinator; options go to the request (e.g. overlap, gamma_schedule)."""
    messages = [{"role": "user", "content": prompt["prompt"]}]
    start = time.perf_counter()
    response = client.generate(
        messages,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        num_speculative_tokens=gamma,
        include_rounds=True,
        **options,
    )
    seconds = time.perf_counter() - start
    split = response.time_split
    return Run(
        system,
        prompt["id"],
        prompt["category"],
        gamma,
        temperature,
        len(response.token_ids),
        seconds,
        list(response.token_ids),
        response.speculation.drafted_tokens,
        response.speculation.accepted_tokens,
        response.speculation.rounds,
        {
            name: getattr(split, name)
            for name in (
                "prefill_us",
                "draft_us",
                "verify_us",
                "sync_us",
                "network_us",
                "handling_us",
                "coordinator_us",
                "total_us",
                "draft_overlapped_us",
                "queue_us",
                "verify_ahead_us",
            )
        },
        [(r.drafted, r.accepted) for r in response.rounds],
        [str(DRAFT_SOURCE_OF.get(r.draft_source, "")) for r in response.rounds],
        response.usage.prompt_tokens,
        response.usage.cached_prompt_tokens,
    )


async def in_process_run(engine, system: str, prompt: dict, ids: list[int], gamma: int, max_new_tokens: int) -> Run:
    start = time.perf_counter()
    result = await engine.generate_all(GenerationParams(ids, SamplingParams(temperature=0), max_new_tokens, gamma))
    seconds = time.perf_counter() - start
    return Run(
        system,
        prompt["id"],
        prompt["category"],
        gamma,
        0.0,
        len(result.token_ids),
        seconds,
        list(result.token_ids),
        result.drafted_tokens,
        result.accepted_tokens,
        len(result.rounds),
    )


def hf_run(
    model, draft_model, system: str, prompt: dict, ids: list[int], gamma: int, max_new_tokens: int, eos: list[int], ngram: bool
) -> Run:
    """Hugging Face transformers' own generate: plain (gamma 0), prompt lookup, or assisted by the draft model."""
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None, pad_token_id=(eos or [0])[0])
    if gamma and ngram:
        kwargs["prompt_lookup_num_tokens"] = gamma
    elif gamma:
        kwargs.update(assistant_model=draft_model, num_assistant_tokens=gamma)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    seconds = time.perf_counter() - start
    new = output[0, len(ids) :].tolist()
    return Run(system, prompt["id"], prompt["category"], gamma, 0.0, len(new), seconds, new)


def cost_curve(runner, context: list[int], max_tokens: int = 9, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one target forward pass over 1..max_tokens new tokens at the given context length."""
    sequence = CachedSequence(runner, context)
    sequence.prefill()
    base = sequence.cache_len
    curve = {}
    for k in range(1, max_tokens + 1):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            sequence.forward(context[-1:] + [1] * (k - 1), k)
            times.append(time.perf_counter() - start)
            sequence.crop_to(base)
        curve[k] = statistics.median(times[1:])
    return curve


def draft_step_seconds(draft_loaded, context: list[int], ngram: tuple[int, int] | None, repeats: int = 20) -> float:
    """Median seconds the draft needs per proposed token."""
    times = []
    if ngram is not None:
        for _ in range(repeats):
            start = time.perf_counter()
            find_continuation(context, 1, *ngram)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    curve = cost_curve(draft_loaded.runner, context, max_tokens=1, repeats=repeats)
    return curve[1]


def cpu_model() -> str:
    """The CPU's model name and the vector extensions the kernels use (reports name the machine by it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = info.split("\n\n")[0]  # the first processor's block
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    name = fields.get("model name", platform.machine())
    flags = set(fields.get("flags", "").split())
    extensions = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in flags]
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{name} (family {family} model {model}, {', '.join(extensions) or 'no AVX2'})"


def machine_description() -> dict:
    return {
        "platform": platform.platform(),
        "processor": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


async def measure(config: BenchConfig, progress: tqdm, client: GenerationClient) -> dict:
    prompts = load_prompts(config.prompt_ids)
    # The in-process engine runs what the workers run (their default engine), so that its row compares transports.
    target = load_model(config.target_model, config.device, engine=WorkerConfig.engine)
    ngram = parse_ngram(config.draft_model) if is_ngram(config.draft_model) else None
    draft = None if ngram else load_model(config.draft_model, config.device, engine=WorkerConfig.engine)
    workers = InProcessWorkers(
        TargetEngine(target), DraftEngine(PromptLookupProposer(*ngram) if ngram else ModelProposer(draft), config.draft_model)
    )
    # Hugging Face's baselines run what a transformers user runs: its own linear layers, not the workers' packed ones.
    hf_target = load_model(config.target_model, config.device, linear="eager")
    hf_draft = None if ngram else load_model(base_model(config.draft_model), config.device, linear="eager")
    engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target.tokenizer)
    eos = target.tokenizer.eos_token_ids
    chats = {p["id"]: target.tokenizer.render_chat([{"role": "user", "content": p["prompt"]}]) for p in prompts}
    runs: list[Run] = []
    for repeat in range(config.repeats + 1):  # repeat 0 warms up every system on the first prompt, not counted
        for prompt in prompts if repeat else prompts[:1]:
            ids, done = chats[prompt["id"]], []
            done.append(grpc_run(client, "target-only (gRPC)", prompt, 0, 0.0, repeat, config.max_new_tokens))
            for gamma in config.gammas:
                done.append(grpc_run(client, "specdec (gRPC)", prompt, gamma, 0.0, repeat, config.max_new_tokens))
            done.append(await in_process_run(engine, "specdec (in-process)", prompt, ids, DEFAULT_GAMMA, config.max_new_tokens))
            done.append(hf_run(hf_target.model, None, "HF generate", prompt, ids, 0, config.max_new_tokens, eos, True))
            hf_label = "HF prompt lookup" if ngram else "HF assisted"
            done.append(
                hf_run(
                    hf_target.model,
                    hf_draft.model if hf_draft else None,
                    hf_label,
                    prompt,
                    ids,
                    DEFAULT_GAMMA,
                    config.max_new_tokens,
                    eos,
                    bool(ngram),
                )
            )
            for temperature in config.temperatures:
                if temperature == 0.0:
                    continue  # the greedy runs above
                done.append(grpc_run(client, "target-only (gRPC)", prompt, 0, temperature, repeat, config.max_new_tokens))
                done.append(grpc_run(client, "specdec (gRPC)", prompt, DEFAULT_GAMMA, temperature, repeat, config.max_new_tokens))
            progress.update(len(done))
            if repeat > 0:
                runs.extend(done)
    context = chats[prompts[0]["id"]] + [1] * (config.max_new_tokens // 2)
    curve = cost_curve(target.runner, context)
    draft_seconds = draft_step_seconds(draft, context, ngram)
    return {
        "runs": [run_to_dict(r) for r in runs],
        "cost_curve": curve,
        "draft_step_seconds": draft_seconds,
    }


def runs_per_prompt(config: BenchConfig) -> int:
    sampled = len([t for t in config.temperatures if t != 0.0])
    return 1 + len(config.gammas) + 3 + 2 * sampled


def run_bench(config: BenchConfig) -> Path:
    """Runs the whole suite; writes results.json, report.md and the plots; returns the output folder."""
    from specdec.bench.report import write_report

    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    progress = tqdm(
        total=runs_per_prompt(config) * (len(load_prompts(config.prompt_ids)) * config.repeats + 1), desc="bench", unit="run"
    )
    extra = ["--max-num-speculative-tokens", str(max(config.gammas))]
    with Cluster(
        config.target_model, config.draft_model, free_port(), extra, device=config.device, log_dir=out, prefix_cache=False
    ) as cluster:
        with GenerationClient(cluster.address) as client:
            measured = asyncio.run(measure(config, progress, client))
    progress.close()
    results = {
        "config": asdict(config),
        "machine": machine_description(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_seconds": time.time() - started,
        **measured,
    }
    results["analysis"] = analyse(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out)
    return out


def median_by(runs: list[dict], key, value) -> dict:
    groups: dict = {}
    for run in runs:
        groups.setdefault(key(run), []).append(value(run))
    return {k: statistics.median(v) for k, v in groups.items()}


def speedups(runs: list[dict], system: str, gamma: int, temperature: float = 0.0) -> list[float]:
    """Per prompt and repeat: target-only time over this configuration's time (same prompt, same repeat order)."""
    base = [r for r in runs if r["system"] == "target-only (gRPC)" and r["temperature"] == temperature]
    mine = [r for r in runs if r["system"] == system and r["gamma"] == gamma and r["temperature"] == temperature]
    pairs = zip(sorted(base, key=lambda r: r["prompt_id"]), sorted(mine, key=lambda r: r["prompt_id"]), strict=True)
    return [b["seconds"] / b["tokens"] * m["tokens"] / m["seconds"] for b, m in pairs if b["tokens"] and m["seconds"]]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def acceptance_by_position(runs: list[dict]) -> dict[int, float]:
    """For position i: of the rounds that drafted at least i tokens, the share that accepted at least i."""
    counts: dict[int, list[int]] = {}
    for run in runs:
        for drafted, accepted in run["positions"]:
            for position in range(1, drafted + 1):
                tally = counts.setdefault(position, [0, 0])
                tally[0] += 1
                tally[1] += accepted >= position
    return {position: hits / rounds for position, (rounds, hits) in sorted(counts.items())}


def overhead_per_round(run: dict) -> float:
    """Seconds per round spent outside the models: sync, network, the workers' handling and the coordinator."""
    split = run["split_us"]
    outside = split["sync_us"] + split["network_us"] + split.get("handling_us", 0) + split["coordinator_us"]
    return outside / max(run["rounds"], 1) / 1e6


def verify_cost(group: list[dict], curve: dict[int, float]) -> float:
    """Mean target time per round for the tokens actually scored: prompt lookup often proposes fewer than gamma."""
    costs = [curve[min(drafted + 1, max(curve))] for run in group for drafted, _ in run["positions"]]
    return statistics.fmean(costs) if costs else curve[1]


def analyse(results: dict) -> dict:
    runs = results["runs"]
    curve = {int(k): v for k, v in results["cost_curve"].items()}
    t_target = curve[1]
    c = results["draft_step_seconds"] / t_target
    greedy_spec = [r for r in runs if r["system"] == "specdec (gRPC)" and r["temperature"] == 0.0]
    baseline_runs = [r for r in runs if r["system"] == "target-only (gRPC)" and r["temperature"] == 0.0]
    baseline_overhead = statistics.median(overhead_per_round(r) for r in baseline_runs)
    gamma_rows = []
    for gamma in sorted({r["gamma"] for r in greedy_spec}):
        group = [r for r in greedy_spec if r["gamma"] == gamma]
        drafted, accepted, rounds = (sum(r[k] for r in group) for k in ("drafted", "accepted", "rounds"))
        alpha = accepted / drafted if drafted else 0.0
        overhead = statistics.median(overhead_per_round(r) for r in group)
        measured = analytic.median(speedups(runs, "specdec (gRPC)", gamma))
        predicted = analytic.predicted_speedup(alpha, gamma, c)
        corrected = analytic.corrected_speedup(
            alpha,
            gamma,
            t_target,
            results["draft_step_seconds"],
            verify_cost(group, curve),
            overhead,
            baseline_overhead,
        )
        gamma_rows.append(
            {
                "gamma": gamma,
                "alpha": alpha,
                "tokens_per_round": sum(r["tokens"] for r in group) / rounds if rounds else 0.0,
                "tokens_per_second": analytic.median([r["tokens_per_second"] for r in group]),
                "measured_speedup": measured,
                "predicted_speedup": predicted,
                "corrected_speedup": corrected,
                "overhead_ms_per_round": overhead * 1e3,
                "measured_over_predicted": measured / predicted if predicted else float("nan"),
                "measured_over_corrected": measured / corrected if corrected else float("nan"),
            }
        )
    temperature_rows = []
    for temperature in sorted({r["temperature"] for r in runs if r["system"] == "specdec (gRPC)"}):
        gamma = DEFAULT_GAMMA if temperature else DEFAULT_GAMMA
        group = [r for r in runs if r["system"] == "specdec (gRPC)" and r["temperature"] == temperature and r["gamma"] == gamma]
        if not group:
            continue
        drafted, accepted = sum(r["drafted"] for r in group), sum(r["accepted"] for r in group)
        temperature_rows.append(
            {
                "temperature": temperature,
                "gamma": gamma,
                "acceptance": accepted / drafted if drafted else 0.0,
                "speedup": analytic.median(speedups(runs, "specdec (gRPC)", gamma, temperature)),
            }
        )
    systems = median_by(
        [r for r in runs if r["temperature"] == 0.0 and r["gamma"] in (0, DEFAULT_GAMMA)],
        lambda r: r["system"],
        lambda r: r["tokens_per_second"],
    )
    best_gamma = {}
    for category in sorted({r["category"] for r in runs}):
        options = {
            0: [
                r["tokens_per_second"]
                for r in runs
                if r["category"] == category and r["system"] == "target-only (gRPC)" and r["temperature"] == 0.0
            ]
        }
        for r in greedy_spec:
            if r["category"] == category:
                options.setdefault(r["gamma"], []).append(r["tokens_per_second"])
        medians = {g: statistics.median(v) for g, v in options.items() if v}
        best_gamma[category] = {"gamma": max(medians, key=medians.get), "tokens_per_second": max(medians.values())}
    split = {}
    for gamma in sorted({r["gamma"] for r in greedy_spec}):
        group = [r for r in greedy_spec if r["gamma"] == gamma]
        split[gamma] = {
            name: statistics.median(r["split_us"][name] / max(r["rounds"], 1) / 1e3 for r in group)
            for name in ("draft_us", "verify_us", "sync_us", "network_us", "coordinator_us")
        }
    identical = all(
        a["token_ids"] == b["token_ids"]
        for a in runs
        if a["system"] == "target-only (gRPC)" and a["temperature"] == 0.0
        for b in runs
        if b["prompt_id"] == a["prompt_id"]
        and b["temperature"] == 0.0
        and b["system"] in ("specdec (gRPC)", "specdec (in-process)")
    )
    by_prompt = {}
    for prompt_id in sorted({r["prompt_id"] for r in greedy_spec}):
        mine = [r for r in greedy_spec if r["prompt_id"] == prompt_id and r["gamma"] == DEFAULT_GAMMA]
        base = [r for r in baseline_runs if r["prompt_id"] == prompt_id]
        drafted = sum(r["drafted"] for r in mine)
        by_prompt[prompt_id] = {
            "category": mine[0]["category"] if mine else "",
            "target_only_tokens_per_second": analytic.median([r["tokens_per_second"] for r in base]),
            "specdec_tokens_per_second": analytic.median([r["tokens_per_second"] for r in mine]),
            "acceptance": sum(r["accepted"] for r in mine) / drafted if drafted else 0.0,
        }
    return {
        "by_prompt_at_default_gamma": by_prompt,
        "cost_ratio_c": c,
        "target_step_ms": t_target * 1e3,
        "baseline_overhead_ms_per_token": baseline_overhead * 1e3,
        "draft_step_ms": results["draft_step_seconds"] * 1e3,
        "gamma_sweep": gamma_rows,
        "temperature_sweep": temperature_rows,
        "acceptance_by_position": acceptance_by_position(greedy_spec),
        "tokens_per_second_by_system": systems,
        "best_gamma_by_category": best_gamma,
        "split_ms_per_round_by_gamma": split,
        "break_even_cost_ratio": {
            alpha: {gamma: analytic.break_even_cost_ratio(alpha, gamma) for gamma in range(1, 9)}
            for alpha in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
        },
        "greedy_outputs_identical_to_target_only": identical,
    }
