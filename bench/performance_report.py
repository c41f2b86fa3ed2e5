"""Analysis and Markdown report of `specdec bench --suite performance` (see bench.performance)."""

import statistics
from pathlib import Path


def label(run: dict) -> str:
    return f"{run['system']} {run['gamma']}" if run["system"].startswith("fixed") else run["system"]


def median_tps(runs: list[dict]) -> float:
    return statistics.median(r["tokens_per_second"] for r in runs) if runs else 0.0


def paired_ratio(runs: list[dict], mine: str, base: str) -> float:
    """Median over prompts and repeats of base's seconds per token over mine's (>1: mine is faster)."""
    keyed = {}
    for r in runs:
        keyed.setdefault((r["prompt_id"], label(r)), []).append(r)
    ratios = []
    for (prompt_id, name), group in keyed.items():
        if name != mine or (prompt_id, base) not in keyed:
            continue
        for m, b in zip(group, keyed[(prompt_id, base)], strict=False):
            if m["tokens"] and b["tokens"]:
                ratios.append((b["seconds"] / b["tokens"]) / (m["seconds"] / m["tokens"]))
    return statistics.median(ratios) if ratios else 0.0


def greedy_outputs_identical(runs: list[dict], reference: str = "target-only") -> bool:
    refs = {(r["prompt_id"]): r["token_ids"] for r in runs if label(r) == reference}
    ours = [r for r in runs if not r["system"].startswith("HF")]
    return all(r["token_ids"] == refs[r["prompt_id"]] for r in ours)


def hidden_share(runs: list[dict]) -> float:
    overlapped = sum(r["split_us"].get("draft_overlapped_us", 0) for r in runs)
    exposed = sum(r["split_us"].get("draft_us", 0) for r in runs)
    return overlapped / (overlapped + exposed) if overlapped + exposed else 0.0


def analyse_schedules(runs: list[dict]) -> dict:
    names = sorted({label(r) for r in runs}, key=lambda n: (not n.startswith("target"), n))
    overall = {n: median_tps([r for r in runs if label(r) == n]) for n in names}
    fixed = {n: v for n, v in overall.items() if n.startswith("fixed")}
    best_fixed = max(fixed, key=fixed.get) if fixed else None
    categories = {}
    for category in sorted({r["category"] for r in runs}):
        group = [r for r in runs if r["category"] == category]
        tps = {n: median_tps([r for r in group if label(r) == n]) for n in names}
        fixed_tps = {n: v for n, v in tps.items() if n.startswith("fixed")}
        best = max(fixed_tps, key=fixed_tps.get)
        categories[category] = {
            "tokens_per_second": tps,
            "best_fixed": best,
            "auto_over_best_fixed": tps["auto"] / tps[best] if tps[best] else 0.0,
            "auto_over_heuristic": tps["auto"] / tps["heuristic"] if tps["heuristic"] else 0.0,
        }
    return {
        "tokens_per_second": overall,
        "best_fixed_overall": best_fixed,
        "speedup_over_target_only": {n: paired_ratio(runs, n, "target-only") for n in names},
        "auto_over_heuristic": paired_ratio(runs, "auto", "heuristic"),
        "auto_over_best_fixed": paired_ratio(runs, "auto", best_fixed) if best_fixed else 0.0,
        "categories": categories,
        "greedy_identical": greedy_outputs_identical(runs),
    }


def analyse_concurrency(levels: list[dict]) -> list[dict]:
    rows = []
    for system in sorted({lv["system"] for lv in levels}):
        group = [lv for lv in levels if lv["system"] == system]
        single = next(lv for lv in group if lv["clients"] == min(g["clients"] for g in group))
        reference = {r["prompt_id"]: r["token_ids"] for r in single["requests"]}
        for lv in group:
            rows.append(
                {
                    "system": system,
                    "clients": lv["clients"],
                    "aggregate_tokens_per_second": lv["aggregate_tokens_per_second"],
                    "throughput_ratio": lv["aggregate_tokens_per_second"] / single["aggregate_tokens_per_second"],
                    "median_ms_per_token": lv["median_ms_per_token"],
                    "latency_ratio": lv["median_ms_per_token"] / single["median_ms_per_token"],
                    "mean_target_batch": lv["mean_target_batch"],
                    "outputs_match_single_client": all(
                        r["token_ids"] == reference[r["prompt_id"]] for r in lv["requests"] if r["prompt_id"] in reference
                    ),
                }
            )
    return rows


