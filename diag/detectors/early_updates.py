"""An honest note about large first updates: ``large_early_updates`` (info, once per run).

In the first ``note_horizon`` steps an update ratio ``sigma_1(dW)/sigma_1(W) >= note_ratio`` (about 60x the
paper's tau of 0.004): the run has no, or a short, warmup at this learning rate. A fact about the schedule, not
a prediction (the prediction is ``collapse_risk``, :mod:`diag.detectors.risk`).
"""

from __future__ import annotations

import math

from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import EarlyUpdatesConfig

__all__ = ["EarlyUpdates"]


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
        if not ratios or max(ratios)[0] < self.cfg.note_ratio:
            return []
        self.noted = True
        ratio, label = max(ratios)
        return [Alert(obs.step, "large_early_updates", "info", "", (
            f"the update of step {obs.step} is large next to the weights: sigma_1(dW)/sigma_1(W) = {ratio:.3g} in "
            f"{label} (Qi et al. bound it at tau = 0.004). This is what a run without (or with a short) warmup "
            "looks like at this learning rate; it does not predict a collapse by itself. What to do: nothing "
            "if the run is meant to have no warmup; collapse_risk shows which layers are heading for collapse"),
            {"update_ratio": ratio}, "firing", obs.step)]

    def state_dict(self) -> dict:
        return {"noted_early_updates": self.noted, "early_updates_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.noted = bool(state.get("noted_early_updates", False))
        self.step = int(state.get("early_updates_step", -1))
