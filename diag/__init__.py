"""diag: the math, layouts, judgement and outputs of the transformer training monitor.

The live capture lives in the sibling package ``hooks`` (``from hooks import Monitor``).
"""

from diag.detectors.core import Alert, AlertConfig, Detectors, Observation, TrainingHalted, attention_state
from diag.errors import ConfigError, DiagError, SinkError, SpecError
from diag.layouts.adapters import ADAPTERS, ModuleView, find_layout
from diag.layouts.vocab import QKVLayout, split_o, split_projections, split_qkv
from diag.math.attention import AttentionStats, attention_logits, stats_from_logits
from diag.math.metrics import grad_metrics, spectrum_metrics
from diag.math.spectral import (
    effective_rank,
    qk_singular_values,
    qk_singular_values_reference,
    spectral_energy_concentration,
    stable_rank,
)
from diag.offline.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from diag.offline.report import write_report
from diag.offline.series import Analysis, analyze_checkpoints
from diag.outputs.records import build_record
from diag.outputs.sinks import FanOut, JsonlSink, MemorySink, Record, Sink, TensorBoardSink

__version__ = "0.1.0"


def __getattr__(name: str):
    """``diag.SpectralStepLimit`` stays importable where users import it; it lives in ``hooks`` (it wraps a live
    optimizer), so it is loaded only when asked for: importing ``diag`` never imports ``hooks``."""
    if name == "SpectralStepLimit":
        from hooks.steplimit import SpectralStepLimit  # the one sanctioned diag -> hooks import, lazy

        return SpectralStepLimit
    raise AttributeError(f"module 'diag' has no attribute {name!r}")

__all__ = [
    "ADAPTERS",
    "Alert",
    "AlertConfig",
    "Analysis",
    "AttentionStats",
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "Detectors",
    "DiagError",
    "FanOut",
    "JsonlSink",
    "MemorySink",
    "ModuleView",
    "Observation",
    "QKVLayout",
    "Record",
    "Sink",
    "SinkError",
    "SpecError",
    "SpectralStepLimit",
    "TensorBoardSink",
    "TrainingHalted",
    "analyze_checkpoints",
    "attention_logits",
    "attention_state",
    "build_record",
    "effective_rank",
    "find_layout",
    "grad_metrics",
    "open_checkpoint",
    "qk_singular_values",
    "qk_singular_values_reference",
    "spectral_energy_concentration",
    "spectrum_metrics",
    "split_o",
    "split_projections",
    "split_qkv",
    "stable_rank",
    "stats_from_logits",
    "write_report",
]
