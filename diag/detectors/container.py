"""The detectors behind one protocol, fanned out by one container that carries their state.

``Detectors(cfg).observe(obs)`` asks every detector in turn (non-finite values, attention
states, the collapse risk (a logged number), the collapse's damage and stall, the early-update
note, loss spikes, the plateau) and returns their alerts in that order; each detector takes
its own part of ``cfg``.
``state_dict()`` is the union of the detectors' states (their keys are distinct; checked
here) plus ``"version"``. Older states load what carries over: format 2 (before the collapse
risk) the heads' attention episodes (the layers' are derived at the next sample) and every
other detector's state; format 1 (before the detectors were split) the spike EMA and the
non-finite memory. The rest starts afresh, and a warning on the ``diag``
logger says so.
"""

from __future__ import annotations

import json
import logging

from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import AlertConfig
from diag.detectors.damage import CollapseDamage
from diag.detectors.early_updates import EarlyUpdates
from diag.detectors.nonfinite import NonFinite
from diag.detectors.plateau import Plateau
from diag.detectors.risk import CollapseRisk
from diag.detectors.spike import LossSpike
from diag.detectors.states import AttentionStates
from diag.errors import ConfigError

__all__ = ["Detectors", "STATE_VERSION"]

STATE_VERSION = 3
log = logging.getLogger("diag")


class Detectors(Detector):
    """Fans an observation out to every detector; one detector's state keys never collide with another's."""

    def __init__(self, cfg: AlertConfig | None = None, extra: list[Detector] | None = None) -> None:
        self.cfg = cfg or AlertConfig()
        cfg = self.cfg
        states = AttentionStates(cfg.states)
        self.detectors: list[Detector] = [NonFinite(), states, CollapseRisk(cfg.risk, states),
                                          CollapseDamage(cfg.damage, states, cfg.states.exit_dwell),
                                          EarlyUpdates(cfg.early), LossSpike(cfg.spike), Plateau(cfg.plateau)]
        self.detectors += list(extra or [])
        seen: dict[str, str] = {}
        for detector in self.detectors:
            if not isinstance(detector, Detector):
                raise ConfigError(f"Detectors(extra=...): {type(detector).__name__} is not a Detector; subclass "
                                  "diag.detectors.Detector (the protocol: observe, state_dict, load_state_dict)")
            for key in detector.state_dict():
                if key in seen:
                    raise ConfigError(f"Detectors: {type(detector).__name__} and {seen[key]} both keep state "
                                      f"under {key!r}; rename one")
                seen[key] = type(detector).__name__

    def observe(self, obs: Observation) -> list[Alert]:
        return [alert for detector in self.detectors for alert in detector.observe(obs)]

    def observe_updates(self, obs: Observation) -> list[Alert]:
        return [alert for detector in self.detectors for alert in detector.observe_updates(obs)]

    def scalars(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for detector in self.detectors:
            for metric, values in detector.scalars().items():
                if values:
                    out.setdefault(metric, {}).update(values)
        return out

    def near(self) -> str | None:
        """The first detector's reason to sample attention at every step, or None."""
        return next((reason for d in self.detectors if (reason := d.near())), None)

    def at_risk(self) -> str | None:
        """The first detector's reason to sample attention and the spectra at every loss sample, or None."""
        return next((reason for d in self.detectors if (reason := d.at_risk())), None)

    def state_dict(self) -> dict:
        state: dict = {"version": STATE_VERSION}
        for detector in self.detectors:
            state.update(detector.state_dict())
        return json.loads(json.dumps(state))  # plain JSON, and a copy

    def load_state_dict(self, state: dict) -> None:
        version = state.get("version", 1)
        if version > STATE_VERSION:
            raise ConfigError(f"Detectors.load_state_dict: state version {version} is newer than this attnscope "
                              f"reads ({STATE_VERSION}); upgrade attnscope or start the detectors afresh")
        if version == 1:
            log.warning("diag: detector state of format 1 (before episodes): the spike EMA and the non-finite "
                        "memory carry over; attention states, the collapse risk and the "
                        "plateau window start afresh")
            keep = ("ema", "emvar", "n_loss", "nonfinite")
            state = {k: state[k] for k in keep if k in state}
        elif version == 2:
            log.warning("diag: detector state of format 2 (before collapse_risk): the collapse risk starts afresh")
        for detector in self.detectors:
            detector.load_state_dict(state)
