"""Analysis and Markdown report of `specdec bench --suite pair` (see bench.pair)."""

from pathlib import Path

from specdec.bench.pair import ALL_SYSTEMS, CURVE_TOKENS, HF_ASSISTED, HF_GENERATE, SPECDEC_SYSTEMS, TARGET_ONLY
from specdec.bench.performance_report import median_tps, paired_ratio
from specdec.bench.report import figure, table
from specdec.bench.runner import acceptance_by_position
from specdec.common.model_runner import CALIBRATION_CONTEXT

AUTO = "specdec auto (gRPC)"
MEMORY_LIMIT_GIB = 20
CURVE_TARGET_AFTER, CURVE_DRAFT_AFTER = "target after (served)", "draft after (served)"
CURVE_TARGET_BEFORE, CURVE_DRAFT_BEFORE = "target before (eager)", "draft before (eager, float32 base)"


def runs_of(runs: list[dict], system: str) -> list[dict]:
    return [r for r in runs if r["system"] == system]


def acceptance(runs: list[dict]) -> float:
    drafted = sum(r["drafted"] for r in runs)
    return sum(r["accepted"] for r in runs) / drafted if drafted else 0.0


def mean_drafted_per_round(runs: list[dict]) -> float:
    rounds = [drafted for r in runs for drafted, _ in r["positions"]]
    return sum(rounds) / len(rounds) if rounds else 0.0


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def output_checks(runs: list[dict]) -> dict:
    """Greedy outputs against both references (target-only through the services and HF generate), same prompt and
    repeat: one boolean per system and reference, and every mismatch with where it starts."""
    reference_ids = {(r["system"], r["prompt_id"], r["repeat"]): r["token_ids"] for r in runs}
    identical: dict[str, dict[str, bool]] = {}
    mismatches = []
    for system in ALL_SYSTEMS:
        for reference in (TARGET_ONLY, HF_GENERATE):
            if reference == system or (system == HF_GENERATE and reference == TARGET_ONLY):
                continue  # target-only against HF generate is checked once, as target-only's row
            same = True
            for run in runs_of(runs, system):
                expected = reference_ids.get((reference, run["prompt_id"], run["repeat"]))
                if expected is None or expected != run["token_ids"]:
                    same = False
                    mismatches.append(
                        {
                            "system": system,
                            "reference": reference,
                            "prompt_id": run["prompt_id"],
                            "repeat": run["repeat"],
                            "first_difference": first_difference(run["token_ids"], expected or []),
                            "tokens": len(run["token_ids"]),
                            "reference_tokens": len(expected or []),
                        }
                    )
            identical.setdefault(system, {})[reference] = same
    return {
        "identical": identical,
        "all_identical": all(all(v.values()) for v in identical.values()),
        "mismatches": mismatches,
    }


def curve_points(curve: dict) -> dict[int, float]:
    """A curve with int keys (results.json turns them into strings)."""
    return {int(k): v for k, v in curve.items()}


def cost_curve_rows(curves: dict[str, dict]) -> dict[str, dict]:
    """Each curve's ms for 1..9 tokens and each as a ratio to its own 1-token pass: how flat verification is."""
    rows = {}
    for name, curve in curves.items():
        points = curve_points(curve)
        one = points.get(1)
        rows[name] = {"ms": points, "relative": {k: v / one for k, v in points.items()} if one else {}}
    return rows


def step_ratio(curves: dict[str, dict], draft: str, target: str) -> float | None:
    """The draft's cost per proposed token (one 1-token pass) over the target's 1-token step."""
    d, t = curve_points(curves.get(draft, {})).get(1), curve_points(curves.get(target, {})).get(1)
    return d / t if d and t else None


def memory_summary(memory: dict) -> dict:
    cluster = sum(v for v in memory["cluster"].values() if v)
    peak_gib = max(cluster, memory["hf_process"]) / 1024
    return {
        "cluster_peak_rss_mib": memory["cluster"],
        "cluster_total_peak_mib": cluster,
        "hf_process_peak_rss_mib": memory["hf_process"],
        "peak_gib": peak_gib,
        "under_limit": peak_gib < MEMORY_LIMIT_GIB,
    }


