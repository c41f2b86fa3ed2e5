"""`specdec bench --quick` end to end on tiny random models: the report's files and fields are there."""

import json

import pytest

from tests.support.services import TARGET

from tests.support.bench_runs import run_quick_bench


@pytest.mark.slow
def test_quick_bench_writes_json_report_and_plots(tmp_path):
    out = run_quick_bench(tmp_path, "speedup", max_new_tokens=16)
    for name in (
        "results.json",
        "report.md",
        "speedup_vs_gamma.png",
        "acceptance_by_position.png",
        "time_split.png",
        "tokens_per_second.png",
    ):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    analysis = results["analysis"]
    systems = set(analysis["tokens_per_second_by_system"])
    assert systems == {"target-only (gRPC)", "specdec (gRPC)", "specdec (in-process)", "HF generate", "HF assisted"}
    assert [row["gamma"] for row in analysis["gamma_sweep"]] == [1, 2, 4]
    for row in analysis["gamma_sweep"]:
        assert (
            0 <= row["alpha"] <= 1
            and row["measured_speedup"] > 0
            and row["predicted_speedup"] > 0
            and row["corrected_speedup"] > 0
        )
    assert [row["temperature"] for row in analysis["temperature_sweep"]] == [0.0, 0.7]
    assert set(analysis["best_gamma_by_category"]) == {"input-grounded", "code", "factual"}
    assert list(results["cost_curve"]) == [str(k) for k in range(1, 10)]
    assert analysis["greedy_outputs_identical_to_target_only"] is True
    assert "1" in analysis["acceptance_by_position"]
    report = (out / "report.md").read_text()
    for heading in ("Gamma sweep", "Best gamma per category", "Temperature sweep", "Break-even cost ratio", "Cost curve"):
        assert heading in report


@pytest.mark.slow
def test_quick_performance_bench_reports_schedules_concurrency_and_overlap(tmp_path):
    out = run_quick_bench(tmp_path, "performance", "--overlap-draft-model", f"{TARGET},noise=0.1")
    assert (out / "report.md").stat().st_size > 0
    analysis = json.loads((out / "results.json").read_text())["analysis"]
    schedules = analysis["schedules"]
    assert {"target-only", "fixed 1", "fixed 4", "auto", "heuristic", "auto + overlap", "HF generate", "HF assisted"} == set(
        schedules["tokens_per_second"]
    )
    assert schedules["greedy_identical"] and analysis["overlap"]["greedy_identical"]
    assert [(r["system"], r["clients"]) for r in analysis["concurrency"]] == [
        ("auto", 1),
        ("auto", 4),
        ("target-only", 1),
        ("target-only", 4),
    ]
    assert all(r["outputs_match_single_client"] for r in analysis["concurrency"])
    assert max(r["mean_target_batch"] for r in analysis["concurrency"]) > 1
    overlap = analysis["overlap"]["overlap"]
    assert set(overlap) == {"fixed + overlap 2", "auto + overlap"}
    assert 0 <= overlap["fixed + overlap 2"]["hidden_draft_share"] <= 1


def test_the_llama_cpp_report_rates_against_the_best_llama_cpp_configuration_and_the_parallel_server():
    """The llama-cpp suite needs llama-cpp-python (an sdist build CI does not run); its tables are checked here on
    rows of the shape it records."""
    from specdec.bench.llama_cpp import CONCURRENT_CLIENTS, LlamaCppConfig, report, summarise, summarise_concurrent

    def row(system, seconds, repeat=1, category="code"):
        return {"system": system, "category": category, "repeat": repeat, "tokens": 48, "seconds": seconds}

    rows = [row("specdec auto (ngram)", 4.0), row("llama.cpp", 6.0), row("llama-server", 3.0), row("llama.cpp", 1.0, repeat=0)]
    waves = [
        {"system": "specdec auto (ngram)", "repeat": 1, "tokens": 384, "seconds": 12.0},
        {"system": f"llama-server -np {CONCURRENT_CLIENTS}", "repeat": 1, "tokens": 384, "seconds": 16.0},
        {"system": "specdec auto (ngram)", "repeat": 0, "tokens": 384, "seconds": 99.0},  # warm-up: not counted
    ]
    text = report(LlamaCppConfig(name="t"), {}, summarise(rows), {}, {}, summarise_concurrent(waves))
    assert "| specdec auto (ngram) | 12.00 | 0.75 |" in text  # against llama-server, the best at 16 tok/s
    assert f"## {CONCURRENT_CLIENTS} concurrent clients" in text
    assert "| specdec auto (ngram) | 32.00 | 1.33 |" in text


