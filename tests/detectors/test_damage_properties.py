"""collapse_damage over families of loss curves (hypothesis): critical means a run a user should stop.

A 2-head layer collapses at an onset anywhere in the run and stays collapsed; the loss of every step follows a
curve of one family with multiplicative and additive noise and spikes that come back down; the detectors see it
at a loss cadence of 1 to 100 steps as the Monitor gives it (``loss_mean``, the mean since the previous sample)
and attention every 10 steps (or at every loss sample when rarer). Healthy curves (power law, exponential, warmup
+ cosine and warmup-stable-decay schedules the loss follows, a power law in the schedule's progress, a late drop)
get no critical record, whatever the onset, the length (to 20,000 steps) and the cadence. Damaged curves (the loss
rises after the collapse and stays up, or stops falling there while it fell fast) get one within the delay
docs/alerts.md#collapse_damage states: two windows and a sample (four samples where the loss is sampled rarely)
after the loss stays above the line it is read against by twice the margin, and a stop within the trend's
horizon. Each run is a cheap loop of Observations through the attention states and the damage detector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from diag.detectors import AlertConfig, Observation
from diag.detectors.damage import CollapseDamage
from diag.detectors.states import AttentionStates
from diag.detectors.trend import MIN_FIT, Series, fit_trend

ATTENTION_EVERY = 10
COLLAPSED = {"attn_entropy": np.array([0.1, 0.1]), "attn_rank": np.array([2.0, 2.0]),
             "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}
SPREAD = {"attn_entropy": np.array([3.0, 3.0]), "attn_rank": np.array([40.0, 40.0]),
          "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}


def schedule(kind: str, n: int, warmup: int, decay: float, floor: float) -> np.ndarray:
    """The learning rate of every step, peak 1: constant, warmup + cosine to ``floor``, or warmup-stable-decay
    (linear to 0 over the last ``decay`` of the run)."""
    s = np.arange(n, dtype=np.float64)
    warm = np.minimum(1.0, (s + 1) / max(warmup, 1))
    if kind == "cosine":
        progress = np.clip((s - warmup) / max(n - warmup, 1), 0.0, 1.0)
        return warm * (floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * progress)))
    if kind == "wsd":
        start = n * (1 - decay)
        return warm * np.clip((n - s) / max(n - start, 1), 0.0, 1.0)
    return warm


@dataclass
class Curve:
    """A family member: the loss of every step without noise."""

    family: str
    n: int
    a: float  # the floor
    b: float  # the height above it
    scale: float  # the time constant, in steps (of the schedule's progress for the schedule families)
    power: float
    warmup: int
    decay: float
    floor_lr: float
    lr_term: float  # the part of the loss the learning rate holds up (falls with it)
    depth: float = 0.1  # late_drop: the drop, a fraction of the loss ...
    width: float = 20.0  # ... over about 4 widths of steps

    def loss(self) -> np.ndarray:
        s = np.arange(self.n, dtype=np.float64)
        if self.family == "power":
            return self.a + self.b * (1 + s / self.scale) ** -self.power
        if self.family == "exponential":
            return self.a + self.b * np.exp(-s / self.scale)
        if self.family == "late_drop":  # a power law, and a sudden drop by depth (an induction head, a Eureka moment)
            base = self.a + self.b * (1 + s / self.scale) ** -self.power
            return base * (1 - self.depth / 2 * (1 + np.tanh((s - self.n * self.decay) / (2 * self.width))))
        lr = schedule("cosine" if self.family in ("cosine", "cosine_power") else "wsd", self.n, self.warmup,
                      self.decay, self.floor_lr)
        progress = np.cumsum(lr)
        held = self.lr_term * np.where(s < self.warmup, 1.0, lr)  # only falls: none of it rises with the warmup
        if self.family == "cosine_power":
            return self.a + self.b * (1 + progress / self.scale) ** -self.power + held
        return self.a + self.b * np.exp(-progress / self.scale) + held


FAMILIES = ("power", "exponential", "cosine", "wsd", "cosine_power", "late_drop")


@st.composite
def curves(draw, family: str, n_max: int = 20_000) -> Curve:
    n = int(round(math.exp(draw(st.floats(math.log(300), math.log(n_max))))))
    scale = math.exp(draw(st.floats(math.log(5), math.log(max(n, 10)))))
    return Curve(family, n, a=draw(st.floats(0.3, 3.0)), b=draw(st.floats(0.5, 8.0)), scale=scale,
                 power=draw(st.floats(0.2, 1.5)), warmup=draw(st.integers(0, max(n // 10, 1))),
                 decay=draw(st.floats(0.1, 0.3)) if family != "late_drop" else draw(st.floats(0.1, 0.9)),
                 floor_lr=draw(st.floats(0.0, 0.1)), lr_term=draw(st.floats(0.0, 0.3)),
                 depth=draw(st.floats(0.05, 0.4)), width=draw(st.floats(2.0, 100.0)))


@st.composite
def noises(draw) -> tuple[float, float, int, int]:
    """(multiplicative deviation, additive deviation, spikes, seed)."""
    return (draw(st.floats(0.0, 0.03)), draw(st.floats(0.0, 0.02)), draw(st.integers(0, 6)),
            draw(st.integers(0, 2**31 - 1)))


def noisy(loss: np.ndarray, mult: float, add: float, spikes: int, seed: int, decay: float = 10.0) -> np.ndarray:
    """``loss`` with noise at every step and ``spikes`` spikes (up to the loss's own level), each decaying with a
    time constant of up to ``decay`` steps."""
    rng = np.random.default_rng(seed)
    n = len(loss)
    out = loss * (1 + mult * rng.standard_normal(n)) + add * rng.standard_normal(n)
    s = np.arange(n)
    for at, height, length in zip(rng.integers(0, n, spikes), rng.uniform(0.1, 1.0, spikes),
                                  rng.uniform(1, decay, spikes)):
        after = s >= at
        out[after] += height * loss[at] * np.exp(-(s[after] - at) / length)
    return out


def samples(losses: np.ndarray, every: int) -> list[tuple[int, float, float]]:
    """(step, that step's loss, the mean loss since the previous sample) at a loss cadence of ``every`` steps, as
    the Monitor gives them."""
    sums = np.concatenate([[0.0], np.cumsum(losses)])
    steps = np.arange(0, len(losses), every)
    means = (sums[steps + 1] - sums[np.concatenate([[0], steps[:-1] + 1])]) / np.diff(steps, prepend=-1)
    return list(zip(steps.tolist(), losses[steps].tolist(), means.tolist()))


def replay(losses: np.ndarray, onset: int, every: int, cfg: AlertConfig | None = None) -> list:
    """The attention states and the damage detector over ``losses`` (one per step) at a loss cadence of ``every``
    steps, the layer collapsed from ``onset`` on: their records."""
    cfg = cfg or AlertConfig()
    states = AttentionStates(cfg.states)
    damage = CollapseDamage(cfg.damage, states, cfg.states.exit_dwell)
    attention_every = max(every, ATTENTION_EVERY)
    out = []
    for step, loss, mean in samples(losses, every):
        layers = {"L00": COLLAPSED if step >= onset else SPREAD} if step % attention_every == 0 else {}
        obs = Observation(step, loss, layers, mean)
        out += states.observe(obs) + damage.observe(obs)
    return out


def critical(records: list) -> list:
    return [(a.step, a.kind, a.since) for a in records if a.level == "critical"]


CADENCES = (1, 10, 100)
EXAMPLES = {1: 2, 10: 6, 100: 12}  # per family: a run sampled at every step costs 100 times one sampled every 100
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                derandomize=True, database=None)


@pytest.mark.parametrize("every", CADENCES)
@pytest.mark.parametrize("family", FAMILIES)
def test_healthy_curves_get_no_critical_record(family, every):
    """Every loss curve slows down; none of these is damaged by construction, whatever the layer does."""

    @settings(max_examples=EXAMPLES[every], **SETTINGS)
    @given(curve=curves(family), noise=noises(), where=st.floats(0.0, 1.0))
    def check(curve, noise, where):
        onset = int(where * (curve.n - 1))
        assert critical(replay(noisy(curve.loss(), *noise), onset, every)) == []

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_healthy_curves_of_20000_steps_sampled_at_every_step_get_no_critical_record(family):
    curve = Curve(family, 20_000, a=1.5, b=4.0, scale=300.0, power=0.6, warmup=500, decay=0.2, floor_lr=0.05,
                  lr_term=0.2, depth=0.2, width=30.0)
    for onset in (400, 10_000):
        assert critical(replay(noisy(curve.loss(), 0.02, 0.01, 4, onset), onset, 1)) == []


def delay(w: int, every: int) -> int:
    """The delay docs/alerts.md#collapse_damage states: two windows and a sample, or four samples."""
    return max(2 * w + every, 4 * every)


def evidence_from(losses: np.ndarray, noiseless: np.ndarray, since: int, every: int, cfg: AlertConfig,
                  trend_too: bool) -> int | None:
    """The first loss sample from which the noiseless loss (its mean between samples) stays above the lines the
    detector reads by twice its margin, with the trend the detector fits before ``since`` (the record's
    ``loss_at_collapse``, ``loss_margin``): (a) the level at the collapse, or with ``trend_too`` (b) the trend's
    most pessimistic continuation, within its horizon; None when it never does."""
    damage = cfg.damage
    trend = fit_trend(Series([(s, m) for s, _, m in samples(losses, every) if s < since]), since, damage.damage_fit,
                      damage.damage_window)
    if not trend.fits:
        return None
    margin = max(damage.damage_rel * abs(trend.at), damage.damage_noise * trend.noise)
    after = [(s, m) for s, _, m in samples(noiseless, every) if s > since]
    steps = np.array([s for s, _ in after])
    means = np.array([m for _, m in after])
    # (line, the last step its evidence may start at): (a) any; (b) where the record can still come within the
    # trend's horizon
    lines = [(np.maximum(trend.at, trend.line(steps)), math.inf)]
    if trend_too and trend.slowing:
        lines.append((trend.line(steps), trend.horizon - delay(damage.damage_window, every)))
    found = []
    for line, last in lines:
        read = steps <= last
        below = np.flatnonzero(means[read] <= line[read] + 2 * margin)
        first = 0 if not len(below) else below[-1] + 1  # above from this sample on (up to the last one read)
        if first < read.sum():
            found.append(int(steps[first]))
    return min(found, default=None)


@st.composite
def small_noise(draw) -> tuple[float, float, int, int]:
    return draw(st.floats(0.0, 0.01)), draw(st.floats(0.0, 0.005)), 0, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("every", CADENCES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_loss_that_rises_after_the_collapse_and_stays_up_is_critical_within_the_delay(family, every):
    """After the collapse the loss leaves its curve upward: by 15-50% of its level, at once or over up to 500
    steps, and stays there."""
    cfg = AlertConfig()

    @settings(max_examples=EXAMPLES[every], **SETTINGS)
    @given(curve=curves(family, n_max=5_000), noise=small_noise(), where=st.floats(0.1, 0.8),
           jump=st.floats(0.15, 0.5), ramp=st.integers(0, 500))
    def check(curve, noise, where, jump, ramp):
        attention_every = max(every, ATTENTION_EVERY)
        since = max(int(where * curve.n) // attention_every, 1) * attention_every
        healthy = curve.loss()
        s = np.arange(curve.n)
        noiseless = np.where(s < since, healthy, healthy[since] * (1 + jump * np.minimum(1, (s - since + 1) /
                                                                                          max(ramp, 1))))
        losses = noisy(noiseless, *noise)
        found = critical(replay(losses, since, every, cfg))
        assert all(step > since for step, _, _ in found)
        start = evidence_from(losses, noiseless, since, every, cfg, trend_too=False)
        assume(start is not None and start + delay(cfg.damage_window, every) < curve.n)
        assert found and found[0][0] <= start + delay(cfg.damage_window, every), (found, start)
        assert found[0][1:] == ("collapse_damage", since)
        judged.append(since)

    judged: list[int] = []
    check()
    assert len(judged) >= EXAMPLES[every] // 2  # not a test of nothing: the assumptions keep most examples


@pytest.mark.parametrize("every", CADENCES)
@pytest.mark.parametrize("family", ("exponential", "power"))
def test_a_loss_that_stops_falling_at_the_collapse_while_it_fell_fast_is_critical_within_the_delay(family, every):
    """Before the collapse the loss falls fast (by 25% of its level or more over the part of the next span in which
    the evidence must begin, the span less the delay) and slows down as these curves do, with a time constant the
    fitted span shows (a quarter of it to all of it), from a height of half to three times its floor above it; at
    the collapse it stops: it sits above where its trend was heading. (After a plunge, a power law whose span
    before the collapse covers more of its time, no trend says where the loss would have levelled off:
    docs/alerts.md#collapse_damage.)"""
    cfg = AlertConfig()
    span = max(cfg.damage.damage_fit, MIN_FIT * every)  # what the trend is fitted over

    @settings(max_examples=EXAMPLES[every], **SETTINGS)
    @given(floor=st.floats(0.3, 3.0), height=st.floats(0.5, 3.0), tau=st.floats(0.25, 1.0),
           power=st.floats(3.0, 4.0), noise=small_noise(), later=st.integers(0, 5))
    def check(floor, height, tau, power, noise, later):
        attention_every = max(every, ATTENTION_EVERY)
        since = (span // attention_every + 1 + later) * attention_every
        s = np.arange(since + 2 * span, dtype=np.float64)
        if family == "exponential":
            healthy = floor + height * floor * np.exp(-(s - since) / (tau * span))
        else:  # a power law whose fall at the collapse has that time constant, past its plunge: over the span
            # before the collapse its time s + s0 grows by a factor of 1.5 at most
            assume(power * tau >= 3)
            s0 = power * tau * span - since
            healthy = floor + height * floor * ((s + s0) / (since + s0)) ** -power
        # fast: by 25% of its level before the evidence must have begun for the record to come within the horizon
        assume(healthy[since] - healthy[since + span - delay(cfg.damage.damage_window, every)] >= 0.25 * healthy[since])
        noiseless = np.where(s < since, healthy, healthy[since])
        losses = noisy(noiseless, *noise)
        found = critical(replay(losses, since, every, cfg))
        start = evidence_from(losses, noiseless, since, every, cfg, trend_too=True)
        # critical within the trend's horizon, and within the delay of its evidence where that is clear (twice the
        # margin above the line)
        assert found and since < found[0][0] <= since + span + every, found
        assert start is None or found[0][0] <= start + delay(cfg.damage_window, every), (found, start)
        assert found[0][1:] == ("collapse_damage", since)
        judged.append(since)

    judged: list[int] = []
    check()
    assert len(judged) >= EXAMPLES[every] // 2  # not a test of nothing: the assumptions keep most examples


def falling(s):  # tests/detectors/test_damage.py's healthy curve
    return 4.0 / (1.0 + s / 50.0) + 1.0


@pytest.mark.parametrize("loss, collapse, steps", [
    (falling, 200, 2_000),
    (lambda s: 1.5 + 2.5 * math.exp(-s / 50), 120, 1_500),
    (lambda s: 1.5 + 2.5 * math.exp(-s / 100), 120, 1_500),
    (lambda s: 1.5 + 2.5 * math.exp(-s / 200), 120, 1_500),
    (lambda s: 2 + 6 * (1 + s) ** -0.5, 300, 5_000)])
def test_healthy_curves_that_slow_down_after_a_collapse_get_a_stall_warning_and_no_critical_record(
        loss, collapse, steps):
    """The curves whose flattening once made a critical record: the layer collapses and stays collapsed, the
    loss follows its healthy curve, sampled every 10 steps (tests/detectors/test_damage.py's harness). A stall
    warning, which says what to check, and no critical record."""
    records = replay(np.array([loss(s) for s in range(steps)]), collapse, 10)
    assert critical(records) == []
    stalls = [a for a in records if a.kind == "collapse_stall"]
    assert stalls and stalls[0].level == "warning" and "run you trust" in stalls[0].message
