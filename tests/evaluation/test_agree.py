"""evaluation/agree.py: the ground truth's episodes against the detectors' own, every difference listed."""

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
    assert found[0].line() == ("run L00 malignant: ground truth since 20 opened 30 until 80 baseline=no | "
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
    monkeypatch.setattr("sys.argv", ["agree", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        agree.main()
    assert stop.value.code == 0
    assert "1 runs recorded at every step (0 others skipped): 0 differences on 0 runs" in capsys.readouterr().out


def test_the_command_lists_a_difference_and_exits_1(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, RunSpec("lm", 0, 5e-3, 150), collapsing(150))
    monkeypatch.setattr("diag.detectors.states.episodes_of", lambda obs, cfg: [])
    monkeypatch.setattr("sys.argv", ["agree", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        agree.main()
    assert stop.value.code == 1
    out = capsys.readouterr().out
    assert "lm-lr0.005-s0 L00 malignant: ground truth since 20 opened 30 until 80 baseline=no | detectors -" in out
