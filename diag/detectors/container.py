"""The detectors behind one protocol, fanned out by one container that carries their state.

``Detectors(cfg).observe(obs)`` asks every detector in turn (non-finite values, attention
states, the collapse warning, the early-update note, loss spikes, the plateau) and returns
their alerts in that order. ``state_dict()`` is the union of the detectors' states (their
keys are distinct; checked here) plus ``"version"``; a format-1 state (no version, from
before the detectors were split) loads what carries over: the spike EMA, the non-finite
memory, the first loss, the last sigma_1 and update ratio per layer. The rest starts
afresh, and a warning on the ``diag`` logger says so.
"""

from __future__ import annotations

import json
import logging

from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.collapse import AttentionStates
from diag.detectors.config import AlertConfig
from diag.detectors.nonfinite import NonFinite
from diag.detectors.plateau import Plateau
from diag.detectors.spike import LossSpike
from diag.detectors.warning import CollapseWarning, EarlyUpdates
from diag.errors import ConfigError

__all__ = ["Detectors", "STATE_VERSION"]

STATE_VERSION = 2
log = logging.getLogger("diag")


class Detectors:
    """Fans an observation out to every detector; one detector's state keys never collide with another's."""

    def __init__(self, cfg: AlertConfig | None = None, extra: list[Detector] | None = None) -> None:
        self.cfg = cfg or AlertConfig()
        states = AttentionStates(self.cfg)
        self.detectors: list[Detector] = [NonFinite(), states, CollapseWarning(self.cfg, states.episodes["malignant"]),
                                          EarlyUpdates(self.cfg), LossSpike(self.cfg), Plateau(self.cfg)]
        self.detectors += list(extra or [])
        seen: dict[str, str] = {}
        for detector in self.detectors:
            if not isinstance(detector, Detector):
                raise ConfigError(f"Detectors(extra=...): {type(detector).__name__} lacks observe/state_dict/"
                                  "load_state_dict (the Detector protocol in diag.detectors.base)")
            for key in detector.state_dict():
                if key in seen:
                    raise ConfigError(f"Detectors: {type(detector).__name__} and {seen[key]} both keep state "
                                      f"under {key!r}; rename one")
                seen[key] = type(detector).__name__

    def observe(self, obs: Observation) -> list[Alert]:
        alerts: list[Alert] = []
        for detector in self.detectors:
            alerts += detector.observe(obs)
        return alerts

    def wants_attention(self) -> str | None:
        """Why the attention should be sampled closely now (a detector's ``wants_attention``), or None."""
        for detector in self.detectors:
            ask = getattr(detector, "wants_attention", None)
            reason = ask() if ask is not None else None
            if reason:
                return reason
        return None

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
            log.warning("diag: detector state of format 1 (before episodes): the spike EMA, the non-finite "
                        "memory, the first loss, the last sigma_1 and update ratios carry over; collapse and "
                        "plateau windows start afresh")
            keep = ("ema", "emvar", "n_loss", "nonfinite", "first_loss", "sigma_prev", "update_ratio")
            state = {k: state[k] for k in keep if k in state}
        for detector in self.detectors:
            detector.load_state_dict(state)
