"""The step loop: the Monitor, its cadence, its sampling and the weight side (above parallel, layout, capture).

``monitor`` is the :class:`Monitor`; ``cadence`` decides which families a step samples (``sharedlook``: the
closer look's decision shared by every rank of a multi-rank job);
``sampling`` measures a sampled step; ``lossmean`` keeps the losses between two loss samples;
``weightside`` computes the spectra and gradient norms and snapshots the update ratios; ``reader`` reads the
weights and gradients (in place, or gathered by :mod:`hooks.parallel` where they are sharded).
"""

from hooks.monitor.monitor import SIGNALS, Monitor

__all__ = ["Monitor", "SIGNALS"]
