"""The evaluation's premise: detectors replayed over a run recorded at every=1, keeping the steps that are
multiples of k, raise what a live Monitor at every=k raises (evaluation/record.py, evaluate_detectors.py);
and replayed at the default per-family cadence, with its closer look, what a live Monitor left at its defaults
raises."""

from __future__ import annotations

import pytest

from diag.detectors import AlertConfig  # noqa: E402
from evaluation import detectors as evaluate_detectors
from evaluation import record as evaluate_record

STEPS = 25


def live(tmp_path, every: int | None, record: bool, steps: int = STEPS):
    import argparse

    args = argparse.Namespace(lr=5e-3, warmup=0, qk_norm=False, seed=0, every=every, steps=steps, context=32)
    out = tmp_path / f"every{every}"
    out.mkdir()
    if record:
        evaluate_record.record_collapse(args, out)
        return out
    import hooks.demo as demo

    ns = demo.DemoRun(lr=5e-3, quiet=True, logdir=out, every=every, steps=steps)
    monitor, _ = demo.train(ns, demo.GPTConfig(block_size=32))
    return monitor.alert_sink.history


@pytest.mark.parametrize("every", [5, "default"])
def test_replay_of_a_recorded_run_matches_the_live_monitor(tmp_path, every):
    steps = 60 if every == "default" else STEPS  # the default cadence samples every 10 steps
    recorded = live(tmp_path, 1, record=True, steps=steps)
    observations = evaluate_record.load_observations(recorded / "observations.jsonl")
    assert sorted({o.step for o in observations}) == list(range(steps))
    replayed = evaluate_detectors.replay(observations, AlertConfig(), every)
    expected = live(tmp_path, None if every == "default" else every, record=False, steps=steps)
    key = [(a.step, a.kind, a.where, a.status, a.since) for a in expected]
    assert key and [(a.step, a.kind, a.where, a.status, a.since) for a in replayed] == key


def test_the_trust_table_counts_a_run_by_its_first_warning_and_its_outcome(tmp_path):
    """``evaluate_detectors.py --trust`` (docs/alerts.md#collapse_warning): one recorded run lands in the row of
    its first collapse_warning at the default cadence (and its learning rate's row when early), under the
    outcome the ground truth gives it."""
    recorded = live(tmp_path, 1, record=True, steps=60)
    obs = evaluate_record.load_observations(recorded / "observations.jsonl")
    run = evaluate_detectors.Run("collapse-lr5e-3-s0", "collapse", 0, obs, {"config": {"lr": 5e-3}},
                                 evaluate_detectors.peak_share(obs))
    alerts = evaluate_detectors.replay(obs, AlertConfig(), "default")
    first = min((a.step for a in alerts if a.kind == "collapse_warning" and a.status == "firing"), default=None)
    window = AlertConfig().warn_window
    when = "none" if first is None else f"in the first {window} steps" if first <= window else "later"
    column = {"established": 3, "hovering": 4, "none": 5}[evaluate_detectors.outcome(run).split(" at ")[0]]
    rows = {line.split("|")[1].strip(): line.split("|") for line in evaluate_detectors.trust([run])[2:]}
    assert rows[when][2].strip() == "1" and rows[when][column].strip() == "1"
    assert sum(int(r[2]) for name, r in rows.items() if not name.startswith("of which")) == 1
    assert ("of which lr 0.005" in rows) == (when != "none" and when != "later")
