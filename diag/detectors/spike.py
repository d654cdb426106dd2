"""Loss spikes against an exponential moving average of the sampled losses and their variance.

The average forgets in steps, not samples: a sample ``dt`` steps after the previous one gets the weight
``1 - 0.9 ** (dt / 10)`` (0.1 at the default 10-step loss cadence), so the mean and the variance look back
over the same ~100 steps at any ``every``. The variance starts at 0 and is
divided by the weight it has gathered, ``1 - prod(1 - weight)`` (the bias correction of Adam's moments), so
that it means the same after a few samples at ``every=1`` as after a few at ``every=10``.
"""

from __future__ import annotations

import math

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import SpikeConfig
from diag.detectors.episodes import Closed, Dwell, Episodes

__all__ = ["LossSpike"]

EMA_STEPS = 10  # the average keeps 90% of its weight per this many steps

TODO = ALERTS["loss_spike"].todo


class LossSpike(Detector):
    """A spike is an episode: opened by a loss above ``EMA + spike_sigma * std``, closed by the first
    sample back under it."""

    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.ema: float | None = None
        self.emvar = 0.0
        self.n_loss = 0
        self.last_step: int | None = None
        self.gathered = 0.0  # 1 - prod(1 - weight): the weight the variance has gathered
        self.episodes = Episodes(Dwell(1, 0), Dwell(1, 0))

    def observe(self, obs: Observation) -> list[Alert]:
        loss = obs.loss
        if loss is None or not math.isfinite(loss):
            return []
        self.n_loss += 1
        gap = EMA_STEPS if self.last_step is None else max(1, obs.step - self.last_step)
        self.last_step = obs.step
        if self.ema is None:
            self.ema = loss
            return []
        mean, std = self.ema, math.sqrt(self.emvar / self.gathered) if self.gathered > 0 else 0.0
        spike = self.n_loss > self.cfg.spike_warmup and loss > mean + self.cfg.spike_sigma * max(std, 1e-8)
        delta = loss - mean
        weight = 1.0 - 0.9 ** (gap / EMA_STEPS)
        self.ema += weight * delta
        self.emvar = (1.0 - weight) * (self.emvar + weight * delta * delta)
        self.gathered = 1.0 - (1.0 - self.gathered) * (1.0 - weight)
        event = self.episodes.update("", obs.step, spike, not spike)
        if isinstance(event, Closed):
            return [Alert(obs.step, "loss_spike", "info", "", f"resolved: the loss is back under its running "
                          f"mean + {self.cfg.spike_sigma:g} std after {event.duration} steps",
                          {"duration_steps": float(event.duration)}, "resolved", event.since)]
        if event is not None:
            return [Alert(obs.step, "loss_spike", "warning", "", (
                f"loss spike at step {obs.step}: {loss:.4g} against a running mean of {mean:.4g} (std {std:.3g}). "
                f"What to do: {TODO}"), {"loss": loss, "running_mean": mean}, "firing", obs.step)]
        return []

    def state_dict(self) -> dict:
        return {"ema": self.ema, "emvar": self.emvar, "n_loss": self.n_loss, "spike_last_step": self.last_step,
                "spike_gathered": self.gathered,
                "spike_episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.emvar, self.n_loss = state.get("ema"), state.get("emvar", 0.0), state.get("n_loss", 0)
        self.last_step = state.get("spike_last_step")
        # a state saved before the bias correction: its variance had gathered 1 - 0.9 ** (n - 1) of its weight
        self.gathered = state.get("spike_gathered", 1.0 - 0.9 ** max(0, self.n_loss - 1))
        self.episodes.load_state_dict(state.get("spike_episodes", {}))
