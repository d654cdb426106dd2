"""diag: the math, layouts, judgement and outputs of the transformer training monitor.

What a user imports from here: the alerts and their configuration, the layout vocabulary for a spec, the
sinks, the checkpoint analysis and its report, and the errors. The live side lives in the sibling package
``hooks`` (``from hooks import Monitor, SpectralStepLimit``); importing ``diag`` never imports it.
"""

from diag.detectors.base import Alert, TrainingHalted
from diag.detectors.config import AlertConfig
from diag.errors import ConfigError, DiagError, SinkError, SpecError
from diag.layouts.vocab import QKVLayout
from diag.offline.series import Analysis, analyze_checkpoints
from diag.outputs.sinks import JsonlSink, MemorySink, Record, Sink, TensorBoardSink
from diag.reports.checkpoints import write_report

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "AlertConfig",
    "Analysis",
    "ConfigError",
    "DiagError",
    "JsonlSink",
    "MemorySink",
    "QKVLayout",
    "Record",
    "Sink",
    "SinkError",
    "SpecError",
    "TensorBoardSink",
    "TrainingHalted",
    "analyze_checkpoints",
    "write_report",
]
