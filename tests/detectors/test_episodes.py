"""Episodes: hysteresis, dwells in steps, one record at each end; the same episode at every 2 and 20."""

from __future__ import annotations

import numpy as np

from diag.detectors import AlertConfig, Detectors, Observation
from diag.detectors.episodes import Closed, Dwell, Episodes, Opened


def attn(entropy, rank, rows=64.0, uniform=4.1):
    return {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
            "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}


def test_dwell_counts_samples_and_steps():
    assert not Dwell(2, 10).met(2, 5) and Dwell(2, 10).met(2, 10) and not Dwell(2, 10).met(1, 50)
    assert Dwell(1, 10).met(1, 0)  # one sample: at once


def test_episode_opens_after_dwell_and_closes_once_after_exit_dwell():
    ep = Episodes(Dwell(2, 10), Dwell(2, 20))
    events = {}
    script = [(0, True, False), (5, True, False), (10, True, False), (15, False, False), (20, False, True),
              (25, True, False), (30, False, True), (40, False, True), (50, False, True), (60, True, False)]
    for step, inside, outside in script:
        events[step] = ep.update("k", step, inside, outside)
    assert events[10] == Opened(0)  # 2 samples spanning 10 steps
    assert events[25] is None and events[40] is None  # the exit dwell restarted at 30 after 25 was inside
    assert events[50] == Closed(0, 30) and events[50].duration == 30
    assert [s for s, e in events.items() if e is not None] == [10, 50]
    assert events[60] is None and ep.since("k") == 60  # a new candidate, not yet an episode


def _flapping_head(every: int) -> list:
    """A head malignant from step 100 to 400 that regains rank (benign) every third 10-step block, then healthy."""
    det, out = Detectors(), []
    for step in range(0, 600, every):
        if 100 <= step < 400:
            e, r = (0.2, 3.0) if (step // 10) % 3 else (0.3, 9.0)  # 9 > the low-rank line 7.3: benign for a while
        else:
            e, r = 3.0, 30.0
        out += det.observe(Observation(step, None, {"L00": attn([e], [r])}))
    return out


def test_a_flapping_head_is_one_episode_at_any_sampling_interval():
    for every in (2, 5, 10, 20):
        out = _flapping_head(every)
        # one head in a one-head layer: the head's episode and the layer's, each one firing and one resolved
        malignant = [(a.status, a.since, a.where) for a in out if a.kind == "malignant_collapse"]
        assert malignant == [("firing", 100, "L00/H00"), ("firing", 100, "L00"), ("resolved", 100, "L00/H00"),
                             ("resolved", 100, "L00")], (every, malignant)
        assert not [a for a in out if a.kind == "benign_collapse"], every  # no benign flaps inside the episode
        resolved = [a for a in out if a.kind == "malignant_collapse" and a.status == "resolved"][0]
        assert resolved.values["duration_steps"] == 300 and resolved.level == "info"


def test_heads_of_a_layer_that_start_together_are_one_record():
    det, out = Detectors(AlertConfig(collapse_persist=1)), []
    det.observe(Observation(0, None, {"L03": attn([3.0, 3.0, 3.0], [30.0, 30.0, 30.0])}))  # monitoring begins
    for step in (5, 10):
        out += det.observe(Observation(step, None, {"L03": attn([0.1, 0.1, 3.0], [2.0, 2.0, 30.0])}))
    # two of three heads (layer_needs: 2) are also the layer's collapse: the heads' record (one for both) and the
    # layer's
    heads, layer = out
    assert (heads.kind, heads.where, heads.level, heads.heads) == ("malignant_collapse", "L03/H00+H01", "warning",
                                                                   ("L03/H00", "L03/H01"))
    assert heads.message.startswith("2 heads together") and heads.values["heads"] == 2
    assert (layer.where, layer.level, layer.heads) == ("L03", "warning", ("L03/H00", "L03/H01"))


def test_a_sample_between_the_lines_while_open_does_not_restart_the_exit_dwell():
    """Neither test holding changes nothing, open or not: the exit dwell that began at 20 ends at 30."""
    ep = Episodes(Dwell(1, 0), Dwell(2, 10))
    assert ep.update("k", 0, True, False) == Opened(0)
    assert ep.update("k", 20, False, True) is None  # the exit dwell starts
    assert ep.update("k", 25, False, False) is None  # between the lines: neither in nor out
    assert ep.update("k", 30, False, True) == Closed(0, 20)
