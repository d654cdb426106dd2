"""The closer look in a multi-rank job: rank 0's detectors decide, one broadcast gives every rank the decision.

:class:`~hooks.monitor.cadence.CloserLook` samples attention (and the spectra) at more steps while the detectors ask
for it. In a multi-rank job every rank must sample the same steps: under FSDP2 an attention sample ends in an
all-reduce of the owners' statistics and under tensor parallelism every sampled step gathers every rank's heads, so a
rank that sampled a step the others did not would wait for them for ever; and only rank 0 runs the detectors
(:class:`~hooks.parallel.detectors.SharedDetectors`), on its own attention (under tensor parallelism every rank's
heads, gathered; under FSDP2 alone every layer's owner's). So after each step the detectors judged (each sampled step,
and the call that measures a sample's update ratios) every rank takes rank 0's decision: the last step of the look at
every step and the last step of the look with every loss sample, two int64 in one ``broadcast`` from rank 0 (16
bytes). Steps that sample nothing issue none, and neither does a Monitor whose closer look is off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diag.detectors import Detector
from hooks.monitor.cadence import Cadence, CloserLook
from hooks.parallel.ranks import rank

__all__ = ["SharedCloserLook"]


class SharedCloserLook(CloserLook):
    """A :class:`CloserLook` whose extent rank 0 decides (see the module docstring).

    device: where the broadcast's tensor lives, one the process group's backend serves (the watched parameters'
    device: CUDA under NCCL, the CPU under gloo)."""

    def __init__(self, cadence: Cadence, enabled: bool, device: torch.device) -> None:
        super().__init__(cadence, enabled)
        self.device = device

    def heed(self, step: int, detectors: Detector) -> list[str]:
        """Rank 0: extend the look its detectors ask for (what started, in words); the other ranks wait for
        :meth:`agree`."""
        return super().heed(step, detectors) if rank() == 0 else []

    def agree(self) -> None:
        """Every rank, after every step the detectors judged, whether or not this rank's :meth:`heed` ran (a fault
        in the sample on one rank must not leave the others waiting): the look's ends become rank 0's. Where the
        broadcast fails (raised to the Monitor, which reports it) this rank has no look until the next agreement:
        with a fault every rank shares (a device the backend does not serve), no rank has one."""
        if self.period is None:
            return
        near = risk = -1
        try:
            ends = torch.tensor([self.near_until, self.risk_until], dtype=torch.int64, device=self.device)  # (2,)
            dist.broadcast(ends, src=0)
            near, risk = ends.tolist()
        finally:
            self.near_until, self.risk_until, self.until = near, risk, max(near, risk)
