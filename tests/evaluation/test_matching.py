"""Records matched per layer and per head within a window on both sides (evaluation/matching.py), and the
collapse runs judged that way (evaluation.detectors.judge_collapse)."""

from __future__ import annotations

import numpy as np
import pytest

from diag.detectors import AlertConfig, Observation
from diag.detectors.base import Alert
from evaluation import detectors as judge
from evaluation.groundtruth import Episode
from evaluation.matching import COLLAPSE, Window, match, records_of
from evaluation.spec import RunSpec
from evaluation.truth import load_run
from tests.support.fakeruns import write_run


def onset(where: str, opened: int, until: int | None = None) -> Episode:
    return Episode("malignant", where, opened - 10, opened, until, False)


def record(step: int, where: str, kind: str = "malignant_collapse", heads: tuple = ()) -> Alert:
    return Alert(step, kind, "warning", where, "", heads=heads)


def test_the_collapse_window_takes_a_record_10_steps_early_to_50_late():
    assert Window(10, 50) == COLLAPSE
    assert [COLLAPSE.holds(s, 100) for s in (89, 90, 100, 150, 151)] == [False, True, True, True, False]


def test_a_record_counts_only_for_its_own_layer():
    """L01 collapses at 100, L02 never: a record on L02 at 100 is false and L01 is missed; L01's own record at
    95 catches it."""
    onsets = {"L01": [onset("L01", 100)]}
    wrong = match(records_of([record(100, "L02")], "malignant_collapse", "layer"), onsets, COLLAPSE, 299)
    assert wrong == {"onsets": [{"where": "L01", "onset": 100, "since": 90, "baseline": False, "record": None,
                                 "in_time": False, "lead": None, "censored": False}],
                     "false": [{"where": "L02", "step": 100}]}
    right = match(records_of([record(95, "L01")], "malignant_collapse", "layer"), onsets, COLLAPSE, 299)
    assert right["onsets"][0]["record"] == 95 and right["onsets"][0]["lead"] == 5 and right["false"] == []


def test_records_outside_the_window_are_false_and_a_later_episode_has_its_own_window():
    """L01's episodes open at 100 and 250: records at 60 (too early), 160 (too late), 255 (the second
    episode's); the first collapse is missed, two records are false."""
    onsets = {"L01": [onset("L01", 100, 180), onset("L01", 250)]}
    got = match([("L01", 60), ("L01", 160), ("L01", 255)], onsets, COLLAPSE, 299)
    assert got["onsets"][0]["in_time"] is False
    assert got["false"] == [{"where": "L01", "step": 60}, {"where": "L01", "step": 160}]


def test_a_missed_onset_near_the_end_is_censored():
    assert match([], {"L00": [onset("L00", 280)]}, COLLAPSE, 299)["onsets"][0]["censored"] is True
    assert match([], {"L00": [onset("L00", 240)]}, COLLAPSE, 299)["onsets"][0]["censored"] is False


def test_head_records_are_split_per_head_and_layer_records_kept_apart():
    alerts = [record(50, "L00/H00+H01", heads=("L00/H00", "L00/H01")), record(60, "L00", heads=("L00/H00",)),
              Alert(70, "malignant_collapse", "info", "L00", "", status="resolved")]
    assert records_of(alerts, "malignant_collapse", "head") == [("L00/H00", 50), ("L00/H01", 50)]
    assert records_of(alerts, "malignant_collapse", "layer") == [("L00", 60)]


def attention(collapsed: bool) -> dict:
    return {"attn_entropy": np.array([0.1, 0.1] if collapsed else [2.0, 2.0]),
            "attn_rank": np.array([2.0, 2.0] if collapsed else [40.0, 40.0]),
            "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}


def test_a_collapse_run_is_judged_per_layer(tmp_path):
    """Two layers; L01's two heads collapse from step 100: replayed at every step, the detectors' layer record
    comes at L01's onset (110) and on L01 only; nothing is false. The judged row names the layer."""
    obs = [Observation(s, 3.0, {"L00": attention(False), "L01": attention(s >= 100)}) for s in range(200)]
    run = load_run(write_run(tmp_path, RunSpec("lm", 0, 5e-3, 200), obs))
    row = judge.judge_collapse(run, AlertConfig(), 1, None)
    assert row["onset"] == 110 and row["caught"] and not row["false_records"] and not row["quiet_record"]
    assert [(x["where"], x["onset"], x["record"]) for x in row["layers"]] == [("L01", 110, 110)]
    assert [(x["where"], x["onset"], x["record"]) for x in row["heads"]] == [("L01/H00", 110, 110),
                                                                             ("L01/H01", 110, 110)]
    assert row["alarm"] == 110 and row["damaged"] is None


def test_a_record_on_the_wrong_layer_is_a_miss_and_a_false_record(tmp_path, monkeypatch):
    obs = [Observation(s, 3.0, {"L00": attention(False), "L01": attention(s >= 100)}) for s in range(200)]
    run = load_run(write_run(tmp_path, RunSpec("lm", 0, 5e-3, 200), obs))
    monkeypatch.setattr(judge, "replay_run", lambda run, cfg, every: [record(105, "L00")])
    row = judge.judge_collapse(run, AlertConfig(), "default", None)
    assert not row["caught"] and row["false_records"] == [{"where": "L00", "step": 105}]
    assert row["first_record"] == 105  # a record came, on another layer


def test_show_prints_a_runs_alerts_from_its_folder_and_names_a_missing_one(tmp_path, monkeypatch, capsys):
    """``--show RUN`` reads the run's own folder (any set); a name with no recorded run is refused with the names
    that are there."""
    obs = [Observation(s, 3.0, {"L00": attention(False), "L01": attention(s >= 100)}) for s in range(200)]
    name = write_run(tmp_path, RunSpec("lm", 0, 5e-3, 200), obs).name
    monkeypatch.setattr("sys.argv", ["detectors", str(tmp_path), "--show", name, "--every", "1"])
    judge.main()
    shown = capsys.readouterr().out
    assert "malignant_collapse" in shown and "L01" in shown
    monkeypatch.setattr("sys.argv", ["detectors", str(tmp_path), "--show", "lm-lr0.005-s9"])
    with pytest.raises(SystemExit) as stop:
        judge.main()
    error = capsys.readouterr().err
    assert stop.value.code == 2 and "lm-lr0.005-s9" in error and "no run.json" in error and name in error
