"""collapse_damage (critical) and collapse_stall (warning): a layer's malignant collapse (not the model's baseline)
and a loss that, after it, rose and stays up or stopped well above the trend it had (critical), or merely stopped
falling (a warning: every loss curve slows down); never a run whose loss keeps falling or had already stopped.
Families of curves: test_damage_properties.py."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from diag.detectors import AlertConfig, Detectors, Observation, TrainingHalted
from diag.detectors.config import DamageConfig
from diag.errors import ConfigError
from diag.outputs.alert_sink import AlertSink
from diag.outputs.sinks import FanOut


def attn(entropy, rank, rows=64.0, uniform=3.5):
    return {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
            "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}


def script(loss, collapse_from, steps=400, every=10, first_inside=False):
    """A 2-head layer, both heads malignant from ``collapse_from`` (from the first sample with ``first_inside``),
    the loss ``loss(step)``; sampled every ``every`` steps."""
    for s in range(0, steps, every):
        inside = s >= collapse_from or (first_inside and s == 0)
        m = attn([0.1, 0.1], [2.0, 2.0]) if inside else attn([3.0, 3.0], [40.0, 40.0])
        yield Observation(s, loss(s), {"L00": m})


def run(loss, collapse_from, steps=400, every=10, first_inside=False, cfg=None):
    """The detectors' records over :func:`script`."""
    det = Detectors(cfg or AlertConfig())
    return [a for o in script(loss, collapse_from, steps, every, first_inside) for a in det.observe(o)]


def damage(out, kind="collapse_damage"):
    return [(a.step, a.level, a.where, a.since, a.status) for a in out if a.kind == kind]


def falling(s):  # a healthy loss curve: 4 / (1 + s/50) + 1
    return 4.0 / (1.0 + s / 50.0) + 1.0


def rising(s):
    """``falling`` to the collapse at 400, then up by 30% over 100 steps; back on ``falling`` from 700."""
    if 400 <= s < 700:
        return falling(400) * (1 + 0.3 * min(1.0, (s - 400) / 100))
    return falling(s)


def fast(s):
    """A loss that falls fast, slowing down as 1 + 3 exp(-s / 100), and stops at the collapse at 300."""
    return 1.0 + 3.0 * math.exp(-min(s, 300) / 100.0)


def healthy(s):
    """A healthy curve that slows down: 1.5 + 2.5 exp(-s / 100)."""
    return 1.5 + 2.5 * math.exp(-s / 100.0)


def test_a_collapse_after_which_a_healthy_loss_slows_down_is_a_stall_warning_not_a_critical_record():
    """The layer collapses at 120 and stays collapsed; the loss follows ``healthy``, which falls by less than 1%
    per 50 steps from 470 on: the stall warning at 470, dated from the collapse's start, with what to check. The
    loss never sits above its trend: no critical record."""
    out = run(healthy, collapse_from=120, steps=1500)
    assert damage(out, "collapse_stall") == [(470, "warning", "L00", 120, "firing")]
    assert damage(out) == []
    record = next(a for a in out if a.kind == "collapse_stall")
    assert "since step 120" in record.message and "run you trust" in record.message
    assert "learning-rate schedule" in record.message and "What to do" in record.message
    assert record.values["loss_fall_before"] > 0.01 > record.values["loss_fall_since"] >= 0
    assert [(a.level, a.where) for a in out if a.kind == "malignant_collapse"] == [("warning", "L00/H00+H01"),
                                                                                   ("warning", "L00")]


def test_a_loss_that_stops_at_the_collapse_right_after_its_first_plunge_is_a_stall_warning_only():
    """The layer collapses at 200 (established at 210); the loss falls 8% per 50 steps until then and stays flat
    from 200 on. From 250 (a window after the start) the last 50 steps did not fall: the stall warning, dated from
    the collapse's start. No critical record: the 200 steps before the collapse hold the first steps' plunge
    (from 5.0 to 1.8), which no slowing exponential follows, so no trend says where the loss would have levelled
    off; and it never rose above its level at the collapse."""
    out = run(lambda s: falling(min(s, 200)), collapse_from=200)
    assert damage(out, "collapse_stall") == [(250, "warning", "L00", 200, "firing")]
    assert damage(out) == []


