"""hooks: attach the diagnostics to a live PyTorch training loop.

    from hooks import Monitor, QKClip, SpectralStepLimit
    monitor = Monitor(model, logdir="runs/exp1", every=10)
    optimizer = SpectralStepLimit(torch.optim.AdamW(model.parameters()), tau=0.004, model=model, monitor=monitor)
    clip = QKClip(model, tau=100.0, optimizer=optimizer, monitor=monitor)  # bounds each head's largest logit

The alerts, their configuration and the layout vocabulary are pure and live in ``diag``
(``from diag import AlertConfig, QKVLayout, TrainingHalted``); the trainer callbacks in
``hooks.integrations.hf`` and ``hooks.integrations.lightning``.
"""

from hooks.monitor.monitor import Monitor
from hooks.steplimit.limit import SpectralStepLimit
from hooks.steplimit.qkclip import QKClip

__all__ = ["Monitor", "SpectralStepLimit", "QKClip"]
