"""The mean loss of the steps between two loss samples, kept where the loss lives.

At the default cadence the loss is sampled every 10 steps; one batch's loss scatters about sqrt(10) times as much
as the mean of the ten, and the plateau detector's lines (``eureka_plateau``, ``eureka_moment``) are crossed by that
scatter (docs/alerts.md#eureka_moment). Every step's loss is kept here until the
next loss sample: a tensor as ``detach()`` (a view: no kernel, no host read, no graph kept, nothing of the training
touched), a number as a number. A non-sampled step issues no other tensor operation. The sampled step sums them
on their device (one small kernel), and the mean reaches the host in the same transfer as the step's metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LossMean"]

FOLD = 64  # kept losses summed into one on their device when this many wait (a loss sampled rarely)


class LossMean:
    """The losses given since the last :meth:`take`: their mean."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.numbers = 0.0
        self.count = 0

    def add(self, loss: Tensor | float) -> None:
        if isinstance(loss, Tensor):
            self.tensors.append(loss.detach())
            if len(self.tensors) >= FOLD:
                self.tensors = [self._sum()]
        else:
            self.numbers += float(loss)
        self.count += 1

    def _sum(self) -> Tensor:
        return torch.stack([t.reshape(()).float() for t in self.tensors]).sum()

    def clear(self) -> None:
        self.tensors, self.numbers, self.count = [], 0.0, 0

    def take(self) -> Tensor | float | None:
        """The mean of the losses given since the last call (None if none was); then a fresh start."""
        try:
            if not self.count:
                return None
            total = self._sum() + self.numbers if self.tensors else self.numbers
            return total / self.count
        finally:
            self.clear()
