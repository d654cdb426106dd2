"""``collapse_damage``: the critical record, a layer's malignant collapse that the loss shows.

A malignant collapse is attention's state; whether it hurts the run is the loss's. A layer in a malignant episode
that began during the run (not the model's baseline, :mod:`diag.detectors.states`) is damaging it when the loss
**fell before the collapse and stopped falling after it**: with ``w`` the shorter of ``damage_window`` and half
the steps before the episode began, and a window's fall the least-squares slope of its loss samples times ``w``,
as a fraction of their mean,

* before: the ``w`` steps up to the episode's start fell by more than ``damage_rel`` (the run was learning);
* after: the last ``w`` steps, all after the start, fell by less than ``damage_rel`` (a stall), or rose.

Both are read off the loss the user logs (the mean loss between samples where the Monitor has it), so a user can
check them on the loss curve. A run whose loss keeps falling never gets this record, whatever its attention does;
one whose loss had stopped falling before the collapse (converged) neither. The ground truth of damage is the
evaluation's twin test (the same run with QK-norm, docs/evaluation.md); this record is what a live run can show.
"""

from __future__ import annotations

import math

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import DamageConfig
from diag.detectors.episodes import Closed, Dwell, Episodes
from diag.detectors.states import AttentionStates

__all__ = ["CollapseDamage"]

TODO = ALERTS["collapse_damage"].todo  # names {since}
MIN_SAMPLES = 3  # loss samples each window needs


def _fall(losses: list[tuple[int, float]], lo: int, hi: int, w: int) -> tuple[float, float]:
    """(how far the loss falls per ``w`` steps over the samples at steps in [lo, hi), as a fraction of their mean;
    that mean): the least-squares slope times ``w`` over the mean, positive when it falls. NaN with fewer than
    MIN_SAMPLES samples."""
    points = [(s, v) for s, v in losses if lo <= s < hi and math.isfinite(v)]
    if len(points) < MIN_SAMPLES or points[-1][0] == points[0][0]:
        return math.nan, math.nan
    n = len(points)
    ms, mv = sum(s for s, _ in points) / n, sum(v for _, v in points) / n
    slope = sum((s - ms) * (v - mv) for s, v in points) / sum((s - ms) ** 2 for s, _ in points)
    return (-slope * w / mv if mv else math.nan), mv


class CollapseDamage(Detector):
    """A ``collapse_damage`` episode per layer: open while the layer's malignant episode lasts and the loss shows
    it (see the module docstring)."""

    def __init__(self, cfg: DamageConfig, states: AttentionStates, exit_dwell: int) -> None:
        self.cfg, self.states = cfg, states
        self.losses: list[tuple[int, float]] = []  # (step, loss) of the loss samples
        self.episodes = Episodes(Dwell(1, 0), Dwell(2, exit_dwell))

    def observe(self, obs: Observation) -> list[Alert]:
        loss = obs.loss_mean if obs.loss_mean is not None else obs.loss
        if loss is None:
            return []
        self.losses.append((obs.step, float(loss)))
        alerts = []
        for label in sorted(set(self.states.machine.n_heads) | set(self.episodes.keys)):
            alerts += self._judge(obs.step, label)
        self._forget()
        return alerts

    def _evidence(self, step: int, label: str) -> tuple[bool, bool, dict[str, float]]:
        """(damaged, clearly not damaged, the evidence) for the layer at ``step``."""
        since = self.states.layer_since("malignant", label)
        if since is None or self.states.baseline(label, since):
            return False, True, {}
        w = min(self.cfg.damage_window, since // 2)
        if w < 1 or step - since < w:
            return False, False, {}
        before, level_before = _fall(self.losses, since - w, since, w)
        after, level_after = _fall(self.losses, step - w + 1, step + 1, w)
        if not all(math.isfinite(x) for x in (before, after)):
            return False, False, {}
        rel = self.cfg.damage_rel
        evidence = {"loss_fall_before": before, "loss_fall_since": after, "loss_before_collapse": level_before,
                    "loss_since_collapse": level_after}
        return before > rel and after < rel, after >= rel, evidence

    def _judge(self, step: int, label: str) -> list[Alert]:
        inside, outside, means = self._evidence(step, label)
        event = self.episodes.update(label, step, inside, outside)
        if event is None:
            return []
        if isinstance(event, Closed):
            return [Alert(step, "collapse_damage", "info", label, f"resolved: the loss falls again, or the layer "
                          f"left its collapse, at step {event.until}", {"duration_steps": float(event.duration)},
                          "resolved", event.since)]
        since = self.states.layer_since("malignant", label)
        w = min(self.cfg.damage_window, since // 2)
        message = (f"the layer's malignant collapse since step {since} is hurting the run: over the {w} steps before "
                   f"it the loss fell {100 * means['loss_fall_before']:.1f}%, over the last {w} it fell "
                   f"{100 * means['loss_fall_since']:.1f}% (a rise when negative; mean "
                   f"{means['loss_since_collapse']:.3f}). What to do: {TODO.format(since=since)}")
        return [Alert(step, "collapse_damage", "critical", label, message, means, "firing", since)]

    def _forget(self) -> None:
        """Keep the losses an open episode, or one that opens soon (its start lies a dwell or more back), can
        still ask for: two windows before the oldest open start, and four windows back from now."""
        now, w = self.losses[-1][0], self.cfg.damage_window
        sinces = [s for label in self.states.machine.n_heads
                  if (s := self.states.layer_since("malignant", label)) is not None]
        keep = min(min(sinces, default=now) - 2 * w, now - 4 * w)
        self.losses = [(s, v) for s, v in self.losses if s >= keep]

    def state_dict(self) -> dict:
        return {"damage": {"losses": [list(p) for p in self.losses], "episodes": self.episodes.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get("damage")
        if isinstance(mine, dict):
            self.losses = [(int(s), float(v)) for s, v in mine.get("losses", [])]
            self.episodes.load_state_dict(mine.get("episodes", {}))