def test_a_loss_that_stops_falling_well_above_the_trend_it_had_is_critical():
    """``fast`` falls 8% per 50 steps at the collapse (300) and stops there. Its trend over the 200 steps before
    the collapse says where it was heading (1 + 3 exp(-s / 100), to 1.02 at 500): the loss sits above that
    continuation by more than 5% of its level (0.057) at every sample of 400-440 and the window before: critical at
    440, after the stall warning at 350."""
    out = run(fast, collapse_from=300, steps=600)
    assert damage(out, "collapse_stall") == [(350, "warning", "L00", 300, "firing")]
    assert damage(out) == [(440, "critical", "L00", 300, "firing")]
    record = next(a for a in out if a.kind == "collapse_damage")
    assert "well above the trend it had" in record.message and "What to do" in record.message
    assert abs(record.values["loss_at_collapse"] - fast(300)) < 1e-3
    assert record.values["loss_since_collapse"] - record.values["loss_trend"] > record.values["loss_margin"]


def test_a_loss_that_rises_after_the_collapse_and_stays_up_is_critical_and_resolves_when_it_falls_again():
    """``rising``: from the collapse at 400 the loss rises above its level there (1.45) by more than its margin (5%,
    0.072) from step 420 on; every sample of a window 470-510 and of the one before sits above it, rising: critical
    at 510. Back on its falling curve at 700, below that level: resolved once it stayed so for exit_dwell."""
    out = run(rising, collapse_from=400, steps=1000)
    rows = damage(out)
    assert rows[0] == (510, "critical", "L00", 400, "firing")
    assert rows[1][1:] == ("info", "L00", 460, "resolved") and 700 < rows[1][0] <= 760
    record = next(a for a in out if a.kind == "collapse_damage")
    assert f"rose above its level at the collapse ({falling(400):.2f}" in record.message


def test_a_loss_spike_that_comes_back_down_is_no_damage():
    """After the collapse the loss doubles and holds for 60 steps, a whole window, then comes back down: no critical
    record (the loss must stay up, not falling, at two samples a window apart)."""
    def spiked(s):
        return 2 * falling(500) if 500 <= s < 560 else falling(s)
    assert damage(run(spiked, collapse_from=400, steps=1000)) == []
    assert damage(run(lambda s: 2 * falling(500) if 500 <= s < 620 else falling(s), collapse_from=400,
                      steps=1000))[0][:2] == (590, "critical")  # up for two windows (from 500): no spike any more


def test_a_collapse_while_the_loss_keeps_falling_is_no_damage():
    out = run(falling, collapse_from=200)
    assert damage(out) == [] and damage(out, "collapse_stall") == []


def test_a_collapse_after_the_loss_had_stopped_falling_is_no_damage():
    """A converged run: the loss is flat from 100 on, before the collapse at 250 as after it."""
    out = run(lambda s: falling(min(s, 100)), collapse_from=250)
    assert damage(out) == [] and damage(out, "collapse_stall") == []


def test_the_baseline_is_no_damage_whatever_the_loss_does():
    """Both heads collapsed when monitoring began (a pretrained model's state), the loss flat or rising: no
    record."""
    for loss in (lambda s: 2.0 + (s == 0), lambda s: 2.0 + s / 100):
        out = run(loss, collapse_from=0, first_inside=True)
        assert damage(out) == [] and damage(out, "collapse_stall") == []


def test_an_early_collapse_reads_windows_of_three_samples_or_more():
    """A collapse at 40, the loss sampled every 2 steps and flat from 40 on: a stall warning at 90, one window of
    50 steps after the start; too few steps before the collapse to trust a trend, and no rise: no critical."""
    out = run(lambda s: falling(min(s, 40)), collapse_from=40, steps=200, every=2)
    assert damage(out, "collapse_stall")[0][:4] == (90, "warning", "L00", 40)
    assert damage(out) == []


