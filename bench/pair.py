"""`specdec bench --suite pair`: a real draft/target pair (by default qwen2.5-coder-1.5b and its default draft)
against target-only through the same services, Hugging Face's plain `generate`, and Hugging Face's assisted
generation with the same pair; and why: cost curves before and after the packed linear path, acceptance by position.

Two phases, one after the other, so that no big model is held twice at once (a run's peak memory stays under
20 GiB on the reference pair):

1. cluster: the three services as processes; the workers' cost curves as served (GetInfo), then the gRPC systems
   interleaved per prompt and repeat; each service's peak RSS; the cluster stops;
2. Hugging Face: target and the draft's float32 base model in this process with transformers' own linear layers;
   their cost curves ("before"), HF generate and HF assisted interleaved per prompt and repeat; then the target's
   linear layers packed in place and its cost curve measured again (a check of the served curve).

Repeat 0 of each phase is a warm-up on the first prompt and is not counted (bench.performance.passes).
"""

import json
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from specdec.bench.performance import passes
from specdec.bench.runner import cost_curve, grpc_run, hf_run, load_prompts, machine_description, run_to_dict
from specdec.common.model_runner import CALIBRATION_CONTEXT
from specdec.common.model_specs import base_model
from specdec.common.models import load_model
from specdec.common.packed_linear import can_pack, pack_linear_layers
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, default_draft_for, free_port, model_draft_for
from specdec.coordinator.worker_clients import info_from_proto
from specdec.draft_worker.specs import is_ngram
from specdec.v1 import draft_pb2_grpc, target_pb2_grpc, worker_pb2

DEFAULT_PAIR_TARGET = "qwen2.5-coder-1.5b"
PAIR_PROMPTS = ["palindrome", "fix-code", "debounce", "top-salaries", "lru-cache", "rewrite-loop"]
QUICK_PROMPTS = ["palindrome", "lru-cache"]
CURVE_TOKENS = 9  # cost curves over 1..9 tokens: every pass a round of gamma <= 8 feeds the target
HF_GAMMA = 4

TARGET_ONLY = "target-only (gRPC)"
HF_GENERATE = "HF generate"
HF_ASSISTED = "HF assisted"
# (system, gamma, request options); gamma -1 lets the coordinator choose it each round.
GRPC_SYSTEMS = [
    (TARGET_ONLY, 0, {}),
    ("specdec auto (gRPC)", -1, {}),
    ("specdec gamma 4 (gRPC)", 4, {}),
    ("specdec auto + overlap (gRPC)", -1, {"overlap": True}),
]
SPECDEC_SYSTEMS = [name for name, gamma, _ in GRPC_SYSTEMS if gamma]
ALL_SYSTEMS = [name for name, _, _ in GRPC_SYSTEMS] + [HF_GENERATE, HF_ASSISTED]


@dataclass
class PairConfig:
    name: str
    target_model: str = DEFAULT_PAIR_TARGET
    draft_model: str | None = None  # default: the target's model draft (coordinator.cluster.MODEL_DRAFTS)
    device: str = "cpu"
    quick: bool = False
    max_new_tokens: int = 64
    repeats: int = 2
    prompt_ids: list[str] | None = None
    output_root: str = "bench/results"

    def __post_init__(self):
        self.draft_model = self.draft_model or model_draft_for(self.target_model) or default_draft_for(self.target_model)
        if is_ngram(self.draft_model):
            raise ValueError(f"the pair suite compares a model draft with HF assisted generation; got {self.draft_model!r}")
        if self.quick:
            self.max_new_tokens, self.repeats = min(self.max_new_tokens, 32), 1
            self.prompt_ids = self.prompt_ids or QUICK_PROMPTS
        self.prompt_ids = self.prompt_ids or PAIR_PROMPTS


def peak_rss_mib(pid: int) -> float | None:
    """A live process's peak resident memory (VmHWM), MiB; None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) / 1024 if line else None


def own_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def curve_ms(curve: dict[int, float]) -> dict[int, float]:
    return {k: seconds * 1e3 for k, seconds in curve.items()}


def served_info(address: str, stub_class) -> dict:
    """A worker's GetInfo: the model as served and the cost curve it measured at start-up (tokens 1..9 kept)."""
    with grpc.insecure_channel(address) as channel:
        info = info_from_proto(stub_class(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=30))
    curve = {tokens: ms for tokens, ms in info.forward_costs if tokens <= CURVE_TOKENS}
    return {"model": info.model_name, "device": info.device, "dtype": info.dtype, "cost_curve_ms": curve}


def grpc_runs(config: PairConfig, client: GenerationClient, prompts: list[dict], progress: tqdm) -> list[dict]:
    runs = []
    for repeat, prompt in passes(config, prompts):
        for system, gamma, options in GRPC_SYSTEMS:
            run = grpc_run(client, system, prompt, gamma, 0.0, repeat, config.max_new_tokens, **options)
            progress.update()
            if repeat:
                runs.append(run_to_dict(run) | {"repeat": repeat})
    return runs


