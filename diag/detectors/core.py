"""The detectors' public names in one place (kept for imports written before the split).

Each phenomenon has its own module: :mod:`~diag.detectors.collapse` (attention states),
:mod:`~diag.detectors.warning` (collapse warning, early-update note),
:mod:`~diag.detectors.plateau` (plateau and Eureka-moment), :mod:`~diag.detectors.spike`,
:mod:`~diag.detectors.nonfinite`; :mod:`~diag.detectors.container` fans out to them. The
alert channels are :class:`diag.outputs.alert_sink.AlertSink`.
"""

from diag.detectors.base import Alert, Detector, Observation, TrainingHalted
from diag.detectors.collapse import attention_state
from diag.detectors.config import AlertConfig
from diag.detectors.container import Detectors

__all__ = ["Alert", "AlertConfig", "Detector", "Detectors", "Observation", "TrainingHalted", "attention_state"]
