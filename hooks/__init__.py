"""hooks: attach the diagnostics to a live PyTorch training loop.

    from hooks import Monitor
    monitor = Monitor(model, logdir="runs/exp1", every=10)
"""

from diag.detectors.core import Alert, AlertConfig, TrainingHalted
from diag.layouts.vocab import QKVLayout
from hooks.layout.discover import AttentionLayer, discover
from hooks.monitor.monitor import SIGNALS, Monitor

__all__ = ["Alert", "AlertConfig", "AttentionLayer", "Monitor", "QKVLayout", "SIGNALS", "TrainingHalted", "discover"]
