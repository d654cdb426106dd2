"""Non-finite loss, weights or gradients: an episode per kind, run-wide."""

from __future__ import annotations

import math

import numpy as np

from diag.detectors.base import Alert, Observation
from diag.detectors.episodes import Closed, Dwell, Episodes

__all__ = ["NonFinite"]

CHECKS = (("weights", ("qk_sigma1",)), ("gradients", ("grad_norm_q", "grad_norm_k", "grad_norm_v")))
TODO = "check the data of that step, lower the learning rate, clip gradients, check mixed-precision loss scaling"


class NonFinite:
    """Opens on the first non-finite sample of a kind, closes at the first finite one; an observation
    that does not show a kind (the update-ratio observation shows none) leaves it alone."""

    def __init__(self) -> None:
        self.episodes = Episodes(Dwell(1, 0), Dwell(1, 0))

    def observe(self, obs: Observation) -> list[Alert]:
        seen: dict[str, bool] = {}
        if obs.loss is not None:
            seen["loss"] = not math.isfinite(obs.loss)
        for metrics in obs.layers.values():
            for kind, keys in CHECKS:
                if all(k in metrics for k in keys):
                    bad = not all(np.isfinite(metrics[k]).all() for k in keys)
                    seen[kind] = seen.get(kind, False) or bad
        alerts = []
        for what in sorted(seen):
            event = self.episodes.update(what, obs.step, seen[what], not seen[what])
            if isinstance(event, Closed):
                alerts.append(Alert(obs.step, f"nonfinite_{what}", "info", "", f"resolved: {what} finite again "
                                    f"after {event.duration} steps", {"duration_steps": float(event.duration)},
                                    "resolved", event.since))
            elif event is not None:
                alerts.append(Alert(obs.step, f"nonfinite_{what}", "critical", "",
                                    f"non-finite {what} at step {obs.step}. What to do: {TODO}", {}, "firing",
                                    obs.step))
        return alerts

    def state_dict(self) -> dict:
        return {"nonfinite_episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state.get("nonfinite"), list):  # format 1: the kinds that were non-finite
            self.episodes.keys = {k: [True, 0, 1, None, 0] for k in state["nonfinite"]}
        self.episodes.load_state_dict(state.get("nonfinite_episodes", self.episodes.state_dict()))