def analyse_pair(results: dict) -> dict:
    runs, curves = results["runs"], results["cost_curves_ms"]
    over_target_only = {s: paired_ratio(runs, s, TARGET_ONLY) for s in SPECDEC_SYSTEMS}
    over_hf_generate = {s: paired_ratio(runs, s, HF_GENERATE) for s in [TARGET_ONLY, *SPECDEC_SYSTEMS, HF_ASSISTED]}
    hf_assisted = over_hf_generate[HF_ASSISTED]
    return {
        "tokens_per_second": {s: median_tps(runs_of(runs, s)) for s in ALL_SYSTEMS},
        "speedup_over_target_only": over_target_only,
        "speedup_over_hf_generate": over_hf_generate,
        "hf_assisted_speedup_over_hf_generate": hf_assisted,
        # Each system against its own baseline: what speculation buys here versus what it buys in transformers.
        "auto_speedup_over_hf_assisted_speedup": over_target_only[AUTO] / hf_assisted if hf_assisted else None,
        "acceptance": {s: acceptance(runs_of(runs, s)) for s in SPECDEC_SYSTEMS},
        "mean_drafted_per_round": {s: mean_drafted_per_round(runs_of(runs, s)) for s in SPECDEC_SYSTEMS},
        "acceptance_by_position": {s: acceptance_by_position(runs_of(runs, s)) for s in SPECDEC_SYSTEMS},
        "greedy_outputs": output_checks(runs),
        "cost_curves": cost_curve_rows(curves),
        "draft_step_over_target_step": {
            "after (served)": step_ratio(curves, CURVE_DRAFT_AFTER, CURVE_TARGET_AFTER),
            "after (in process)": step_ratio(curves, "draft as served (in process)", "target packed (in process)"),
            "before (eager)": step_ratio(curves, CURVE_DRAFT_BEFORE, CURVE_TARGET_BEFORE),
        },
        "memory": memory_summary(results["memory_mib"]),
    }


def plot_cost_curves(curves: dict[str, dict], path: Path) -> None:
    with figure(path, (7, 4)) as ax:
        for name, row in curves.items():
            ax.plot(list(row["ms"]), list(row["ms"].values()), "o-", label=name)
        ax.set(xlabel="tokens in one forward pass", ylabel="ms (median)", title="Cost curves before and after packing")
        ax.legend(fontsize="small")


def ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "n/a"


def systems_table(a: dict) -> str:
    rows = [
        [
            s,
            a["tokens_per_second"][s],
            ratio(a["speedup_over_target_only"].get(s)) if s != TARGET_ONLY else "1.00x",
            ratio(a["speedup_over_hf_generate"].get(s)) if s != HF_GENERATE else "1.00x",
            a["acceptance"].get(s, ""),
            a["mean_drafted_per_round"].get(s, ""),
        ]
        for s in ALL_SYSTEMS
    ]
    return table(["system", "tokens/s", "x target-only (gRPC)", "x HF generate", "acceptance", "drafted/round"], rows)


def position_table(a: dict) -> str:
    by_system = a["acceptance_by_position"]
    positions = sorted({p for v in by_system.values() for p in v})
    rows = [[s, *(by_system[s].get(p, "") for p in positions)] for s in by_system]
    return table(["system \\ position", *positions], rows)


def curve_tables(a: dict) -> list[str]:
    curves = a["cost_curves"]
    tokens = list(range(1, CURVE_TOKENS + 1))
    ms = [[n, *(c["ms"].get(k, "") for k in tokens)] for n, c in curves.items()]
    relative = [[n, *(c["relative"].get(k, "") for k in tokens)] for n, c in curves.items()]
    return [table(["curve (ms)", *tokens], ms), table(["curve (x its 1-token pass)", *tokens], relative)]


