"""The benchmark's Markdown report and plots, from its results."""

import contextlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from specdec.common.acceptance import expected_tokens  # noqa: E402
from specdec.common.model_specs import base_model  # noqa: E402

PLOTS = ["speedup_vs_gamma.png", "acceptance_by_position.png", "time_split.png", "tokens_per_second.png"]


def table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def figure(path: Path, size=(6, 4)):
    """Axes to draw on, saved to path and closed afterwards."""
    fig, ax = plt.subplots(figsize=size)
    yield ax
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_speedup(analysis: dict, path: Path) -> None:
    rows = analysis["gamma_sweep"]
    gammas = [r["gamma"] for r in rows]
    with figure(path) as ax:
        ax.plot(gammas, [r["measured_speedup"] for r in rows], "o-", label="measured")
        ax.plot(gammas, [r["predicted_speedup"] for r in rows], "--", label="analytic (Leviathan et al.)")
        ax.plot(gammas, [r["corrected_speedup"] for r in rows], ":", label="corrected (cost curve + overhead)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(xlabel="gamma (draft tokens per round)", ylabel="speedup over target-only", title="Speedup versus gamma (greedy)")
        ax.legend()


def plot_acceptance(analysis: dict, path: Path) -> None:
    positions = analysis["acceptance_by_position"]
    with figure(path) as ax:
        ax.bar([int(p) for p in positions], list(positions.values()))
        ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance by position in the round", ylim=(0, 1))


def plot_split(analysis: dict, path: Path) -> None:
    split = analysis["split_ms_per_round_by_gamma"]
    gammas = [str(g) for g in split]
    with figure(path) as ax:
        bottom = [0.0] * len(gammas)
        for name in ("draft_us", "verify_us", "sync_us", "network_us", "coordinator_us"):
            values = [split[g][name] for g in split]
            ax.bar(gammas, values, bottom=bottom, label=name.removesuffix("_us"))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set(xlabel="gamma", ylabel="ms per round (median)", title="Where a round's time goes")
        ax.legend()


def plot_systems(analysis: dict, path: Path) -> None:
    systems = analysis["tokens_per_second_by_system"]
    with figure(path, (7, 4)) as ax:
        ax.barh(list(systems), list(systems.values()))
        ax.set(xlabel="tokens/s (median over prompts)", title="Throughput per system (greedy, one request at a time)")


def plain_draft_note(draft_model: str) -> str:
    base = base_model(draft_model)
    return f" (HF assisted: the plain `{base}`)" if base != draft_model else ""


def write_report(results: dict, out: Path) -> None:
    analysis = results["analysis"]
    for plot, name in zip((plot_speedup, plot_acceptance, plot_split, plot_systems), PLOTS, strict=True):
        plot(analysis, out / name)
    config, machine = results["config"], results["machine"]
    gamma_rows = analysis["gamma_sweep"]
    sections = [
        f"# specdec bench: {config['name']}",
        f"Target `{config['target_model']}`, draft `{config['draft_model']}`{plain_draft_note(config['draft_model'])}, "
        f"device `{config['device']}`; "
        f"{len(set(r['prompt_id'] for r in results['runs']))} prompts, {config['repeats']} counted repeats after one warm-up, "
        f"at most {config['max_new_tokens']} new tokens; started {results['started']}, took {results['duration_seconds']:.0f} s. "
        f"Machine: {machine['processor']}, torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"GPU: {machine['cuda'] or 'none'}. Medians throughout.",
        "Greedy outputs of every speculative system identical to target-only: "
        f"**{analysis['greedy_outputs_identical_to_target_only']}**.",
        "## Systems (greedy, gamma 4 where speculative)",
        table(
            ["system", "tokens/s"],
            [[k, v] for k, v in sorted(analysis["tokens_per_second_by_system"].items(), key=lambda kv: -kv[1])],
        ),
        "![tokens per second](tokens_per_second.png)",
        "## Gamma sweep (greedy, through gRPC) against the analytic model",
        f"Target step {analysis['target_step_ms']:.2f} ms, draft step {analysis['draft_step_ms']:.3f} ms, "
        f"c = T_draft / T_target = {analysis['cost_ratio_c']:.4f}. alpha is the measured acceptance rate. The analytic "
        "model assumes a verify pass costs one target step and no overhead; the corrected model charges each round the "
        "measured cost curve at the number of tokens actually scored and the measured sync + network + coordinator "
        "time per round, against a target-only "
        f"baseline that pays {analysis['baseline_overhead_ms_per_token']:.2f} ms of the same overhead per token.",
        table(
            [
                "gamma",
                "alpha",
                "tokens/round",
                "tokens/s",
                "measured",
                "analytic",
                "corrected",
                "measured/analytic",
                "measured/corrected",
                "overhead ms/round",
            ],
            [
                [
                    r["gamma"],
                    r["alpha"],
                    r["tokens_per_round"],
                    r["tokens_per_second"],
                    r["measured_speedup"],
                    r["predicted_speedup"],
                    r["corrected_speedup"],
                    r["measured_over_predicted"],
                    r["measured_over_corrected"],
                    r["overhead_ms_per_round"],
                ]
                for r in gamma_rows
            ],
        ),
        "![speedup versus gamma](speedup_vs_gamma.png)",
        "## Per prompt (greedy, gamma 4)",
        table(
            ["prompt", "category", "acceptance", "target-only tokens/s", "specdec tokens/s", "speedup"],
            [
                [
                    k,
                    v["category"],
                    v["acceptance"],
                    v["target_only_tokens_per_second"],
                    v["specdec_tokens_per_second"],
                    v["specdec_tokens_per_second"] / v["target_only_tokens_per_second"]
                    if v["target_only_tokens_per_second"]
                    else float("nan"),
                ]
                for k, v in analysis["by_prompt_at_default_gamma"].items()
            ],
        ),
        "## Best gamma per category (median over the category's prompts)",
        table(
            ["category", "best gamma (0 = off)", "tokens/s"],
            [[k, v["gamma"], v["tokens_per_second"]] for k, v in analysis["best_gamma_by_category"].items()],
        ),
        "## Temperature sweep (gamma 4, seeded)",
        table(
            ["temperature", "acceptance", "speedup"],
            [[r["temperature"], r["acceptance"], r["speedup"]] for r in analysis["temperature_sweep"]],
        ),
        "## Acceptance by position",
        table(["position", "acceptance"], [[p, a] for p, a in analysis["acceptance_by_position"].items()]),
        "![acceptance by position](acceptance_by_position.png)",
        "## Time split per round (ms)",
        table(
            ["gamma", "draft", "verify", "sync", "network", "coordinator"],
            [
                [g, *(v[n] for n in ("draft_us", "verify_us", "sync_us", "network_us", "coordinator_us"))]
                for g, v in analysis["split_ms_per_round_by_gamma"].items()
            ],
        ),
        "![time split](time_split.png)",
        "## Cost curve: target forward time by tokens scored",
        table(["tokens", "ms"], [[k, v * 1e3] for k, v in results["cost_curve"].items()]),
        "## Break-even cost ratio c = T_draft / T_target (analytic)",
        table(["alpha \\ gamma", *range(1, 9)], [[a, *row.values()] for a, row in analysis["break_even_cost_ratio"].items()]),
        "Expected tokens per round at alpha 0.7: "
        + ", ".join(f"gamma {g}: {expected_tokens(0.7, g):.2f}" for g in (1, 2, 4, 8))
        + ".",
    ]
    (out / "report.md").write_text("\n\n".join(sections) + "\n")
