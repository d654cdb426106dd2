"""The remedies that change training: the spectral step limit (AdamW^2, Qi et al., ICLR 2025), ``SpectralStepLimit``,
which wraps any torch optimizer, and QK-clip (Kimi K2's MuonClip), ``QKClip``, which follows its steps.

``limit.py`` is the optimizer wrapper; ``qkclip.py`` the clip, ``maxlogit.py`` the reader of each head's largest
logit it acts on (through the kernel readers of :mod:`hooks.capture.kernels`). :mod:`hooks.parallel.splits` reads
how a matrix is split across ranks (tensor parallelism, FSDP2) and sums over them, so that each rank bounds its
block as one process bounds the whole.
"""

from hooks.steplimit.limit import STATE_KEY, LimitedMatrix, SpectralStepLimit, StepReporter
from hooks.steplimit.qkclip import Intervention, QKClip

__all__ = ["SpectralStepLimit", "LimitedMatrix", "StepReporter", "STATE_KEY", "QKClip", "Intervention"]
