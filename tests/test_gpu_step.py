"""benchmarks/gpu_step.py, the device check's step benchmark, runs end to end here with tiny
shapes on the CPU (--smoke): a slip in it then shows in the suite, not on a lent GPU's clock."""

import json

from benchmarks import gpu_step


def test_the_step_benchmark_runs_and_reports_every_part(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert gpu_step.main(["--smoke", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    trees = {(r["budget"], r["depth"]) for r in rows}
    assert trees == set(gpu_step.SMOKE["trees"]) and {r["vocab"] for r in rows} == set(gpu_step.SMOKE["vocabs"])
    assert {r["variant"] for r in rows} == {"default", "graphs off", "matmul attention", "overlap", "overlap, gated"}
    assert all(r["overlap"] == r["variant"].startswith("overlap") for r in rows)
    from offload_engine.planning.adaptive import GROW_FIRST
    for r in rows:  # (the gate's first steps rest; here nothing waits, so nothing is grown after)
        assert (r["gate"] is None) == (r["variant"] != "overlap, gated")
        assert r["gate"] is None or r["gate"]["rested_steps"] == GROW_FIRST
    for r in rows:
        assert r["step_s"] > 0 and r["pass_s"] > 0 and r["draft_s"] > 0 and 0 < r["level_s"] < r["draft_s"]
        assert abs(r["rest_s"] - (r["step_s"] - r["pass_s"] - r["draft_s"])) < 1e-9
        assert r["step_synced_s"] > 0 and r["pass_synced_s"] > 0
        assert abs(r["over_pass_synced_s"] - (r["step_synced_s"] - r["pass_synced_s"])) < 1e-9
        assert r["level_width"] <= 64
    assert any(r["attention"] == "matmul" for r in rows)
    assert len(data["bar"]) == 6 * len(gpu_step.SMOKE["vocabs"])  # issue 17's four and issue 23's two
    text = capsys.readouterr().out
    assert "issue-17 and issue-23 bars" in text and "by cpu_time_total" in text
    assert (tmp_path / "work" / "profile_step_v320.txt").exists()


def test_the_trace_option_writes_a_trace_with_and_without_overlap(tmp_path):
    assert gpu_step.main(["--smoke", "--work", str(tmp_path / "work"), "--trace", str(tmp_path / "t")]) == 0
    for name in ("default", "overlap"):
        trace = json.loads((tmp_path / "t" / f"trace_step_v320_{name}.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