def test_a_loss_sampled_rarely_is_read_over_three_samples():
    """Sampled every 100 steps, a window is 3 samples (300 steps): the rise after a collapse at 2,000 is seen
    at 2,300 and critical at the next sample, two samples spanning the damage window."""
    def loss(s):
        return falling(s) if s < 2000 else falling(2000) * 1.3
    out = run(loss, collapse_from=2000, steps=3000, every=100)
    assert damage(out) == [(2400, "critical", "L00", 2000, "firing")]


def test_damage_rel_and_damage_noise_set_the_margin():
    """A rise by 8% of the level at the collapse, flat after it: over the 5% margin; under a 20% one, even against
    the trend (which falls 3% below the level within its horizon); under a margin of a million noise deviations."""
    def loss(s):
        return falling(s) if s < 400 else falling(400) * 1.08
    assert damage(run(loss, collapse_from=400, steps=800))
    assert damage(run(loss, collapse_from=400, steps=800, cfg=AlertConfig(damage_rel=0.2))) == []
    assert damage(run(loss, collapse_from=400, steps=800, cfg=AlertConfig(damage_noise=1e6))) == []
    assert DamageConfig().damage_rel == 0.05 and DamageConfig().stall_rel == 0.01


def test_the_damage_and_the_stall_survive_a_resume_at_any_point():
    """Cut anywhere (before the collapse, between the trend's fit and the records, inside the episodes): the
    resumed detectors continue exactly."""
    observations = list(script(rising, collapse_from=400, steps=1000))
    whole = Detectors(AlertConfig())
    expected = [(a.step, a.kind, a.status, a.since, a.message) for o in observations for a in whole.observe(o)]
    assert {k for _, k, s, _, _ in expected if s == "firing"} >= {"collapse_damage", "collapse_stall"}
    for cut in (30, 41, 45, 48, 52, 60, 75, 90):
        first = Detectors(AlertConfig())
        got = [(a.step, a.kind, a.status, a.since, a.message) for o in observations[:cut] for a in first.observe(o)]
        resumed = Detectors(AlertConfig())
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += [(a.step, a.kind, a.status, a.since, a.message) for o in observations[cut:]
                for a in resumed.observe(o)]
        assert got == expected, cut


def test_stop_on_critical_stops_at_the_damage_record_never_at_the_stall_warning():
    """The stall of a healthy curve that slows down is a warning: the run goes on; the damage record stops it."""
    def halted(loss, collapse_from, steps):
        det, sink = Detectors(AlertConfig()), AlertSink(FanOut([]), None, stop_on_critical=True)
        try:
            for o in script(loss, collapse_from, steps):
                sink.emit(det.observe(o))
        except TrainingHalted as stop:
            return stop.alert.step, stop.alert.kind
        return None

    assert halted(healthy, 120, 1500) is None
    assert halted(fast, 300, 600) == (440, "collapse_damage")


def test_a_state_without_trends_or_stalls_loads_and_goes_on_from_the_samples_it_kept():
    """A detector state that kept only the loss samples and the damage episodes: the trend is fitted from the
    samples still there, and the records go on."""
    observations = list(script(rising, collapse_from=400, steps=1000))
    first = Detectors(AlertConfig())
    for o in observations[:45]:
        first.observe(o)
    state = json.loads(json.dumps(first.state_dict()))
    state["damage"] = {"losses": state["damage"]["losses"], "episodes": state["damage"]["episodes"]}
    resumed = Detectors(AlertConfig())
    resumed.load_state_dict(state)
    out = [a for o in observations[45:] for a in resumed.observe(o)]
    assert damage(out)[0][:2] == (510, "critical")


def test_the_damage_fields_are_checked():
    for bad, words in ((dict(damage_fit=1), "damage_fit=1: expected a number of steps in [2"),
                       (dict(damage_rel=5), "damage_rel=5: expected a fraction"),
                       (dict(damage_noise=0), "damage_noise=0: expected a positive number"),
                       (dict(stall_rel="1%"), "stall_rel='1%': expected a number")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            AlertConfig(**bad)
