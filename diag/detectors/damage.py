"""``collapse_damage`` (critical) and ``collapse_stall`` (warning): a layer's malignant collapse that the loss shows.

A malignant collapse is attention's state; whether it hurts the run is the loss's. Both records concern a layer in
a malignant episode that began during the run at ``since`` (not the model's baseline, :mod:`diag.detectors.states`)
and read the loss the user logs (the mean loss between samples where the Monitor has it) against what it did before
``since`` (:mod:`diag.detectors.trend`: windows of ``damage_window`` steps and 3 samples or more; the trend fitted
over the ``damage_fit`` steps before ``since``, its level there and its noise). With ``margin = max(damage_rel *
level, damage_noise * noise)``, while the last window lies after ``since``:

* ``collapse_damage`` (critical) once, at two samples ``damage_window`` steps or more apart, the loss is not
  coming back down (the window falls by less than ``stall_rel``) and every sample of the window sits above
  (a) **the loss's level at the collapse** by more than the margin: it rose and stays up; or
  (b) **the most pessimistic continuation of its trend** by more than the margin, within as many steps after the
  collapse as the trend was fitted over, and only when that trend showed its fall slowing down: it stopped well
  above where it was heading.
  A spike, or a burst of them, that comes back down within two windows never counts.
* ``collapse_stall`` (warning) when the loss fell by more than ``stall_rel`` over the window before ``since`` and
  stopped falling (by less, or rose) over the last one, the evidence above or not: every loss curve slows down,
  so a stall alone is something to check against a run one trusts, not a reason to stop.

A run whose loss keeps falling gets neither; one whose loss had stopped falling before the collapse (converged)
gets no stall. A non-finite loss is :mod:`diag.detectors.nonfinite`'s critical record and is not read here. The
ground truth of damage is the evaluation's twin test (the same run with QK-norm, docs/evaluation.md).
"""

from __future__ import annotations

import math

import numpy as np

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import DamageConfig
from diag.detectors.episodes import Closed, Dwell, Episodes
from diag.detectors.states import AttentionStates
from diag.detectors.trend import MIN_FIT, MIN_WINDOW, Series, Trend, fall, fit_trend

__all__ = ["CollapseDamage"]

TODO = ALERTS["collapse_damage"].todo  # names {since}
CHECK = ALERTS["collapse_stall"].todo  # names {since}
Window = tuple[np.ndarray, np.ndarray]  # (steps, losses) of the samples of a window


def _resolved(event: Closed) -> str:
    return f"resolved: the loss falls again, or the layer left its collapse, at step {event.until}"


def _change(fall_: float) -> str:
    """A window's fall in words: "fell 3.1%", "rose 2.0%"."""
    percent = 100 * fall_
    return f"fell {abs(percent):.1f}%" if percent > -0.05 else f"rose {-percent:.1f}%"


