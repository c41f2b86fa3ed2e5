"""Scale-out on loopback: 2 target workers, 2 draft workers and 2 coordinators under 16 clients, with a target
worker SIGKILLed and a draft worker SIGTERMed during the load (bench.scale.fault_run)."""

import pytest

from specdec.bench.scale import fault_run


@pytest.mark.slow
def test_pools_spread_sessions_survive_a_killed_target_and_a_draining_draft_and_keep_every_output(tmp_path):
    run = fault_run(tmp_path, requests=200, clients=16)
    assert run["errors"] == [], "every request completes"
    assert run["requests"] == 200 + 16
    assert run["mismatches"] == 0, "every output is exactly its solo greedy output"
    assert len(run["spread_shares"]) == 2 and min(run["spread_shares"].values()) >= 0.3, run["spread"]
    assert len(run["draft_spread_shares"]) == 2 and min(run["draft_spread_shares"].values()) > 0
    assert run["requests_in_flight_at_fault"] > 0 and run["reopened_sessions"] > 0, "the fault hit open sessions"
    assert run["placed_on_killed_after_restart"] > 0, "the restarted worker gets sessions again"
    # No request stopped speculating: a killed target's sessions are reopened, a draining draft finishes its own
    # and new ones go to the other draft worker.
    assert run["fallbacks"] == [{}, {}, {}], run["fallbacks"]


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of each row of the first table under `## heading` (without its header and rule)."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


def test_the_scale_report_states_throughput_spread_and_the_fault_run(tmp_path):
    """The report, written from the committed raw results, has its sections and states what the JSON holds
    (computed here from the JSON, never copied from it); the committed report is exactly that report."""
    import json
    import pathlib
    import statistics

    from specdec.bench.scale import write_report

    folder = pathlib.Path(__file__).parents[2] / "docs/results/scale-full"
    results = json.loads((folder / "results.json").read_text())
    write_report(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert report == (folder / "report.md").read_text(), "the committed report is not the one its results.json gives"

    rows = table_rows(report, "One target worker against two")
    assert [row[0] for row in rows] == list(results["throughput"]), "a row per worker count"
    for row, runs in zip(rows, results["throughput"].values(), strict=True):
        assert float(row[1]) == round(statistics.median(r["tokens_per_second"] for r in runs), 1)
        assert float(row[2]) == round(statistics.median(r["latency_median_s"] for r in runs), 2)
        spread = runs[-1]["spread_shares"]
        assert row[3] == " / ".join(f"{share:.0%}" for share in spread.values())
        assert len(spread) == int(row[0]) and sum(spread.values()) == pytest.approx(1), "a share per worker"

    fault = results["fault_run"]
    section = report.split("## Fault run\n", 1)[1]
    assert (
        f"requests: {fault['requests']}, errors: {len(fault['errors'])}, "
        f"outputs different from solo greedy: {fault['mismatches']}"
    ) in section
    assert f"target sessions reopened: {fault['reopened_sessions']}" in section
    assert f"requests in flight at the fault: {fault['requests_in_flight_at_fault']}" in section
    assert f"in the next 16 requests: {fault['placed_on_killed_after_restart']}" in section
    assert f"median {fault['latency_hit_median_s']:.2f} s, max {fault['latency_hit_max_s']:.2f} s" in section


def test_the_results_document_states_the_scale_runs_of_its_raw_json():
    """The worker-pools report (docs/results/2026-11-30-worker-pools.md) cites docs/results/scale-full/; its table
    agrees with that JSON (each run, the medians, the spread), computed here from the JSON."""
    import json
    import pathlib
    import statistics

    root = pathlib.Path(__file__).parents[2]
    results = json.loads((root / "docs/results/scale-full/results.json").read_text())
    document = (root / "docs/results/2026-11-30-worker-pools.md").read_text()
    heading = "One target worker against two"
    assert "](scale-full/report.md)" in document, "the report links the run's folder"
    rows = table_rows(document, heading)
    assert [row[0] for row in rows] == list(results["throughput"]), "a row per worker count"
    for row, runs in zip(rows, results["throughput"].values(), strict=True):
        assert row[1] == ", ".join(f"{r['tokens_per_second']:.1f}" for r in runs)
        assert float(row[2]) == round(statistics.median(r["tokens_per_second"] for r in runs), 1)
        assert float(row[3]) == round(statistics.median(r["latency_median_s"] for r in runs), 2)
        assert row[4] == " / ".join(f"{share:.0%}".replace("%", " %") for share in runs[-1]["spread_shares"].values())
    fault = results["fault_run"]
    assert f"- {fault['requests']} requests, no error" in document and not fault["errors"] and not fault["mismatches"]
