"""The detectors behind one protocol, fanned out by one container that carries their state.

``Detectors(cfg).observe(obs)`` asks every detector in turn (non-finite values, attention
states, the collapse risk and its warning, the early-update note, loss spikes, the plateau)
and returns their alerts in that order; each detector takes its own part of ``cfg``.
``state_dict()`` is the union of the detectors' states (their keys are distinct; checked
here) plus ``"version"``. Older states load what carries over: format 2 (before the collapse
risk) the heads' attention episodes (the layers' are derived at the next sample) and every
other detector's state; format 1 (before the detectors were split) the spike EMA, the
non-finite memory and the first loss. The rest starts afresh, and a warning on the ``diag``
logger says so.
"""

from __future__ import annotations

import json
import logging

from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import AlertConfig
from diag.detectors.nonfinite import NonFinite
from diag.detectors.plateau import Plateau
from diag.detectors.risk import CollapseRisk
from diag.detectors.spike import LossSpike
from diag.detectors.states import AttentionStates
from diag.detectors.warning import EarlyUpdates
from diag.errors import ConfigError

__all__ = ["Detectors", "STATE_VERSION"]

STATE_VERSION = 3
log = logging.getLogger("diag")


class Detectors:
    """Fans an observation out to every detector; one detector's state keys never collide with another's."""

    def __init__(self, cfg: AlertConfig | None = None, extra: list[Detector] | None = None) -> None:
        self.cfg = cfg or AlertConfig()
        cfg = self.cfg
        states = AttentionStates(cfg.states)
        self.detectors: list[Detector] = [NonFinite(), states, CollapseRisk(cfg.risk, states, cfg.states.exit_dwell),
                                          EarlyUpdates(cfg.early), LossSpike(cfg.spike), Plateau(cfg.plateau)]
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

    def scalars(self) -> dict[str, dict[str, float]]:
        """What the detectors computed at the last observation, to log beside the signals:
        ``{metric: {layer label: value}}`` (``collapse_risk``)."""
        out: dict[str, dict[str, float]] = {}
        for detector in self.detectors:
            get = getattr(detector, "scalars", None)
            for metric, values in (get() if get is not None else {}).items():
                if values:
                    out.setdefault(metric, {}).update(values)
        return out

    def _reason(self, question: str) -> str | None:
        """The first detector's answer to ``question`` (a method returning a reason or None), or None."""
        for detector in self.detectors:
            ask = getattr(detector, question, None)
            reason = ask() if ask is not None else None
            if reason:
                return reason
        return None

    def wants_attention(self) -> str | None:
        """Why the attention should be sampled closely now (a detector's ``wants_attention``), or None."""
        return self._reason("wants_attention")

    def confirming(self) -> int:
        """How many more steps of close attention samples a state being confirmed needs (0: none is); the
        Monitor samples attention every ``CloserLookConfig.confirm_every`` steps meanwhile."""
        return max((getattr(d, "confirming", lambda: 0)() for d in self.detectors), default=0)

    def watching(self) -> str | None:
        """Why a layer's attention should be sampled every ``CloserLookConfig.watch_every`` steps (a
        detector's ``watching``: a layer one head short of a collapse), or None."""
        return self._reason("watching")

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
                        "memory and the first loss carry over; attention states, the collapse risk and the "
                        "plateau window start afresh")
            keep = ("ema", "emvar", "n_loss", "nonfinite", "first_loss")
            state = {k: state[k] for k in keep if k in state}
        elif version == 2:
            log.warning("diag: detector state of format 2 (before collapse_risk): the collapse risk starts afresh")
        for detector in self.detectors:
            detector.load_state_dict(state)