def cluster_phase(config: PairConfig, prompts: list[dict], out: Path, progress: tqdm) -> dict:
    progress.write(
        f"pair: phase 1/2, starting the cluster (target {config.target_model}, draft {config.draft_model}); each worker "
        "loads its model and measures its cost curve first: minutes on the real pair"
    )
    started = time.perf_counter()
    extra = ["--max-num-speculative-tokens", "8"]
    cluster = Cluster(
        config.target_model, config.draft_model, free_port(), extra, device=config.device, log_dir=out, prefix_cache=False
    )
    cluster.start()
    try:
        start_seconds = time.perf_counter() - started
        served = {
            "target": served_info(cluster.target_address, target_pb2_grpc.TargetServiceStub),
            "draft": served_info(cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
        }
        progress.write(f"pair: cluster up in {start_seconds:.0f} s; gRPC runs")
        with GenerationClient(cluster.address) as client:
            runs = grpc_runs(config, client, prompts, progress)
        # Read before stopping: VmHWM is gone with the process.
        memory = {role: peak_rss_mib(process.pid) for role, process in cluster.by_role.items()}
    finally:
        progress.write("pair: stopping the cluster")
        cluster.stop()
    return {
        "runs": runs,
        "served": served,
        "cluster_peak_rss_mib": memory,
        "cluster_start_seconds": start_seconds,
        "cluster_phase_seconds": time.perf_counter() - started,
    }


def hf_runs(config: PairConfig, target, draft, prompts: list[dict], progress: tqdm) -> list[dict]:
    eos = target.tokenizer.eos_token_ids
    runs = []
    for repeat, prompt in passes(config, prompts):
        ids = target.tokenizer.render_chat([{"role": "user", "content": prompt["prompt"]}])
        n = config.max_new_tokens
        done = [
            hf_run(target.model, None, HF_GENERATE, prompt, ids, 0, n, eos, False),
            hf_run(target.model, draft.model, HF_ASSISTED, prompt, ids, HF_GAMMA, n, eos, False),
        ]
        progress.update(len(done))
        if repeat:
            runs += [run_to_dict(r) | {"repeat": repeat} for r in done]
    return runs


def curve_context(target, prompt: dict) -> list[int]:
    """The first prompt's chat tokens, repeated to the context length the workers calibrate at, so that the curves
    measured here compare with the served ones."""
    chat = target.tokenizer.render_chat([{"role": "user", "content": prompt["prompt"]}])
    return (chat * (CALIBRATION_CONTEXT // len(chat) + 1))[:CALIBRATION_CONTEXT]


def hf_phase(config: PairConfig, prompts: list[dict], progress: tqdm) -> dict:
    draft_base = base_model(config.draft_model)
    progress.write(f"pair: phase 2/2, loading {config.target_model} and {draft_base} in this process (transformers' linear)")
    started = time.perf_counter()
    target = load_model(config.target_model, config.device, linear="eager")
    draft = load_model(draft_base, config.device, linear="eager")
    load_seconds = time.perf_counter() - started
    progress.write(f"pair: loaded in {load_seconds:.0f} s; cost curves before packing")
    context = curve_context(target, prompts[0])
    curves = {
        "target before (eager)": curve_ms(cost_curve(target.runner, context, CURVE_TOKENS)),
        "draft before (eager, float32 base)": curve_ms(cost_curve(draft.runner, context, CURVE_TOKENS)),
    }
    progress.write("pair: HF generate and HF assisted")
    runs = hf_runs(config, target, draft, prompts, progress)
    if can_pack(target.model):
        progress.write("pair: packing the target's linear layers in place; its cost curve again")
        pack_linear_layers(target.model)
        curves["target packed (in process)"] = curve_ms(cost_curve(target.runner, context, CURVE_TOKENS))
    # The served curves were measured while both workers calibrated at once on shared cores; the draft as served,
    # measured here alone, is the honest cost of one drafted token.
    # HF's generate reads these too; kept so that a difference from our greedy outputs can be traced.
    generation_config = {
        "target": target.model.generation_config.to_diff_dict(),
        "draft": draft.model.generation_config.to_diff_dict(),
    }
    del draft  # the float32 draft HF used: not held beside the one loaded next
    progress.write(f"pair: loading {config.draft_model} as the draft worker serves it; its cost curve")
    served_draft = load_model(config.draft_model, config.device)
    curves["draft as served (in process)"] = curve_ms(cost_curve(served_draft.runner, context, CURVE_TOKENS))
    return {
        "runs": runs,
        "curves": curves,
        "draft_base": draft_base,
        "generation_config": generation_config,
        "peak_rss_mib": own_peak_rss_mib(),
        "load_seconds": load_seconds,
        "hf_phase_seconds": time.perf_counter() - started,
    }


def passes_count(config: PairConfig, prompts: list[dict]) -> int:
    return len(list(passes(config, prompts)))


def run_pair(config: PairConfig) -> Path:
    """Runs both phases; writes results.json, report.md and cost_curves.png; returns the output folder."""
    from specdec.bench.pair_report import analyse_pair, write_pair_report

    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(config.prompt_ids)
    started = time.time()
    total = passes_count(config, prompts) * (len(GRPC_SYSTEMS) + 2)
    progress = tqdm(total=total, desc="bench pair", unit="run")
    cluster = cluster_phase(config, prompts, out, progress)
    hf = hf_phase(config, prompts, progress)
    progress.close()
    served = cluster["served"]
    results = {
        "config": asdict(config),
        "machine": machine_description(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_seconds": time.time() - started,
        "durations_seconds": {
            "cluster_start": cluster["cluster_start_seconds"],
            "cluster_phase": cluster["cluster_phase_seconds"],
            "hf_load": hf["load_seconds"],
            "hf_phase": hf["hf_phase_seconds"],
        },
        "served_models": {role: {k: v for k, v in info.items() if k != "cost_curve_ms"} for role, info in served.items()},
        "hf_draft_model": hf["draft_base"],
        "hf_generation_config": hf["generation_config"],
        "cost_curves_ms": {
            **hf["curves"],
            "target after (served)": served["target"]["cost_curve_ms"],
            "draft after (served)": served["draft"]["cost_curve_ms"],
        },
        "memory_mib": {"cluster": cluster["cluster_peak_rss_mib"], "hf_process": hf["peak_rss_mib"]},
        "runs": cluster["runs"] + hf["runs"],
    }
    results["analysis"] = analyse_pair(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_pair_report(results, out)
    return out
