"""evaluation.remedies end to end on a tiny LLaMA: the results file, the table and the figure it writes, and a
QK-clip that never fires leaving the run bit for bit the unclipped one."""

from __future__ import annotations

import json
import math

from evaluation import remedies

TINY = ["--seeds", "0", "--lrs", "1e-2", "--steps", "4", "--observe", "2", "--layers", "1", "--width", "32",
        "--heads", "2", "--kv-heads", "1", "--context", "16", "--batch", "2", "--chars", "100000"]


def test_the_sweep_writes_its_results_table_and_figure(tmp_path):
    out = tmp_path / "remedies.json"
    results = remedies.main([*TINY, "--arms", "nothing", "qkclip", "--qk-tau", "1e9", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["arms"] == ["nothing", "qkclip"] and saved["setup"]["steps"] == 4
    assert [(r["arm"], r["seed"], r["lr"]) for r in saved["runs"]] == [("nothing", 0, 1e-2), ("qkclip", 0, 1e-2)]
    for run in saved["runs"]:
        assert len(run["losses"]) == 4 and math.isfinite(run["final_loss"])
        assert [step for step, _ in run["logits"]] == [0, 2, 3]  # every 2nd step and the last
        assert run["max_logit"] > 0 and run["cpu_median_s"] > 0
    plain, clipped = results["runs"]
    assert clipped["interventions"] == 0 and clipped["first_intervention"] is None
    assert clipped["losses"] == plain["losses"] and clipped["digest"] == plain["digest"]
    rows = remedies.summarize(results)
    assert [r["arm"] for r in rows] == ["nothing", "qkclip"]
    assert rows[1]["bit_identical"] == [True] and rows[1]["damaged"] is None  # no twin: no verdict
    text = out.with_suffix(".md").read_text()
    assert text.count("\n| 0.01 |") == 2
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_qk_clip_under_its_logits_intervenes_and_the_twin_judges_damage(tmp_path):
    results = remedies.main([*TINY, "--arms", "nothing", "qkclip", "qknorm", "--qk-tau", "0.01"])
    plain, clipped, twin = results["runs"]
    assert clipped["interventions"] > 0 and clipped["first_intervention"] == 0
    assert clipped["digest"] != plain["digest"]
    rows = {r["arm"]: r for r in remedies.summarize(results)}
    assert rows["qknorm"]["excess"] == [0.0] and rows["qknorm"]["damaged"] == 0
    assert rows["qkclip"]["bit_identical"] == [] and rows["nothing"]["cost"] == 1.0
    assert "qknorm" in remedies.table(list(rows.values()), results["setup"])


def test_resume_keeps_the_finished_runs_and_trains_only_the_missing_ones(tmp_path, capsys):
    out = tmp_path / "remedies.json"
    first = remedies.main([*TINY, "--arms", "nothing", "--qk-tau", "1e9", "--out", str(out)])
    capsys.readouterr()
    both = remedies.main([*TINY, "--arms", "nothing", "qkclip", "--qk-tau", "1e9", "--out", str(out), "--resume"])
    printed = capsys.readouterr().out
    assert "seed 0 qkclip" in printed and "seed 0 nothing" not in printed  # only the qkclip run was trained
    assert [r["arm"] for r in both["runs"]] == ["nothing", "qkclip"]
    assert both["runs"][0]["cpu_median_s"] == first["runs"][0]["cpu_median_s"]