def output_section(checks: dict) -> list[str]:
    references = [TARGET_ONLY, HF_GENERATE]
    rows = [[s, *(v.get(r, "-") for r in references)] for s, v in checks["identical"].items()]
    parts = [
        f"Greedy outputs identical everywhere: **{checks['all_identical']}** (same prompt and repeat).",
        table(["system", *(f"= {r}" for r in references)], rows),
    ]
    if checks["mismatches"]:
        keys = ["system", "reference", "prompt_id", "repeat", "first_difference", "tokens", "reference_tokens"]
        parts.append(
            table(
                ["system", "reference", "prompt", "repeat", "first different token", "tokens", "reference tokens"],
                [[m[k] for k in keys] for m in checks["mismatches"]],
            )
        )
    return parts


def memory_table(memory: dict) -> str:
    rows = [[f"cluster: {role}", round(mib) if mib else "gone"] for role, mib in memory["cluster_peak_rss_mib"].items()]
    rows.append(["cluster: all services", round(memory["cluster_total_peak_mib"])])
    rows.append(["HF phase (this process)", round(memory["hf_process_peak_rss_mib"])])
    return table(["process", "peak RSS (MiB)"], rows)


def write_pair_report(results: dict, out: Path) -> None:
    a, config, machine = results["analysis"], results["config"], results["machine"]
    plot_cost_curves(a["cost_curves"], out / "cost_curves.png")
    durations = results["durations_seconds"]
    step = a["draft_step_over_target_step"]
    memory = a["memory"]
    parts = [
        f"# specdec pair: {config['name']}",
        f"Target `{config['target_model']}`, draft `{config['draft_model']}` as served (HF assisted: "
        f"`{results['hf_draft_model']}`, float32), device `{config['device']}`. Greedy, at most {config['max_new_tokens']} "
        f"new tokens, prompts {', '.join(config['prompt_ids'])}, {config['repeats']} counted repeat(s) after a warm-up. "
        f"{machine['processor']}, torch {machine['torch']} ({machine['torch_threads']} threads). Took "
        f"{results['duration_seconds'] / 60:.1f} min (cluster start {durations['cluster_start']:.0f} s, HF model loading "
        f"{durations['hf_load']:.0f} s), started {results['started']}. Medians; speedups paired per prompt and repeat.",
        f"**specdec auto is {ratio(a['speedup_over_target_only'][AUTO])} target-only through the same services and "
        f"{ratio(a['speedup_over_hf_generate'][AUTO])} HF generate; HF assisted is "
        f"{ratio(a['hf_assisted_speedup_over_hf_generate'])} HF generate.** Speculation's gain here over its gain in "
        f"transformers: {ratio(a['auto_speedup_over_hf_assisted_speedup'])}.",
        "## Systems",
        systems_table(a),
        "## Acceptance by position",
        "For position i: of the rounds that drafted at least i tokens, the share that accepted at least i.",
        position_table(a),
        "## Greedy outputs",
        *output_section(a["greedy_outputs"]),
        "## Cost curves",
        "Before: transformers' linear layers in this process (the draft's float32 base). After: the workers' own "
        "curves from GetInfo, measured at start-up on the models as served. Target packed (in process): the same "
        f"target packed here, a check of the served curve. Context {CALIBRATION_CONTEXT} tokens, as the workers calibrate.",
        *curve_tables(a),
        f"Draft step over target step (1-token passes): after, measured alone in this process "
        f"{ratio(step['after (in process)'])}; after, as the workers measured at start-up {ratio(step['after (served)'])}; "
        f"before {ratio(step['before (eager)'])}.",
        "![cost curves](cost_curves.png)",
        "## Memory",
        memory_table(memory),
        f"Peak of a phase: {memory['peak_gib']:.1f} GiB (limit {MEMORY_LIMIT_GIB} GiB: "
        f"{'within' if memory['under_limit'] else 'EXCEEDED'}).",
    ]
    (out / "report.md").write_text("\n\n".join(parts) + "\n")
