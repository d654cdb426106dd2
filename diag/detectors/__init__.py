"""Judgement: detectors as small state machines over per-layer arrays, no I/O. A new detector goes here.
"""

from diag.detectors.core import Alert, AlertConfig, Detectors, Observation, TrainingHalted, attention_state

__all__ = ["Alert", "AlertConfig", "Detectors", "Observation", "TrainingHalted", "attention_state"]
