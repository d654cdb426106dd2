"""The evaluation's premise: detectors replayed over a run recorded at every=1, keeping the steps that are
multiples of k, raise what a live Monitor at every=k raises (evaluation/runs.py records, evaluation/detectors.py
replays); and replayed at the default per-family cadence, with its closer look, what a live Monitor left at its
defaults raises."""

from __future__ import annotations

import pytest

from diag.detectors import AlertConfig
from evaluation import detectors as evaluate_detectors
from evaluation.record import load_observations
from evaluation.runs import RunSpec, record


def live(tmp_path, every: int | None, steps: int) -> list:
    import hooks.demo as demo

    ns = demo.DemoRun(lr=5e-3, quiet=True, logdir=tmp_path / f"live{every}", every=every, steps=steps)
    monitor, _ = demo.train(ns, demo.GPTConfig(block_size=32))
    return monitor.alert_sink.history


@pytest.mark.parametrize("every", [5, "default"])
def test_replay_of_a_recorded_run_matches_the_live_monitor(tmp_path, every):
    steps = 60 if every == "default" else 25  # the default cadence samples every 10 steps
    recorded = record(RunSpec("lm", 0, 5e-3, steps, context=32), tmp_path)
    observations = load_observations(recorded / "observations.jsonl")
    assert sorted({o.step for o in observations}) == list(range(steps))
    replayed = evaluate_detectors.replay(observations, AlertConfig(), every)
    expected = live(tmp_path, None if every == "default" else every, steps)
    key = [(a.step, a.kind, a.where, a.status, a.since) for a in expected]
    assert key and [(a.step, a.kind, a.where, a.status, a.since) for a in replayed] == key


def test_the_recorder_keeps_the_update_sample_the_monitor_judges_at_close(tmp_path):
    """Monitor.close judges the update sample still pending through the recorder, and leaves the recorder's file to
    whoever opened it: it is open after Monitor.close, and holds that sample once closed."""
    from diag.outputs.sinks import MemorySink
    from evaluation.record import Recorder
    from tests.support import harness, zoo

    recorders = []

    def on_step(step, monitor, model, loss):
        if not recorders:
            monitor.detectors = Recorder(monitor.detectors, tmp_path / "observations.jsonl")
            recorders.append(monitor.detectors)
        monitor.step(step, loss=loss)

    harness.train(zoo.nanogpt(dropout=0.0), 2, {"every": 1, "sinks": [MemorySink()], "images": False}, tmp_path,
                  on_step)
    assert not recorders[0].file.closed
    recorders[0].close()
    observations = load_observations(tmp_path / "observations.jsonl")
    assert [o.step for o in observations if any("update_ratio_q" in m for m in o.layers.values())][-1] == 1


def test_replay_hands_the_detectors_the_mean_loss_the_live_monitor_hands_them(tmp_path):
    """Observation.loss_mean (the mean loss of the steps since the last loss sample: the plateau detector's loss)
    replayed from a run recorded at every=1 (evaluation.detectors.LossMeans) is what a live Monitor at its default
    cadence computes on the same training (the Monitor does not change it: the same losses)."""
    from diag.detectors import Detectors
    from diag.outputs.sinks import MemorySink
    from evaluation.record import Recorder
    from tests.support import harness, zoo

    def run(kwargs, path):
        seen = []

        def on_step(step, monitor, model, loss):
            if not seen:
                monitor.detectors = Recorder(monitor.detectors, path)
                seen.append(monitor.detectors)
            monitor.step(step, loss=loss)

        harness.train(zoo.nanogpt(dropout=0.0), 41, {"sinks": [MemorySink()], "images": False, **kwargs}, None,
                      on_step)
        seen[0].close()
        return load_observations(path)

    recorded = run({"every": 1}, tmp_path / "every1.jsonl")
    live = [(o.step, o.loss_mean) for o in run({}, tmp_path / "live.jsonl") if o.loss is not None]
    assert [s for s, _ in live] == [0, 10, 20, 30, 40] and all(m is not None for _, m in live)
    replayed = [(o.step, o.loss_mean) for o, _ in
                evaluate_detectors.at_default_cadence(recorded, Detectors(AlertConfig())) if o.loss is not None]
    assert [s for s, _ in replayed] == [s for s, _ in live]
    assert [m for _, m in replayed] == pytest.approx([m for _, m in live], rel=1e-5)
    losses = [o.loss for o in recorded if o.loss is not None]
    assert live[1][1] == pytest.approx(sum(losses[1:11]) / 10, rel=1e-5)