def test_the_prefill_report_shows_each_streams_worst_gap_in_one_pass_and_in_chunks():
    """The prefill suite takes minutes on SmolLM2 (a 4,000-token prompt); its table is checked here on rows of the
    shape it records."""
    from specdec.bench.prefill_interference import PrefillConfig, report_markdown

    def row(chunk, worst, unchanged=True):
        return {
            "chunk": chunk,
            "repeat": 0,
            "worst_gap_ms": worst,
            "median_gap_ms": 40.0,
            "median_gap_alone_ms": 38.0,
            "prefill_s": 20.0,
            "outputs_unchanged": unchanged,
        }

    from dataclasses import asdict

    report = {
        "config": asdict(PrefillConfig(name="t")),
        "machine": {"processor": "x86_64", "torch_threads": 2},
        "rows": [row(None, [21000.0] * 4), row(256, [1800.0, 1900.0, 2000.0, 2100.0], unchanged=False)],
    }
    text = report_markdown(report)
    assert "| one pass | 21000 / 21000 / 21000 / 21000 | 40 | 38 | 20.00 | yes | none |" in text
    assert "| chunks of 256 | 1800 / 1900 / 2000 / 2100 | 40 | 38 | 20.00 | NO | none |" in text


@pytest.mark.slow
def test_quick_drafting_bench_compares_the_drafting_sources_on_both_workloads_and_under_load(tmp_path):
    # A fixed gamma: whether auto gamma drafts is the cost model's call on these tiny models' timings, which are noise
    # on a loaded machine (it priced drafting out of a whole run in CI); test_gamma_policy proves its choices.
    out = run_quick_bench(tmp_path, "drafting", "--gamma", "3")
    results = json.loads((out / "results.json").read_text())
    analysis = results["analysis"]
    for workload in ("editing", "input-grounded"):
        rows = analysis[workload]
        no_cache = "target-only, no prefix cache"
        assert set(rows) == {"target-only", no_cache, "ngram", "suffix", f"model ({TARGET},noise=0.3)"}
        assert all(row["identical_to_target_only"] for row in rows.values())
        assert rows["target-only"]["drafted"] == rows[no_cache]["drafted"] == 0 and rows["suffix"]["drafted"] > 0
    # Request k of a task asks for the first k changes of the same module: two requests, in order.
    editing_ids = [r["prompt_id"] for r in results["runs"] if r["workload"] == "editing" and r["system"] == "suffix"]
    assert editing_ids == ["inventory-1", "inventory-2"]
    report = (out / "report.md").read_text()
    assert "suffix over ngram speedup editing" in report and "greedy, gamma 3," in report
    sweep = results["concurrency"]
    systems = {"target-only", "ngram", "ngram, local", "suffix", "suffix, local"}
    assert sorted((r["system"], r["clients"]) for r in sweep) == sorted((s, n) for s in systems for n in (1, 4))
    assert all(r["identical_to_target_only"] for r in sweep)
    assert all(0 <= r["accepted"] <= r["drafted"] for r in sweep)
    assert all((r["drafted"] > 0) == (r["system"] != "target-only") for r in sweep)


def test_the_drafting_bench_takes_auto_or_a_positive_gamma_and_only_the_drafting_suite_takes_one():
    from specdec.bench.drafting import DraftingConfig
    from specdec.cli.main import build_parser, run_bench_command

    assert DraftingConfig(name="t").gamma == -1 and DraftingConfig(name="t", gamma=4).gamma == 4
    for bad in (0, -2):
        with pytest.raises(ValueError, match="gamma"):
            DraftingConfig(name="t", gamma=bad)
    for flag, value in (("--gamma", "3"), ("--concurrency", "1,2")):
        args = build_parser().parse_args(["bench", "--suite", "overhead", flag, value])
        assert run_bench_command(args) == 2