def analyse_overlap(runs: list[dict]) -> dict:
    names = sorted({label(r) for r in runs}, key=lambda n: (not n.startswith("target"), n))
    pairs = {}
    for name in names:
        if name.endswith("overlap") or "overlap " in name:
            plain = name.replace(" + overlap", "")
            pairs[name] = {
                "over_no_overlap": paired_ratio(runs, name, plain),
                "hidden_draft_share": hidden_share([r for r in runs if label(r) == name]),
            }
    return {
        "tokens_per_second": {n: median_tps([r for r in runs if label(r) == n]) for n in names},
        "speedup_over_target_only": {n: paired_ratio(runs, n, "target-only") for n in names},
        "acceptance": {
            n: sum(r["accepted"] for r in runs if label(r) == n) / max(1, sum(r["drafted"] for r in runs if label(r) == n))
            for n in names
        },
        "overlap": pairs,
        "greedy_identical": greedy_outputs_identical(runs),
    }


def analyse_performance(results: dict) -> dict:
    return {
        "schedules": analyse_schedules(results["schedules"]),
        "concurrency": analyse_concurrency(results["concurrency"]),
        "overlap": analyse_overlap(results["overlap"]),
    }


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_performance_report(results: dict, out: Path) -> None:
    a, config = results["analysis"], results["config"]
    s, o = a["schedules"], a["overlap"]
    parts = [
        f"# specdec performance: {config['name']}",
        f"Target `{config['target_model']}`, draft `{config['draft_model']}`; overlap pair: draft "
        f"`{config['overlap_draft_model']}`. Greedy, {config['max_new_tokens']} new tokens, {config['repeats']} counted "
        f"repeat(s) after a warm-up; {results['machine']['processor']}, torch threads "
        f"{results['machine']['torch_threads']}; {results['duration_seconds'] / 60:.1f} min, started {results['started']}.",
        "## Schedules (default pair, one cluster, medians over prompts)",
        table(
            ["system", "tokens/s", "speedup vs target-only (paired)"],
            [[n, v, s["speedup_over_target_only"].get(n, 0.0)] for n, v in s["tokens_per_second"].items()],
        ),
        f"Best fixed gamma overall: {s['best_fixed_overall']}. Auto over the best fixed (paired): "
        f"{s['auto_over_best_fixed']:.2f}x; auto over the heuristic schedule: {s['auto_over_heuristic']:.2f}x. "
        f"Greedy outputs of our systems identical to target-only: {s['greedy_identical']}.",
        "### By category (tokens/s)",
        table(
            ["category", "best fixed", "best fixed tok/s", "auto", "heuristic", "auto + overlap", "auto / best", "auto / heur."],
            [
                [
                    c,
                    v["best_fixed"],
                    v["tokens_per_second"][v["best_fixed"]],
                    v["tokens_per_second"]["auto"],
                    v["tokens_per_second"]["heuristic"],
                    v["tokens_per_second"]["auto + overlap"],
                    v["auto_over_best_fixed"],
                    v["auto_over_heuristic"],
                ]
                for c, v in s["categories"].items()
            ],
        ),
        "## Concurrency (default pair, greedy, clients sending at once)",
        table(
            [
                "system",
                "clients",
                "aggregate tok/s",
                "x 1 client",
                "median ms/token",
                "latency x 1 client",
                "mean batch",
                "same output",
            ],
            [
                [
                    r["system"],
                    r["clients"],
                    r["aggregate_tokens_per_second"],
                    r["throughput_ratio"],
                    r["median_ms_per_token"],
                    r["latency_ratio"],
                    r["mean_target_batch"],
                    r["outputs_match_single_client"],
                ]
                for r in a["concurrency"]
            ],
        ),
        "## Overlap (target on core 0, draft on core 1, one thread each)",
        table(
            ["system", "tokens/s", "speedup vs target-only", "acceptance"],
            [
                [n, v, o["speedup_over_target_only"].get(n, 0.0), o["acceptance"].get(n, 0.0)]
                for n, v in o["tokens_per_second"].items()
            ],
        ),
        table(
            ["overlapped system", "x without overlap (paired)", "drafting hidden"],
            [[n, v["over_no_overlap"], f"{100 * v['hidden_draft_share']:.0f} %"] for n, v in o["overlap"].items()],
        ),
        f"Greedy outputs identical to target-only: {o['greedy_identical']}.",
    ]
    (out / "report.md").write_text("\n\n".join(parts) + "\n")
