"""Scale-out on loopback: 2 target workers, 2 draft workers and 2 coordinators under 16 clients, with a target
worker SIGKILLed and a draft worker SIGTERMed during the load (bench.scale.fault_run)."""

from bench.scale import fault_run


def test_pools_spread_sessions_survive_a_killed_target_and_a_draining_draft_and_keep_every_output(tmp_path):
    run = fault_run(tmp_path, requests=200, clients=16)
    assert run["errors"] == [], "every request completes"
    assert run["requests"] == 200 + 16
    assert run["mismatches"] == 0, "every output is exactly its solo greedy output"
    assert len(run["spread_shares"]) == 2 and min(run["spread_shares"].values()) >= 0.3, run["spread"]
    assert len(run["draft_spread_shares"]) == 2 and min(run["draft_spread_shares"].values()) > 0
    assert run["requests_in_flight_at_fault"] > 0 and run["reopened_sessions"] > 0, "the fault hit open sessions"
    assert run["placed_on_killed_after_restart"] > 0, "the restarted worker gets sessions again"


def test_the_scale_report_states_throughput_spread_and_the_fault_run(tmp_path):
    import json
    import pathlib

    from bench.scale import write_report

    results = json.loads((pathlib.Path(__file__).parents[1] / "docs/results/scale-full/results.json").read_text())
    write_report(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| 1 | 79.3 |" in report and "| 2 | 79.3 |" in report and "50% / 50%" in report
    assert "requests: 216, errors: 0, outputs different from solo greedy: 0" in report
    assert "target sessions reopened: 8" in report
