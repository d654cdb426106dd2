"""Non-finite values: what the ``nonfinite_*`` alerts report, what the Monitor says of the rest, and the gradient
overflow of fp16 loss scaling.

:class:`NonFinite` opens an episode per kind (the loss, the weights, the gradients), run-wide. The other non-finite
values of a sample (attention statistics) follow from those or from the inputs: :func:`unreported` words the one
console line about them. Under fp16 loss scaling non-finite gradients are a routine event the ``GradScaler``
handles (it skips the update and lowers its scale): :func:`overflowed` tells it, :func:`overflow_alert` reports it
as an info ``gradient_overflow`` instead of a critical ``nonfinite_gradients``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.episodes import Closed, Dwell, Episodes

__all__ = ["NonFinite", "REPORTED", "unreported", "overflowed", "overflow_alert"]

CHECKS = (("weights", ("qk_sigma1",)), ("gradients", ("grad_norm_q", "grad_norm_k", "grad_norm_v")))
REPORTED = ("loss", "qk_", "grad_")  # tags whose non-finite values the nonfinite_* alerts report
KINDS = {"loss": "nonfinite_loss", "weights": "nonfinite_weights", "gradients": "nonfinite_gradients"}


class NonFinite(Detector):
    """Opens on the first non-finite sample of a kind, closes at the first finite one; an observation
    that does not show a kind (the update-ratio observation shows none) leaves it alone."""

    def __init__(self) -> None:
        self.episodes = Episodes(Dwell(1, 0), Dwell(1, 0))

    def observe(self, obs: Observation) -> list[Alert]:
        seen: dict[str, bool] = {}
        losses = [x for x in (obs.loss, obs.loss_mean) if x is not None]  # the mean covers the unsampled steps
        if losses:
            seen["loss"] = not all(math.isfinite(x) for x in losses)
        for metrics in obs.layers.values():
            for kind, keys in CHECKS:
                if all(k in metrics for k in keys):
                    bad = not all(np.isfinite(metrics[k]).all() for k in keys)
                    seen[kind] = seen.get(kind, False) or bad
        alerts = []
        for what in sorted(seen):
            event = self.episodes.update(what, obs.step, seen[what], not seen[what])
            if isinstance(event, Closed):
                alerts.append(Alert(obs.step, KINDS[what], "info", "", f"resolved: {what} finite again "
                                    f"after {event.duration} steps", {"duration_steps": float(event.duration)},
                                    "resolved", event.since))
            elif event is not None:
                alerts.append(Alert(obs.step, KINDS[what], "critical", "", f"non-finite {what} {_when(what, obs)}. "
                                    f"What to do: {ALERTS[KINDS[what]].todo}", {}, "firing", obs.step))
        return alerts

    def state_dict(self) -> dict:
        return {"nonfinite_episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state.get("nonfinite"), list):  # format 1: the kinds that were non-finite
            self.episodes.keys = {k: [True, 0, 1, None, 0] for k in state["nonfinite"]}
        self.episodes.load_state_dict(state.get("nonfinite_episodes", self.episodes.state_dict()))


def _when(what: str, obs: Observation) -> str:
    """At the sampled step, or (a loss finite there whose mean since the last loss sample is not) before it."""
    if what == "loss" and obs.loss is not None and math.isfinite(obs.loss):
        return f"at a step before step {obs.step}, since the previous loss sample (their mean is {obs.loss_mean})"
    return f"at step {obs.step}"


def unreported(step: int, scalars: Mapping[str, float], skip: Iterable[str] = ()) -> str | None:
    """The warning about the non-finite values of a sample's ``scalars`` (tag -> value) that no ``nonfinite_*`` alert
    reports, or None. A sample where the loss, the weights (every ``qk_`` metric follows them) or the gradients are
    non-finite has its alert (one console line, not two), and what follows from them (the attention statistics) is
    not said again. ``skip``: metrics whose non-finite values are already accounted for (NaN spectra of a failed
    solver, the gradients of an fp16 overflow)."""
    skipped = tuple(f"{metric}/" for metric in skip)
    nonfinite = [tag for tag, v in scalars.items() if not math.isfinite(v) and not tag.startswith(skipped)]
    if any(tag.startswith(REPORTED) for tag in nonfinite) or not nonfinite:
        return None
    return f"diag: non-finite values at step {step} (e.g. {nonfinite[:3]}); logged as NaN, training continues"


def overflowed(layers: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
    """Whether any gradient metric of a sample (``layers[label][metric]``, arrays over heads) is non-finite: under
    fp16 loss scaling, the gradients overflowed."""
    return any(not np.isfinite(values).all() for metrics in layers.values()
               for metric, values in metrics.items() if metric.startswith("grad_"))


def overflow_alert(step: int) -> Alert:
    """``gradient_overflow`` (info): a routine fp16 event, not a sign of a broken run."""
    return Alert(step, "gradient_overflow", "info", "", f"gradients overflowed at step {step} under fp16 loss "
                 "scaling; the GradScaler skips this update and lowers its scale. What to do: "
                 f"{ALERTS['gradient_overflow'].todo}")
