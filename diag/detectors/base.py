"""What every detector shares: the observation it reads, the alert it returns, the protocol.

A detector is a small state machine with no I/O: ``observe(obs) -> list[Alert]`` plus
``state_dict()``/``load_state_dict()`` holding plain JSON data, so a resumed run continues
exactly where it stopped. The :class:`Detector` base class declares these and the optional
hooks, with defaults (the closer look's questions, the scalars it computed, the update-ratio
observation). The container (:class:`diag.detectors.container.Detectors`) fans an observation
out to every detector; :class:`DetectorWrapper` passes every call on to the detector it wraps,
for a wrapper that changes one of them. Alerts are sent out by
:class:`diag.outputs.alert_sink.AlertSink`; no detector imports a sink.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from diag.catalog.alerts import ALERTS, DOCS, LEVELS  # each kind's docs section; the levels, lowest first
from diag.errors import DiagError

__all__ = ["Alert", "Observation", "Detector", "DetectorWrapper", "TrainingHalted", "DOCS", "LEVELS"]


@dataclass(frozen=True)
class Alert:
    """One record of an episode.

    ``status`` is ``"firing"`` when the episode starts (the alert) and ``"resolved"`` when it
    ends (``values["duration_steps"]``); ``since`` is the first step the condition was seen.
    """

    step: int
    kind: str  # e.g. "malignant_collapse", "collapse_damage", "eureka_plateau"
    level: str  # "info", "warning" or "critical"
    where: str  # "L03/H05", "L03" or "" for the whole model
    message: str  # what happened and what to do; never repeats ``where``
    values: dict[str, float] = field(default_factory=dict)
    status: str = "firing"  # or "resolved"
    since: int | None = None  # the step the episode began
    heads: tuple[str, ...] = ()  # a layer's record that stands for several heads: their "Lxx/Hyy"

    @property
    def anchor(self) -> str:
        """Its section of docs/alerts.md (the catalog's, :mod:`diag.catalog.alerts`)."""
        entry = ALERTS.get(self.kind)
        return entry.docs if entry is not None else f"{DOCS}#{self.kind}"


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
    known, ``loss`` stands for it). ``update_steps``: the optimizer steps the ``update_*`` metrics span, from
    ``step`` on (the Monitor's: 1; a checkpoint series: the gap to the next checkpoint; None: not known)."""

    step: int
    loss: float | None
    layers: dict[str, dict[str, np.ndarray]]
    loss_mean: float | None = None
    update_steps: int | None = 1


class Detector(ABC):
    """One phenomenon. ``observe``, ``state_dict`` and ``load_state_dict`` are every detector's own (``state_dict``
    keys must be unique across the detectors of a container); the other hooks answer "nothing" unless a detector
    has something to say."""

    @abstractmethod
    def observe(self, obs: Observation) -> list[Alert]: ...

    def observe_updates(self, obs: Observation) -> list[Alert]:
        """The update ratios of a sampled step, measured at the step after it (no loss, only ``update_*``
        metrics). The same judgement as :meth:`observe`; a wrapper that makes the ranks agree on every
        observation has nothing to agree on here (the ratios are the same on every rank)."""
        return self.observe(obs)

    def scalars(self) -> dict[str, dict[str, float]]:
        """What the detector computed at the last observation, to log beside the signals:
        ``{metric: {layer label: value}}`` (``collapse_risk``)."""
        return {}

    def near(self) -> str | None:
        """Why attention should be sampled at every step now (a head inside or near a state's lines, being
        settled: the Monitor's closer look), or None."""
        return None

    def at_risk(self) -> str | None:
        """Why attention and the spectra should be sampled at every loss sample now (a layer at risk, a head's
        sigma_1 growing fast), or None."""
        return None

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


class DetectorWrapper(Detector):
    """Passes every call on to ``inner``: the base of a wrapper that changes one of them (records the
    observations, makes the ranks agree)."""

    def __init__(self, inner: Detector) -> None:
        self.inner = inner

    def observe(self, obs: Observation) -> list[Alert]:
        return self.inner.observe(obs)

    def observe_updates(self, obs: Observation) -> list[Alert]:
        return self.inner.observe_updates(obs)

    def scalars(self) -> dict[str, dict[str, float]]:
        return self.inner.scalars()

    def near(self) -> str | None:
        return self.inner.near()

    def at_risk(self) -> str | None:
        return self.inner.at_risk()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
