"""The detectors across ranks, the one way a multi-rank job stops on a critical alert.

With ``stop_on_critical`` in a multi-rank job, every rank judges rank 0's observation (one broadcast per sampled
step), so every rank raises :class:`~diag.detectors.base.TrainingHalted` at the same step and none is left waiting
in a collective. The Monitor wraps its detectors in :class:`SharedDetectors` whenever the job has more than one
rank; the trainer callbacks (:mod:`hooks.integrations`) pass ``stop_on_critical`` on to it.
"""

from __future__ import annotations

import torch.distributed as dist

from diag.detectors import Alert, Detectors, DetectorWrapper, Observation
from hooks.parallel.ranks import rank

__all__ = ["SharedDetectors"]


class SharedDetectors(DetectorWrapper):
    """Detectors that judge rank 0's observation on every rank (see the module docstring).

    Weight, gradient and update metrics are the same on every rank; the loss and the
    attention statistics are each rank's own (under FSDP2 alone the attention is every
    layer's owner's, the same on every rank). Without ``stop_on_critical`` only rank
    0 judges (it alone writes alerts) and no collective is issued; with it, an
    observation that holds a loss or any metric other than an update ratio is
    broadcast from rank 0 first, so all ranks raise together.
    """

    def __init__(self, detectors: Detectors, stop_on_critical: bool) -> None:
        super().__init__(detectors)
        self.stop = stop_on_critical

    def observe(self, observation: Observation) -> list[Alert]:
        """A sampled step's observation: rank 0's, broadcast (with ``stop_on_critical``). Every rank
        calls this at every sampled step, whatever the observation holds, so the broadcast always pairs."""
        if not self.stop:
            return self.inner.observe(observation) if rank() == 0 else []
        box = [observation]
        dist.broadcast_object_list(box, src=0)
        return self.inner.observe(box[0])

    def observe_updates(self, observation: Observation) -> list[Alert]:
        """The update ratios of the step before: computed from the (gathered) weights, the same on
        every rank, so no collective."""
        if not self.stop:
            return self.inner.observe_updates(observation) if rank() == 0 else []
        return self.inner.observe_updates(observation)
