"""`specdec bench --suite pair --quick` end to end on tiny random models: both phases run, the report's files and
fields are there, every greedy output matches both references."""

import json

import pytest

from specdec.bench.pair import ALL_SYSTEMS, SPECDEC_SYSTEMS
from tests.support.bench_runs import run_quick_bench

pytestmark = pytest.mark.slow


def test_quick_pair_bench_compares_every_system_and_reports_cost_curves(tmp_path):
    out = run_quick_bench(tmp_path, "pair")
    for name in ("results.json", "report.md", "cost_curves.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    analysis = results["analysis"]
    assert set(analysis["tokens_per_second"]) == set(ALL_SYSTEMS)
    assert all(v > 0 for v in analysis["tokens_per_second"].values())
    assert set(analysis["speedup_over_target_only"]) == set(SPECDEC_SYSTEMS)
    assert analysis["hf_assisted_speedup_over_hf_generate"] > 0
    outputs = analysis["greedy_outputs"]
    assert outputs["all_identical"] is True and outputs["mismatches"] == []
    assert all(same is True for checks in outputs["identical"].values() for same in checks.values())
    assert set(outputs["identical"]) == set(ALL_SYSTEMS) - {"HF generate"}
    curves = results["cost_curves_ms"]
    assert set(curves) == {
        "target before (eager)",
        "draft before (eager, float32 base)",
        "target packed (in process)",
        "draft as served (in process)",
        "target after (served)",
        "draft after (served)",
    }
    for name, curve in curves.items():
        assert list(curve) == [str(k) for k in range(1, 10)], name
    assert analysis["draft_step_over_target_step"]["after (in process)"] > 0
    for system in SPECDEC_SYSTEMS:
        assert 0 <= analysis["acceptance"][system] <= 1
    # A fixed gamma drafts every round; auto may turn speculation off for a draft as costly as its target (as here).
    assert set(analysis["acceptance_by_position"]["specdec gamma 4 (gRPC)"]) == {"1", "2", "3", "4"}
    assert analysis["memory"]["cluster_total_peak_mib"] > 0 and analysis["memory"]["hf_process_peak_rss_mib"] > 0
    assert len({r["prompt_id"] for r in results["runs"]}) == 2
    report = (out / "report.md").read_text()
    for heading in ("Systems", "Acceptance by position", "Greedy outputs", "Cost curves", "Memory"):
        assert f"## {heading}" in report
