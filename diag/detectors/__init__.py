"""Judgement: detectors as small state machines over per-layer arrays, no I/O; one module per phenomenon
behind the :class:`~diag.detectors.base.Detector` protocol. A new detector goes here."""

from diag.detectors.base import Alert, Detector, DetectorWrapper, Observation, TrainingHalted
from diag.detectors.config import AlertConfig
from diag.detectors.container import Detectors

__all__ = ["Alert", "AlertConfig", "Detector", "DetectorWrapper", "Detectors", "Observation", "TrainingHalted"]
