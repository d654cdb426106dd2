"""WandbSink against the real wandb package, offline: every run is read back from its ``.wandb`` file
(:func:`diag.outputs.wandb_read.read_offline_run`), nothing is mocked.

The main test trains the demo's GPT (25 steps at the collapse learning rate, every signal every 5 steps, context
32: alerts fire) with a logdir and a WandbSink inside a run the user started and logs into with W&B's implicit
step; the run must hold every scalar of ``metrics.jsonl`` at its step, every record of ``alerts.jsonl``, and the
user's rows exactly as the user logged them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import wandb

from diag.detectors.base import Alert
from diag.outputs.alert_sink import shown_where
from diag.outputs.sinks import FanOut, Record
from diag.outputs.wandb_read import read_offline_run
from diag.outputs.wandb_sink import ALERT_COLUMNS, ALERT_TABLE, CHART_PREFIX, STEP_METRIC, WandbSink, wandb_key
from tests.support import wandb_runs

ROOT = Path(__file__).resolve().parents[2]


def _same(a: float | None, b: float) -> bool:
    """A metrics.jsonl value (null where not finite) and the W&B value of the same step and tag."""
    return not math.isfinite(b) if a is None else math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def _monitor_scalars(rows: list[dict]) -> dict[tuple[int, str], float]:
    """``{(Monitor step, key): value}`` of every plain number the sink logged (not media, tables, charts)."""
    out: dict[tuple[int, str], float] = {}
    for row in rows:
        if STEP_METRIC not in row:
            continue
        media = {k.rsplit(".", 1)[0] for k in row if k.endswith("._type")}
        for key, value in row.items():
            if (key.startswith("_") or key == STEP_METRIC or key == "loss" or key.startswith(CHART_PREFIX)
                    or any(key.startswith(m + ".") for m in media) or not isinstance(value, int | float)):
                continue
            assert (row[STEP_METRIC], key) not in out, f"{key} at step {row[STEP_METRIC]} logged twice"
            out[row[STEP_METRIC], key] = float(value)
    return out


def test_importing_diag_and_hooks_imports_no_wandb():
    code = ("import sys, diag, hooks, diag.outputs.sinks, diag.outputs.wandb_sink, hooks.integrations; "
            "print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_demo_run_in_the_users_run_holds_every_metric_and_alert(tmp_path, offline):
    import hooks.demo as demo

    run = wandb.init(project="attnscope-test", dir=str(offline))
    user_losses: list[float] = []

    def user_log(step: int, losses: list[float]) -> None:  # the user's own logging, W&B's implicit step
        user_losses.append(losses[-1])
        wandb.log({"loss": losses[-1]})

    logdir = tmp_path / "logs"
    args = demo.DemoRun(lr=5e-3, quiet=True, logdir=logdir, every=5, steps=25)
    monitor, losses = demo.train(args, demo.GPTConfig(block_size=32), sinks=[WandbSink()], callbacks=[user_log])
    assert wandb.run is run and run.step == 25  # the sink advanced no step and finished no run
    run_dir = Path(run.dir).parent
    run.finish()

    assert wandb_runs.run_dirs(offline) == [run_dir]  # one run: the user's
    back = read_offline_run(run_dir)
    assert back.run_id == run.id
    rows = back.history
    # the user's rows: at the steps W&B would give them without the Monitor, with the user's values
    assert [(r["_step"], r["loss"]) for r in rows if "loss" in r] == list(enumerate(user_losses))
    assert user_losses == losses

    metrics = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    logged = _monitor_scalars(rows)
    expected = {(m["step"], wandb_key(m["tag"])): m["value"] for m in metrics}
    assert len(expected) == len(metrics) > 100
    assert set(logged) == set(expected)
    wrong = [(k, expected[k], logged[k]) for k in expected if not _same(expected[k], logged[k])]
    assert not wrong, wrong[:5]
    assert any(m["value"] is None for m in metrics) == any(not math.isfinite(v) for v in logged.values())

    alerts = [json.loads(line) for line in (logdir / "alerts.jsonl").read_text().splitlines()]
    assert alerts, "the configuration raises no alert: the alert checks would check nothing"
    table = back.table(ALERT_TABLE)
    assert table["columns"] == ALERT_COLUMNS
    history = monitor.alert_sink.history
    assert [[a["step"], a["kind"], a["level"], a["status"], a["since"], a["message"], a["docs"]] for a in alerts] == \
        [[r[0], r[1], r[2], r[4], r[5], r[6], r[7]] for r in table["data"]]
    assert [r[3] for r in table["data"]] == [shown_where(a) for a in history]
    sent = back.alerts  # run.alert: one per alert record, at its level
    assert len(sent) == len(alerts)
    levels = {("critical", "firing"): "ERROR", ("warning", "firing"): "WARN", ("info", "firing"): "INFO"}
    for a, s in zip(alerts, sent):
        assert s["level"] == levels.get((a["level"], a["status"]), "INFO")
        assert a["kind"] in s["title"] and a["message"] in s["text"] and a["docs"] in s["text"]
    summary = back.summary
    assert summary["attnscope/alerts_fired"] == sum(a["status"] == "firing" for a in alerts)

    # the layout's charts: a line_series per chart, a line per layer
    charts = {k.rsplit(".", 1)[0] for r in rows for k in r if k.startswith(CHART_PREFIX) and k.endswith("._type")}
    sigma = next(c for c in charts if "qk_sigma1" in c)
    data = back.table(sigma)
    assert {line for _, line, _ in data["data"]} == {"L00", "L01", "L02", "L03"}
    per_step = {(line, step): value for step, line, value in data["data"]}
    for (step, key), value in logged.items():
        if key.startswith("qk_sigma1/") and key.endswith("/max") and math.isfinite(value):
            assert per_step[key.split("/")[1], step] == pytest.approx(value)


def test_a_run_of_its_own_is_started_committed_and_finished(tmp_path, offline):
    sink = WandbSink(project="attnscope-test", dir=tmp_path / "own", name="own-run")
    assert sink.own and wandb.run is sink.run
    values = [1.0, math.nan, 3.0]
    for step, value in zip((0, 10, 20), values):
        sink.write(Record(step, {"loss": value, "qk_sigma1/L00/max": 2 * value},
                          histograms={"qk_spectrum/L00": np.array([1.0, 2.0, np.nan])},
                          images={"heatmap/x": np.zeros((4, 4, 3), np.uint8)}))
    sink.write(Record(10, {"update_ratio_q/L00": 0.5}))  # a step that came back: a row of its own
    sink.close()
    assert wandb.run is None  # the sink's own run, finished
    (run_dir,) = wandb_runs.run_dirs(tmp_path / "own")
    back = read_offline_run(run_dir)
    rows = back.history
    assert [r["_step"] for r in rows] == [0, 1, 2, 3]
    assert [r[STEP_METRIC] for r in rows] == [0, 10, 20, 10]
    assert [r.get("attnscope/loss") for r in rows[:3]] == [1.0, pytest.approx(math.nan, nan_ok=True), 3.0]
    assert rows[3]["update_ratio_q/L00"] == 0.5
    assert rows[0]["qk_spectrum/L00._type"] == "histogram" and sum(rows[0]["qk_spectrum/L00.values"]) == 2
    assert rows[0]["heatmap/x._type"] == "image-file"
    metrics = [r for r in back.records if r["type"] == "metric"]
    assert {m["metric"].get("glob_name") for m in metrics} >= {"attnscope/*", "qk_sigma1/*", "update_ratio_q/*"}
    assert all(m["metric"].get("step_metric") == STEP_METRIC for m in metrics if "glob_name" in m["metric"])
    assert back.summary["attnscope/alerts_fired"] == 0  # no alert fired: the summary says so, not nothing


def test_monitor_steps_wait_for_the_users_rows_and_close_writes_the_rest(tmp_path, offline):
    """Two Monitor steps before the user's next row: the second goes into that next row; at close, what still
    waits goes in after the user's rows, and the user's steps are untouched."""
    run = wandb.init(project="attnscope-test", dir=str(offline))
    sink = WandbSink()
    sink.write(Record(0, {"a/x": 1.0}))
    sink.write(Record(5, {"a/x": 2.0}))  # row 0 holds step 0: waits
    wandb.log({"loss": 0.0})
    sink.write(Record(10, {"a/x": 3.0}))  # step 5 into row 1; 10 waits
    wandb.log({"loss": 1.0})
    sink.write(Record(15, {"a/x": 4.0}))  # step 10 into row 2; 15 waits
    sink.close()  # row 2 holds step 10: the user's open row is committed, 15 goes into the next
    assert wandb.run is run
    wandb.log({"loss": 2.0})
    run_dir = Path(run.dir).parent
    run.finish()
    rows = read_offline_run(run_dir).history
    assert [(r["_step"], r.get("loss"), r.get(STEP_METRIC), r.get("a/x")) for r in rows] == [
        (0, 0.0, 0, 1.0), (1, 1.0, 5, 2.0), (2, None, 10, 3.0), (3, 2.0, 15, 4.0)]


def test_alerts_go_to_run_alert_the_summary_and_the_table(tmp_path, offline):
    run = wandb.init(project="attnscope-test", dir=str(offline))
    sink = WandbSink()
    fired = Alert(3, "malignant_collapse", "warning", "L01", "entropy falls. What to do: warm up.", since=2,
                  heads=("L01/H00", "L01/H02"))
    critical = Alert(4, "malignant_collapse", "critical", "L01/H00", "collapsed. What to do: lower lr.", since=4)
    resolved = Alert(6, "malignant_collapse", "warning", "L01", "recovered.", status="resolved", since=2)
    sink.write_alerts([fired, critical])
    sink.write_alerts([resolved])
    sink.close()
    run_dir = Path(run.dir).parent
    run.finish()
    back = read_offline_run(run_dir)
    sent = back.alerts
    assert [s["level"] for s in sent] == ["WARN", "ERROR", "INFO"]
    assert sent[0]["title"] == "attnscope malignant_collapse at L01 (H00, H02)"
    assert "What to do: warm up." in sent[0]["text"] and "docs/alerts.md#malignant_collapse" in sent[0]["text"]
    assert sent[2]["title"] == "attnscope malignant_collapse resolved at L01"
    table = back.table(ALERT_TABLE)
    assert [row[:6] for row in table["data"]] == [[3, "malignant_collapse", "warning", "L01 (H00, H02)", "firing", 2],
                                                  [4, "malignant_collapse", "critical", "L01/H00", "firing", 4],
                                                  [6, "malignant_collapse", "warning", "L01", "resolved", 2]]
    summary = back.summary
    assert summary["attnscope/alerts_fired"] == 2
    assert summary["attnscope/last_alert"].startswith("diag alert malignant_collapse resolved at L01, step 6")


def test_a_failing_run_never_reaches_training(tmp_path, offline, recwarn):
    """The user finishes the run under the sink: writes fail inside FanOut, close reports and returns."""
    import time

    run = wandb.init(project="attnscope-test", dir=str(offline))
    sink = WandbSink()
    fan = FanOut([sink])
    fan.write(Record(0, {"a/x": 1.0}))
    run.finish()
    start = time.perf_counter()
    fan.write(Record(5, {"a/x": 2.0}))
    fan.write_alerts([Alert(5, "malignant_collapse", "warning", "L00", "m")])
    sink.write_layout({"c": {"t": ["Multiline", ["^a/x$"]]}})
    fan.close()  # nothing raised
    assert time.perf_counter() - start < 5  # no call waited on the finished run (W&B's step query waits 30 s)
    assert any("WandbSink" in str(w.message) or "sink WandbSink" in str(w.message) for w in recwarn)


def test_a_sink_that_does_not_start_runs_waits_for_one(tmp_path, offline):
    sink = WandbSink(start_run=False, commit=True)
    assert sink.run is None and wandb.run is None
    sink.write(Record(0, {"a/x": 1.0}))  # no run yet: nothing written, nothing started
    assert wandb.run is None
    run = wandb.init(project="attnscope-test", dir=str(offline))
    sink.write(Record(1, {"a/x": 2.0}))
    sink.close()
    assert wandb.run is run  # not the sink's to finish
    run_dir = Path(run.dir).parent
    run.finish()
    rows = read_offline_run(run_dir).history
    assert [(r[STEP_METRIC], r["a/x"]) for r in rows] == [(1, 2.0)]


def test_only_rank_0_writes_under_ddp(tmp_path):
    """Two gloo processes each build a WandbSink (as a user would on every rank): rank 0's offline run holds the
    Monitor's metrics, rank 1 created no run."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           **wandb_runs.offline_env(tmp_path / "wandb-home")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("wandb_ddp_worker.py")), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert wandb_runs.run_dirs(out / "rank1") == [] and not (out / "rank1" / "wandb").exists()
    (run_dir,) = wandb_runs.run_dirs(out / "rank0")
    rows = read_offline_run(run_dir).history
    metrics = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = _monitor_scalars(rows)
    assert metrics and {(m["step"], wandb_key(m["tag"])) for m in metrics} == set(logged)
    assert [json.loads((out / f"active_rank{r}.json").read_text()) for r in (0, 1)] == [True, False]


def test_demo_command_writes_an_offline_run_beside_its_logdir(tmp_path, offline, monkeypatch):
    from diag.cli.main import main

    monkeypatch.delenv("WANDB_MODE")  # the demo's own default: offline
    monkeypatch.delenv("WANDB_DIR")
    logdir = tmp_path / "demo"
    assert main(["demo", "--logdir", str(logdir), "--steps", "2", "--every", "1", "--wandb", "--quiet"]) == 0
    assert wandb.run is None  # the demo's run, finished
    (run_dir,) = wandb_runs.run_dirs(logdir / "wandb")
    assert run_dir.name.startswith("offline-run-")
    metrics = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    logged = _monitor_scalars(read_offline_run(run_dir).history)
    assert metrics and {(m["step"], wandb_key(m["tag"])) for m in metrics} == set(logged)
