"""The spectral step limit (AdamW^2, Qi et al., ICLR 2025): ``SpectralStepLimit`` wraps any torch optimizer.

``limit.py`` is the optimizer wrapper; ``splits.py`` how a matrix split across ranks (tensor parallelism,
FSDP2) is read and summed over, so that each rank bounds its block as one process bounds the whole.
"""

from hooks.steplimit.limit import STATE_KEY, LimitedMatrix, SpectralStepLimit, StepReporter

__all__ = ["SpectralStepLimit", "LimitedMatrix", "StepReporter", "STATE_KEY"]
