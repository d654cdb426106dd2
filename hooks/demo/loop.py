"""One training loop: the demo's, and every training run of the evaluation.

:func:`train_steps` takes a model, a source of batches and the loss of a batch, an optimizer whose learning rate
a :class:`Schedule` drives (a linear warmup, then constant or a cosine decay), optional gradient clipping and
autocast, the Monitor and callbacks after every step (progress lines, held-out evaluations). It steps the
Monitor where any loop steps it: after ``backward`` and clipping, before ``optimizer.step()``. The caller
attaches the Monitor before and closes it after: the loop trains, the caller owns what it watched with.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from diag.errors import ConfigError
from hooks.monitor.monitor import Monitor

__all__ = ["Schedule", "StepCallback", "adamw", "train_steps"]

StepCallback = Callable[[int, list[float]], None]  # (the step just taken, every step's loss up to it)


@dataclass(frozen=True)
class Schedule:
    """The learning rate of a step as a fraction of the optimizer's: a linear warmup over ``warmup`` steps, then
    constant, or (``decay="cosine"``) a cosine decay that reaches 0 at step ``steps``."""

    warmup: int = 0
    decay: str = "constant"
    steps: int = 0  # where the cosine decay ends: the run's length

    def __post_init__(self) -> None:
        if self.decay not in ("constant", "cosine"):
            raise ConfigError(f"Schedule(decay={self.decay!r}): expected 'constant' or 'cosine'")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"Schedule(warmup={self.warmup!r}): expected an integer >= 0 (0: no warmup)")

    def __call__(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.decay == "constant" or step < self.warmup:
            return warm
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW as nanoGPT trains: betas 0.9/0.95, weight decay 0.1 on every parameter."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def train_steps(model: nn.Module, batches: Callable[[], Any], loss_of: Callable[[Any], Tensor],
                optimizer: torch.optim.Optimizer, steps: int, *, schedule: Schedule = Schedule(),
                clip: float | None = None, autocast: torch.dtype | None = None, monitor: Monitor | None = None,
                callbacks: Sequence[StepCallback] = ()) -> list[float]:
    """Train ``model`` for ``steps`` steps; returns every step's loss.

    Each step: ``model.train()`` (a callback may have evaluated in eval mode), ``loss_of(batches())`` (under
    ``torch.autocast`` with ``autocast``, e.g. ``torch.bfloat16``), backward, the gradients clipped to a total
    norm of ``clip``, ``monitor.step``, the optimizer's step, the schedule's; then every callback with the step
    and the losses so far."""
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    device = next(model.parameters()).device.type
    losses: list[float] = []
    for step in range(steps):
        model.train()
        batch = batches()
        with torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss = loss_of(batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if monitor is not None:
            monitor.step(step, loss=loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr.step()
        losses.append(loss.item())
        for callback in callbacks:
            callback(step, losses)
    return losses
