"""``collapse_risk``'s forecasts on a recorded run, each with its outcome, and their Brier score.

A forecast is a layer's risk as the Monitor at its default cadence would have logged it (the detectors replayed
by :func:`evaluation.detectors.at_default_cadence`); its outcome is whether that layer's malignant collapse, by
the ground truth's states (:func:`evaluation.truth.states`), was established within the risk's horizon.
The fit (:mod:`evaluation.risk`) and the report (:mod:`evaluation.report`) read both from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diag.detectors import AlertConfig, Detectors
from evaluation import detectors as judge
from evaluation.truth import Run, malignant_episodes

__all__ = ["Forecast", "brier", "forecasts", "outcome_at"]


@dataclass
class Forecast:
    run: str
    lr: float
    warmup: int
    twin: str
    task: str
    step: int
    label: str
    p: float
    y: int


def outcome_at(episodes: list[tuple[int, int | None]], t: int, horizon: int) -> int:
    """-1: in an established episode at step ``t`` (not a forecast); 1: one opens within ``horizon`` steps; 0."""
    for opened, until in episodes:
        if opened <= t and (until is None or until > t):
            return -1
        if t < opened <= t + horizon:
            return 1
    return 0


def forecasts(run: Run, cfg: AlertConfig | None = None) -> list[Forecast]:
    """Every ``collapse_risk`` the Monitor at its default cadence would have logged on this run, with its outcome:
    the layer's malignant collapse established within the horizon (samples of a layer already collapsed are left
    out)."""
    cfg = cfg or AlertConfig()
    det = Detectors(cfg)
    _, onsets = malignant_episodes(run)
    out = []
    for o, _ in judge.at_default_cadence(run.obs, det, run.losses):
        if o.loss is None and all(judge.family(k) == "updates" for m in o.layers.values() for k in m):
            continue  # the update ratios of the step after a sample: no risk is judged on them
        for label, p in det.scalars().get("collapse_risk", {}).items():
            y = outcome_at(onsets.get(label, []), o.step, cfg.risk.risk_horizon)
            if y >= 0:
                out.append(Forecast(run.name, run.spec.lr, run.spec.warmup, run.spec.twin, run.spec.task, o.step,
                                    label, p, y))
    return out


def brier(p: np.ndarray, y: np.ndarray) -> float:
    """The mean squared difference between the forecasts ``p`` and the outcomes ``y``."""
    return float(np.mean((p - y) ** 2))
