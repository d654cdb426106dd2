"""evaluation/agree.py: the ground truth's malignant onsets against the detectors' over a sweep of its parameters,
and the replica's episodes against the detectors' own, every difference listed."""

from __future__ import annotations

import numpy as np
import pytest

from diag.detectors import Observation
from evaluation import agree
from evaluation.groundtruth import Episode
from evaluation.spec import RunSpec
from evaluation.truth import load_run
from tests.support.fakeruns import write_run


def collapsing(steps: int) -> list[Observation]:
    """Two heads of one layer malignant from step 20 to 80, normal before and after."""
    def layer(s):
        inside = 20 <= s < 80
        return {"attn_entropy": np.array([0.1, 0.1] if inside else [2.0, 2.0]),
                "attn_rank": np.array([2.0, 2.0] if inside else [40.0, 40.0]),
                "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}
    return [Observation(s, 3.0, {"L00": layer(s)}) for s in range(steps)]


def test_differences_pair_episodes_by_overlap_and_list_what_each_side_has():
    ours = [Episode("malignant", "L00", 20, 30, 80, False), Episode("malignant", "L00/H00", 20, 30, 80, False),
            Episode("benign", "L01", 5, 5, None, False)]
    theirs = [Episode("malignant", "L00", 20, 30, 65, False), Episode("malignant", "L00/H00", 20, 30, 80, False),
              Episode("sink", "L02/H01", 0, 0, None, True)]
    found = agree.differences("run", ours, theirs)
    assert [(d.where, d.state, d.ours, d.theirs) for d in found] == [
        ("L00", "malignant", (20, 30, 80, False), (20, 30, 65, False)),
        ("L01", "benign", (5, 5, None, False), None),
        ("L02/H01", "sink", None, (0, 0, None, True))]
    assert found[0].line() == ("run L00 malignant: replica since 20 opened 30 until 80 baseline=no | "
                               "detectors since 20 opened 30 until 65 baseline=no")


def test_episodes_without_a_baseline_field_are_compared_on_their_steps():
    class Bare:  # an episode of a definition that does not say whether it is a baseline one
        def __init__(self, *a):
            self.state, self.where, self.since, self.opened, self.until = a
    assert agree.differences("run", [Episode("malignant", "L00", 0, 10, None, True)],
                             [Bare("malignant", "L00", 0, 10, None)]) == []


def test_the_command_finds_no_difference_on_a_run_both_read_alike(tmp_path, monkeypatch, capsys):
    path = write_run(tmp_path, RunSpec("lm", 0, 5e-3, 150), collapsing(150))
    assert agree.agree([load_run(path)]) == []
    monkeypatch.setattr("sys.argv", ["agree", str(tmp_path), "--replica"])
    with pytest.raises(SystemExit) as stop:
        agree.main()
    assert stop.value.code == 0
    assert "1 runs recorded at every step (0 others skipped): 0 differences on 0 runs" in capsys.readouterr().out


def test_the_command_lists_a_difference_and_exits_1(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, RunSpec("lm", 0, 5e-3, 150), collapsing(150))
    monkeypatch.setattr("diag.detectors.states.episodes_of", lambda obs, cfg: [])
    monkeypatch.setattr("sys.argv", ["agree", str(tmp_path), "--replica"])
    with pytest.raises(SystemExit) as stop:
        agree.main()
    assert stop.value.code == 1
    out = capsys.readouterr().out
    assert "lm-lr0.005-s0 L00 malignant: replica since 20 opened 30 until 80 baseline=no | detectors -" in out


# --- the ground truth's curve -------------------------------------------------------------------------------


def test_compare_pairs_each_layers_first_onset_within_the_window():
    """L00: the detectors 12 steps after the truth (within 50: both); L01: 60 after (outside: one each side);
    L02: only the truth; L03: only the detectors; L04: the detectors 10 before (the window's early edge)."""
    truth = [Episode("malignant", w, s, s, None, False) for w, s in (("L00", 20), ("L01", 20), ("L02", 5),
                                                                      ("L04", 40), ("L00/H00", 20))]
    truth.append(Episode("benign", "L03", 0, 0, None, True))  # another state: not counted
    detectors = [Episode("malignant", w, s, s + 10, None, False) for w, s in (("L00", 22), ("L01", 70),
                                                                              ("L03", 0), ("L04", 20))]
    detectors.append(Episode("malignant", "L00", 200, 210, None, False))  # a second episode: the first counts
    a = agree.compare(truth, detectors)
    assert (a.truth, a.detectors, a.both, a.truth_only, a.detectors_only) == (4, 4, 2, 2, 2)
    assert sorted(a.lags) == [-10, 12] and a.agreement == pytest.approx(2 / 6)
    head = agree.compare(truth, detectors, scope="head")
    assert (head.truth, head.detectors, head.both) == (1, 0, 0)


def _mapped_run(root, spec, collapse_from: int | None, steps: int = 150):
    """A run whose detectors' observations and attention maps both show (or both do not show) L00's two heads
    collapsing from ``collapse_from``: the maps of every query on the sequence's own key 1 + s."""
    import torch

    from evaluation.maps import Maps, measure, save_maps

    t = 32
    pointed = torch.zeros(3, t, t)
    for s in range(3):
        pointed[s, : 1 + s, :].copy_(torch.eye(t)[: 1 + s])
        pointed[s, 1 + s :, 1 + s] = 1.0
    spread = torch.ones(3, t, t).tril()
    spread = spread / spread.sum(-1, keepdim=True)
    inside = measure(torch.stack([pointed, pointed], 1), True)
    outside = measure(torch.stack([spread, spread], 1), True)
    on = [collapse_from is not None and s >= collapse_from for s in range(steps)]
    stack = {k: {"L00": np.stack([(inside if o else outside)[k].numpy() for o in on])} for k in inside}
    obs = collapsing(steps) if collapse_from is not None else [
        Observation(s, 3.0, {"L00": {"attn_entropy": np.array([2.0, 2.0]), "attn_rank": np.array([40.0, 40.0]),
                                     "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}})
        for s in range(steps)]
    path = write_run(root, spec, obs)
    save_maps(Maps(np.arange(steps), stack["focused"], stack["columns"], stack["even"], stack["shared"],
                   {"L00": t}), path / "attention.npz")
    return load_run(path)


def test_the_curve_counts_the_onsets_of_each_setting(tmp_path):
    """Two runs: one collapsing from step 20 on both sides (the detectors from the observations' step 20, the
    truth from the maps' 20), one on neither. At the default, one onset each side, both; with few_columns at
    1/64 (half a column of the maps' 32 rows: no count of columns is few) the truth has none."""
    runs = [_mapped_run(tmp_path, RunSpec("lm", 0, 5e-3, 150), 20), _mapped_run(tmp_path, RunSpec("lm", 1, 5e-3, 150),
                                                                                None)]
    rows = agree.curve(runs, sweep={"few_columns": (1 / 64, 1 / 16)})
    assert [(v, a.truth, a.detectors, a.both) for _, v, a in rows] == [(1 / 64, 0, 1, 0), (1 / 16, 1, 1, 1)]
    text = agree.table(rows)
    assert "| few_columns | 1/64 | 0 | 1 | 0 | 0 | 1 | 0.00 | - |" in text
    assert "| few_columns | **1/16** | 1 | 1 | 1 | 0 | 0 | 1.00 |" in text


def test_the_command_prints_the_curve_and_draws_it(tmp_path, monkeypatch, capsys):
    _mapped_run(tmp_path / "runs", RunSpec("lm", 0, 5e-3, 150), 20)
    write_run(tmp_path / "runs", RunSpec("lm", 2, 5e-3, 150), collapsing(150))  # no maps: skipped, named
    monkeypatch.setattr(agree, "SWEEP", {"queries": (0.9, 0.99)})
    monkeypatch.setattr("sys.argv", ["agree", str(tmp_path / "runs"), "--figure", str(tmp_path / "curve.png")])
    agree.main()
    out = capsys.readouterr().out
    assert "| queries | **0.9** | 1 | 1 | 1 | 0 | 0 | 1.00 |" in out
    assert "1 runs with their attention maps (1 others skipped: lm-lr0.005-s2)" in out
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
