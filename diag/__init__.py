"""diag: the math, layouts, judgement and outputs of the transformer training monitor.

The live side lives in the sibling package ``hooks`` (``from hooks import Monitor, SpectralStepLimit``);
importing ``diag`` never imports it.
"""

from diag.detectors import Alert, AlertConfig, Detectors, Observation, TrainingHalted, attention_state
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
from diag.offline.series import Analysis, analyze_checkpoints
from diag.outputs.records import build_record
from diag.outputs.sinks import FanOut, JsonlSink, MemorySink, Record, Sink, TensorBoardSink
from diag.reports.checkpoints import write_report

__version__ = "0.1.0"

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
