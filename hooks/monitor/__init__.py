"""Stage 3, the step loop: the Monitor, its cadence and the weight side.

``monitor`` is the :class:`Monitor`; ``cadence`` decides which families a step samples;
``weightside`` computes the spectra and gradient norms and snapshots the update ratios; ``reader`` reads the
weights and gradients (in place, or gathered by :mod:`hooks.parallel` where they are sharded).
"""

from hooks.monitor.monitor import SIGNALS, Monitor

__all__ = ["Monitor", "SIGNALS"]
