"""The spectral step limit (AdamW^2, Qi et al., ICLR 2025): ``SpectralStepLimit`` wraps any torch optimizer.

``limit.py`` is the optimizer wrapper; :mod:`hooks.parallel.splits` reads how a matrix is split across ranks
(tensor parallelism, FSDP2) and sums over them, so that each rank bounds its block as one process bounds the
whole.
"""

from hooks.steplimit.limit import STATE_KEY, LimitedMatrix, SpectralStepLimit, StepReporter

__all__ = ["SpectralStepLimit", "LimitedMatrix", "StepReporter", "STATE_KEY"]
