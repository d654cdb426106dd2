"""hooks: attach the diagnostics to a live PyTorch training loop.

    from hooks import Monitor, SpectralStepLimit
    monitor = Monitor(model, logdir="runs/exp1", every=10)
    optimizer = SpectralStepLimit(torch.optim.AdamW(model.parameters()), tau=0.004, model=model, monitor=monitor)
"""

from diag.detectors import Alert, AlertConfig, TrainingHalted
from diag.layouts.vocab import QKVLayout
from hooks.layout.discover import AttentionLayer, discover
from hooks.monitor.monitor import SIGNALS, Monitor
from hooks.steplimit import SpectralStepLimit

__all__ = ["Alert", "AlertConfig", "AttentionLayer", "Monitor", "QKVLayout", "SIGNALS", "SpectralStepLimit",
           "TrainingHalted", "discover"]
