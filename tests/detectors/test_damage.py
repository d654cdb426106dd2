"""collapse_damage, the critical record: a layer's malignant collapse (not the model's baseline) and a loss that
learned before it and stopped after it; never a run whose loss keeps falling or had already stopped."""

from __future__ import annotations

import numpy as np

from diag.detectors import AlertConfig, Detectors, Observation


def attn(entropy, rank, rows=64.0, uniform=3.5):
    return {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
            "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}


def run(loss, collapse_from, steps=400, every=10, first_inside=False):
    """A 2-head layer, both heads malignant from ``collapse_from`` (from the first sample with ``first_inside``),
    the loss ``loss(step)``; sampled every ``every`` steps. Returns the detectors' records."""
    det, out = Detectors(AlertConfig()), []
    for s in range(0, steps, every):
        inside = s >= collapse_from or (first_inside and s == 0)
        m = attn([0.1, 0.1], [2.0, 2.0]) if inside else attn([3.0, 3.0], [40.0, 40.0])
        out += det.observe(Observation(s, loss(s), {"L00": m}))
    return out


def damage(out):
    return [(a.step, a.level, a.where, a.since, a.status) for a in out if a.kind == "collapse_damage"]


def falling(s):  # a healthy loss curve: 4 / (1 + s/50) + 1
    return 4.0 / (1.0 + s / 50.0) + 1.0


def test_a_collapse_after_which_the_loss_stops_falling_is_critical():
    """The layer collapses at 200 (established at 210); the loss falls until then and stays flat from 200 on.
    w = 50 steps: the loss fell over 150-200 (by 8% of its level), and from 250 (w after the start) the last 50
    steps did not fall: the critical record at 250, dated from the collapse's start."""
    out = run(lambda s: falling(min(s, 200)), collapse_from=200)
    assert damage(out) == [(250, "critical", "L00", 200, "firing")]
    record = next(a for a in out if a.kind == "collapse_damage")
    assert "since step 200" in record.message and "What to do" in record.message
    assert record.values["loss_fall_before"] > 0.05 and record.values["loss_fall_since"] == 0.0
    assert [(a.level, a.where) for a in out if a.kind == "malignant_collapse"] == [("warning", "L00/H00+H01"),
                                                                                   ("warning", "L00")]


def test_a_collapse_while_the_loss_keeps_falling_is_no_damage():
    assert damage(run(falling, collapse_from=200)) == []


def test_a_collapse_after_the_loss_had_stopped_falling_is_no_damage():
    """A converged run: the loss is flat from 100 on, before the collapse at 250 as after it."""
    assert damage(run(lambda s: falling(min(s, 100)), collapse_from=250)) == []


def test_the_baseline_is_no_damage_whatever_the_loss_does():
    """Both heads collapsed when monitoring began (a pretrained model's state), the loss flat: no record."""
    assert damage(run(lambda s: 2.0 + (s == 0), collapse_from=0, first_inside=True)) == []


def test_a_rising_loss_after_a_collapse_is_damage_and_it_resolves_when_the_loss_falls_again():
    def loss(s):
        return falling(s) if s < 200 else falling(200) + 0.002 * (s - 200) if s < 300 else falling(s - 250)
    out = run(loss, collapse_from=200, steps=500)
    rows = damage(out)
    assert rows[0] == (250, "critical", "L00", 200, "firing")
    assert rows[1][4] == "resolved" and rows[1][0] > 300


def test_an_early_collapse_compares_windows_of_half_its_start():
    """A collapse at 40: w = 20 steps (half the steps before it), judged from step 60 on."""
    out = run(lambda s: falling(min(s, 40)), collapse_from=40, steps=200, every=2)
    assert damage(out)[0][:4] == (60, "critical", "L00", 40)


def test_the_damage_survives_a_resume():
    det, whole = Detectors(AlertConfig()), []
    script = []
    for s in range(0, 400, 10):
        m = attn([0.1, 0.1], [2.0, 2.0]) if s >= 200 else attn([3.0, 3.0], [40.0, 40.0])
        script.append(Observation(s, falling(min(s, 200)), {"L00": m}))
    whole = [a for o in script for a in det.observe(o)]
    first = Detectors(AlertConfig())
    out = [a for o in script[:22] for a in first.observe(o)]
    second = Detectors(AlertConfig())
    second.load_state_dict(first.state_dict())
    out += [a for o in script[22:] for a in second.observe(o)]
    assert out == whole and damage(whole)
