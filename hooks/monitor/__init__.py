"""Stage 3, the step loop: the Monitor, its cadence and the weight side.

``monitor`` is the :class:`Monitor`; ``cadence`` decides which families a step samples;
``sampling`` measures a sampled step; ``lossmean`` keeps the losses between two loss samples;
``weightside`` reads weights and gradients, computes the spectra and snapshots the update ratios;
``distributed`` gathers sharded (FSDP2) weights and keeps the detectors in step across ranks.
"""

from hooks.monitor.monitor import SIGNALS, Monitor

__all__ = ["Monitor", "SIGNALS"]
