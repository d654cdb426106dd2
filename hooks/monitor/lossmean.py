"""The mean loss of the steps between two loss samples, kept where the loss lives.

At the default cadence the loss is sampled every 10 steps; one batch's loss scatters about sqrt(10) times as much
as the mean of the ten, and the plateau detector's lines (``eureka_plateau``, ``eureka_moment``) are crossed by that
scatter (issue #31's thirteenth session, docs/alerts.md#eureka_moment). Every step's loss is added here: a tensor's
on its own device (``detach``: no graph kept, no host read, nothing of the training touched), a number's on the
host. A sampled step takes the mean, which reaches the host in the same transfer as the step's metrics.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["LossMean"]


class LossMean:
    """A running sum and count of the losses given since the last :meth:`take`."""

    def __init__(self) -> None:
        self.total: Tensor | float | None = None
        self.count = 0

    def add(self, loss: Tensor | float) -> None:
        value = loss.detach().reshape(()).float() if isinstance(loss, Tensor) else float(loss)
        self.total = value if self.total is None else self.total + value
        self.count += 1

    def take(self) -> Tensor | float | None:
        """The mean of the losses given since the last call (None if none was), and a fresh start."""
        mean = None if self.total is None else self.total / self.count
        self.total, self.count = None, 0
        return mean