class CollapseDamage(Detector):
    """Per layer, a ``collapse_damage`` and a ``collapse_stall`` episode, open while the layer's malignant episode
    lasts and the loss shows it (see the module docstring)."""

    def __init__(self, cfg: DamageConfig, states: AttentionStates, exit_dwell: int) -> None:
        self.cfg, self.states = cfg, states
        self.losses = Series()  # the recent finite loss samples
        self.trends: dict[str, dict[int, Trend]] = {}  # layer -> step a head's episode began -> the trend before it
        self.damage = Episodes(Dwell(2, cfg.damage_window), Dwell(2, exit_dwell))
        self.stall = Episodes(Dwell(1, 0), Dwell(2, exit_dwell))

    def observe(self, obs: Observation) -> list[Alert]:
        loss = obs.loss_mean if obs.loss_mean is not None else obs.loss
        fresh = loss is not None and math.isfinite(loss)
        if fresh:
            self.losses.add(obs.step, float(loss))
        if obs.layers:  # where the attention states can have changed
            self._note_trends()
        if not fresh:
            return []
        alerts = []
        for label in sorted(set(self.states.machine.n_heads) | set(self.damage.keys) | set(self.stall.keys)):
            alerts += self._judge(obs.step, label)
        self.losses.forget(max(self.cfg.damage_fit, self.cfg.damage_window), max(MIN_FIT, MIN_WINDOW))
        return alerts

    def _note_trends(self) -> None:
        """Fit the trend before every step at which a malignant episode of a layer's heads began, as soon as it is
        seen (the samples before that step are all here then: a layer episode that opens later begins at one of
        them); forget those no episode can begin at any more."""
        heads = self.states.head_sinces("malignant")
        for label in set(heads) | set(self.trends):
            sinces = heads.get(label, set())
            if (opened := self.states.layer_since("malignant", label)) is not None:
                sinces.add(opened)
            mine = self.trends.setdefault(label, {})
            for since in sinces - set(mine):
                mine[since] = fit_trend(self.losses, since, self.cfg.damage_fit, self.cfg.damage_window)
            for since in set(mine) - sinces:
                del mine[since]

    def _judge(self, step: int, label: str) -> list[Alert]:
        since = self.states.layer_since("malignant", label)
        if since is None or self.states.baseline(label, since):
            return self._update(step, label, since, (False, True), (False, True), {})
        mine = self.trends.setdefault(label, {})
        if since not in mine:  # a state that did not keep it: from the samples still here
            mine[since] = fit_trend(self.losses, since, self.cfg.damage_fit, self.cfg.damage_window)
        trend, w = mine[since], self.cfg.damage_window
        last = self.losses.window(w)
        after, level = fall(*last, w)
        if len(last[0]) < MIN_WINDOW or last[0][0] <= since or not math.isfinite(after):
            return []  # not judged yet: no whole window after the collapse
        values = {"loss_fall_before": trend.fall_before, "loss_fall_since": after, "loss_since_collapse": level,
                  "window_start": float(last[0][0])}
        up = self._up(trend, last, values)
        falls = after >= self.cfg.stall_rel
        stalled = trend.fall_before > self.cfg.stall_rel and not falls
        # damage: up and not coming back down; a candidate (or an episode) ends once the loss falls again below the
        # lines, as a spike's does
        return self._update(step, label, since, (up and not falls, falls and not up), (stalled, falls), values)

    def _up(self, trend: Trend, last: Window, values: dict[str, float]) -> bool:
        """Whether every sample of the window sits above line (a) or (b) by more than the margin (the module
        docstring); the figures into ``values``. Never without a trend (fewer than MIN_FIT samples before the
        collapse)."""
        if not trend.fits:
            return False
        steps, losses = last
        at = trend.at
        margin = max(self.cfg.damage_rel * abs(at), self.cfg.damage_noise * trend.noise)
        values.update({"loss_at_collapse": at, "loss_margin": margin, "loss_noise": trend.noise,
                       "trend_start": float(trend.start)})
        lines = None
        if float(losses.min()) - at > margin:  # (a), against the trend instead where that rose
            lines = trend.line(steps)
            if bool((losses - np.maximum(at, lines) > margin).all()):
                return True
        if steps[-1] > trend.horizon or not trend.slowing:
            return False
        lines = trend.line(steps) if lines is None else lines
        values["loss_trend"] = float(lines.mean())
        return bool((losses - lines > margin).all())

    def _update(self, step: int, label: str, since: int | None, damage: tuple[bool, bool],
                stall: tuple[bool, bool], values: dict[str, float]) -> list[Alert]:
        out = []
        event = self.damage.update(label, step, *damage)
        if isinstance(event, Closed):
            out.append(Alert(step, "collapse_damage", "info", label, _resolved(event),
                             {"duration_steps": float(event.duration)}, "resolved", event.since))
        elif event is not None:
            out.append(Alert(step, "collapse_damage", "critical", label, self._damage(step, since, values), values,
                             "firing", since))
        # a stall says less than the damage record: none opens beside an open one
        event = self.stall.update(label, step, stall[0] and not self.damage.active(label), stall[1])
        if isinstance(event, Closed):
            out.append(Alert(step, "collapse_stall", "info", label, _resolved(event),
                             {"duration_steps": float(event.duration)}, "resolved", event.since))
        elif event is not None:
            out.append(Alert(step, "collapse_stall", "warning", label, self._stall(since, values), values, "firing",
                             since))
        return out

    def _stall(self, since: int, v: dict[str, float]) -> str:
        w = self.cfg.damage_window
        return (f"the loss stopped falling after the layer's malignant collapse since step {since}: it "
                f"{_change(v['loss_fall_before'])} over the {w} steps before it, {_change(v['loss_fall_since'])} "
                f"over the last {w} (mean {v['loss_since_collapse']:.3f}). Every loss curve slows down: a stall alone "
                f"does not show damage. What to do: {CHECK.format(since=since)}")

    def _damage(self, step: int, since: int, v: dict[str, float]) -> str:
        window = f"every loss sample from step {v['window_start']:.0f} to {step}"
        if "loss_trend" in v and v["loss_trend"] < v["loss_at_collapse"] and \
                v["loss_since_collapse"] - v["loss_trend"] > v["loss_since_collapse"] - v["loss_at_collapse"]:
            evidence = (f"the loss stopped falling well above the trend it had: {window} sat above the most "
                        f"pessimistic continuation of its trend over steps {v['trend_start']:.0f}-{since} "
                        f"({v['loss_trend']:.3f} on average there) by more than {v['loss_margin']:.3f}")
        else:
            evidence = (f"the loss rose above its level at the collapse ({v['loss_at_collapse']:.3f}) and stays up: "
                        f"{window} sat above it by more than {v['loss_margin']:.3f}")
        return (f"the layer's malignant collapse since step {since} is hurting the run: {evidence}; the loss "
                f"{_change(v['loss_fall_since'])} over the last {self.cfg.damage_window} steps (mean "
                f"{v['loss_since_collapse']:.3f}). What to do: {TODO.format(since=since)}")

    def state_dict(self) -> dict:
        return {"damage": {"losses": self.losses.pairs(), "episodes": self.damage.state_dict(),
                           "stall": self.stall.state_dict(),
                           "trends": {label: [t.state() for t in mine.values()]
                                      for label, mine in self.trends.items()}}}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get("damage")
        if isinstance(mine, dict):
            self.losses = Series(mine.get("losses", []))
            self.damage.load_state_dict(mine.get("episodes", {}))
            self.stall.load_state_dict(mine.get("stall", {}))
            self.trends = {label: {t.since: t for t in map(Trend.of_state, trends)}
                           for label, trends in mine.get("trends", {}).items()}
