"""Loss spikes against an exponential moving average of the sampled losses and their variance."""

from __future__ import annotations

import math

from diag.detectors.base import Alert, Observation
from diag.detectors.config import AlertConfig
from diag.detectors.episodes import Closed, Dwell, Episodes

__all__ = ["LossSpike"]

TODO = "inspect the batch; clip gradients; if attn_max_logit climbs too, consider QK-norm or a lower learning rate"


class LossSpike:
    """A spike is an episode: opened by a loss above ``EMA + spike_sigma * std``, closed by the first
    sample back under it."""

    def __init__(self, cfg: AlertConfig) -> None:
        self.cfg = cfg
        self.ema: float | None = None
        self.emvar = 0.0
        self.n_loss = 0
        self.episodes = Episodes(Dwell(1, 0), Dwell(1, 0))

    def observe(self, obs: Observation) -> list[Alert]:
        loss = obs.loss
        if loss is None or not math.isfinite(loss):
            return []
        self.n_loss += 1
        if self.ema is None:
            self.ema = loss
            return []
        mean, std = self.ema, math.sqrt(self.emvar)
        spike = self.n_loss > self.cfg.spike_warmup and loss > mean + self.cfg.spike_sigma * max(std, 1e-8)
        delta = loss - mean
        self.ema += 0.1 * delta
        self.emvar = 0.9 * (self.emvar + 0.1 * delta * delta)
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
        return {"ema": self.ema, "emvar": self.emvar, "n_loss": self.n_loss,
                "spike_episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.emvar, self.n_loss = state.get("ema"), state.get("emvar", 0.0), state.get("n_loss", 0)
        self.episodes.load_state_dict(state.get("spike_episodes", {}))
