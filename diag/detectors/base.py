"""What every detector shares: the observation it reads, the alert it returns, the protocol.

A detector is a small state machine with no I/O: ``observe(obs) -> list[Alert]`` plus
``state_dict()``/``load_state_dict()`` holding plain JSON data, so a resumed run continues
exactly where it stopped. The container (:class:`diag.detectors.container.Detectors`) fans
an observation out to every detector. Alerts are sent out by
:class:`diag.outputs.alert_sink.AlertSink`; no detector imports a sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from diag.errors import DiagError

__all__ = ["Alert", "Observation", "Detector", "TrainingHalted", "DOCS", "LEVELS"]

DOCS = "docs/alerts.md"  # every message ends with its section: docs/alerts.md#<kind>
LEVELS = ("info", "warning", "critical")


@dataclass(frozen=True)
class Alert:
    """One record of an episode.

    ``status`` is ``"firing"`` when the episode starts (the alert) and ``"resolved"`` when it
    ends (``values["duration_steps"]``); ``since`` is the first step the condition was seen.
    """

    step: int
    kind: str  # e.g. "malignant_collapse", "collapse_warning", "eureka_plateau"
    level: str  # "info", "warning" or "critical"
    where: str  # "L03/H05", "L03" or "" for the whole model
    message: str  # what happened and what to do; never repeats ``where``
    values: dict[str, float] = field(default_factory=dict)
    status: str = "firing"  # or "resolved"
    since: int | None = None  # the step the episode began
    heads: tuple[str, ...] = ()  # a layer's record that stands for several heads: their "Lxx/Hyy"

    @property
    def anchor(self) -> str:
        return f"{DOCS}#{self.kind}"


class TrainingHalted(DiagError):
    """Raised by ``Monitor.step`` on a critical alert when ``stop_on_critical=True``."""

    def __init__(self, alert: Alert) -> None:
        where = f" at {alert.where}" if alert.where else ""
        super().__init__(f"training stopped by diag at step {alert.step}: {alert.kind}{where}: {alert.message}")
        self.alert = alert


@dataclass
class Observation:
    """One sampled step: ``layers[label][metric]`` is an array over heads (or of size 1). ``loss`` is this step's;
    ``loss_mean`` the mean loss of the steps since the previous loss sample, this one included (the Monitor
    keeps every step's loss and averages them on their device at the sample, hooks/monitor/lossmean.py; None: not
    known, ``loss`` stands for it)."""

    step: int
    loss: float | None
    layers: dict[str, dict[str, np.ndarray]]
    loss_mean: float | None = None


@runtime_checkable
class Detector(Protocol):
    """One phenomenon. ``state_dict`` keys must be unique across the detectors of a container."""

    def observe(self, obs: Observation) -> list[Alert]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
