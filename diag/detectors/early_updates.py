"""An honest note about large first updates: ``large_early_updates`` (info, once per run).

In the first ``note_horizon`` steps an update ratio ``r = sigma_1(dW)/sigma_1(W)`` of W_Q or W_K says that some
step's ratio was at least ``note_ratio`` (about 60x the paper's tau of 0.004): the run has no, or a short,
warmup at this learning rate. A fact about the schedule, not a prediction (the prediction is
``collapse_risk``, :mod:`diag.detectors.risk`).

An update may span ``k`` optimizer steps (``Observation.update_steps``: 1 live, the gap between two
checkpoints after the fact). Steps whose ratios are each at most ``x`` move the weights by at most
``(1 + x)^k - 1`` of sigma_1(W) (the triangle inequality over the ``k`` updates, each at most ``x`` times the
weights before it, which grow at most ``(1 + x)``-fold a step; updates along W itself reach it). So the
bound of ``k`` steps of Qi et al.'s tau is ``(1 + tau)^k - 1`` (about ``k tau`` while ``k tau`` is small),
and a ratio ``r`` over ``k`` steps means that at least one of them had a ratio of ``(1 + r)^(1/k) - 1`` or
more: the note fires when that reaches ``note_ratio``. With ``k`` not known, ``r`` is compared with no bound
and the note says so.
"""

from __future__ import annotations

import math

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import EarlyUpdatesConfig
from diag.detectors.risk import TAU

__all__ = ["EarlyUpdates", "least_step_ratio", "steps_bound"]

TODO = f"What to do: {ALERTS['large_early_updates'].todo}"


def steps_bound(tau: float, steps: int) -> float:
    """``(1 + tau)^steps - 1``: the most ``steps`` updates of ratio at most ``tau`` each move the weights."""
    return math.expm1(steps * math.log1p(tau))


def least_step_ratio(ratio: float, steps: int) -> float:
    """``(1 + ratio)^(1/steps) - 1``: the ratio at least one of ``steps`` steps had, whose update spans ``ratio``."""
    return math.expm1(math.log1p(ratio) / steps)


def _message(step: int, ratio: float, label: str, steps: int | None) -> tuple[str, dict[str, float]]:
    """What the note says of ``ratio`` over ``steps`` optimizer steps from ``step``, and its values."""
    fact = f"sigma_1(dW)/sigma_1(W) = {ratio:.3g}"
    values = {"update_ratio": ratio}
    if steps is None:
        return (f"the update from step {step} to the next checkpoint is large next to the weights: {fact} in {label}, "
                "over a number of optimizer steps the checkpoints do not tell (their steps are positions in the "
                f"series), so it cannot be compared with a bound (Qi et al.: tau = {TAU:g} per step). Were they one "
                f"step apart, it would be {ratio / TAU:.0f}x tau, which is what a run without (or with a short) "
                "warmup looks like at this learning rate"), values
    bound = steps_bound(TAU, steps)
    values.update(update_steps=float(steps), bound=bound)
    if steps == 1:
        head = (f"the update of step {step} is large next to the weights: {fact} over one optimizer step in {label}, "
                f"{ratio / TAU:.0f}x Qi et al.'s bound of one step (tau = {TAU:g})")
    else:
        least = least_step_ratio(ratio, steps)
        head = (f"the update from step {step} to step {step + steps} is large next to the weights: {fact} over "
                f"these {steps} optimizer steps in {label}, {ratio / bound:.0f}x the bound of {steps} steps "
                f"((1 + tau)^{steps} - 1 = {bound:.3g} for Qi et al.'s tau = {TAU:g} a step), so at least one of "
                f"them had a ratio of {least:.3g} or more ({least / TAU:.0f}x tau)")
    return f"{head}. This is what a run without (or with a short) warmup looks like at this learning rate", values


class EarlyUpdates(Detector):
    """The info note: large update ratios in the first steps (needs the ``updates`` signal)."""

    def __init__(self, cfg: EarlyUpdatesConfig) -> None:
        self.cfg = cfg
        self.noted = False
        self.step = -1  # the last step observed

    def at_risk(self) -> str | None:
        """Within the first ``note_horizon`` steps of a run noted for large first updates: such runs are the
        ones whose heads collapse in tens of steps, so the Monitor samples their attention with every loss."""
        if self.noted and self.step <= self.cfg.note_horizon:
            return "the first updates are large (no or a short warmup)"
        return None

    def observe(self, obs: Observation) -> list[Alert]:
        self.step = max(self.step, obs.step)
        if self.noted or obs.step > self.cfg.note_horizon:
            return []
        ratios = [(float(m[k][0]), label) for label, m in obs.layers.items()
                  for k in ("update_ratio_q", "update_ratio_k") if k in m and math.isfinite(float(m[k][0]))]
        if not ratios:
            return []
        ratio, label = max(ratios)
        steps = obs.update_steps
        if (ratio if steps is None else least_step_ratio(ratio, steps)) < self.cfg.note_ratio:
            return []
        self.noted = True
        said, values = _message(obs.step, ratio, label, steps)
        return [Alert(obs.step, "large_early_updates", "info", "", f"{said}; it does not predict a collapse by "
                      f"itself. {TODO}", values, "firing", obs.step)]

    def state_dict(self) -> dict:
        return {"noted_early_updates": self.noted, "early_updates_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.noted = bool(state.get("noted_early_updates", False))
        self.step = int(state.get("early_updates_step", -1))
