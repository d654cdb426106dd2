"""Detector thresholds, one dataclass that checks itself. Why each default: docs/alerts.md#defaults."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

from diag.errors import ConfigError

__all__ = ["AlertConfig"]

_COUNTS = ("collapse_persist", "warn_persist", "spike_warmup", "watch_early_every")  # samples (or steps), >= 1
_STEPS = ("collapse_dwell", "exit_dwell", "warn_window", "note_horizon", "plateau_window", "watch_hold",
          "eureka_span", "watch_early")


@dataclass
class AlertConfig:
    """Thresholds of every detector; windows and dwells in steps, so the sampling interval does not matter."""

    # attention states (collapse.py); the lines scale with the attention's size
    sparse_entropy: float = 0.5  # nats: at or below, a query spreads its mass over ~1.6 keys or fewer
    low_rank_frac: float = 0.1  # effective rank <= 1 + 10% of (rows - 1): a few keys serve every query
    uniform_frac: float = 0.8  # entropy at 80% of uniform attention's over the same keys is "uniform"
    collapse_persist: int = 2  # samples a head must stay malignant ... (1: at once)
    collapse_dwell: int = 10  # ... spanning at least this many steps
    exit_factor: float = 1.5  # hysteresis: an episode ends only beyond 1.5x its entry line ...
    exit_dwell: int = 50  # ... held for this many steps (and 2 samples)
    # early warning (warning.py)
    warn_window: int = 20  # steps over which sigma_1, entropy and rank trends are measured
    warn_persist: int = 1  # samples the trend must hold (spanning collapse_dwell steps when more than 1)
    sigma_growth: float = 16.0  # sigma_1(Wq^T Wk) of the head grows by this factor over the window ...
    entropy_drop: float = 0.25  # ... while its attention entropy falls by this fraction ...
    rank_drop: float = 0.25  # ... and its attention rank by this fraction ...
    near_entropy: float = 0.75  # or: attention entropy at or below this many nats ...
    near_growth: float = 2.0  # ... while sigma_1 still grows by this factor over the window
    logit_factor: float = 3.0  # ... and its max attention logit at or above this many times ln(keys) ...
    sec_warn: float = 0.5  # ... with SEC_s at or above this ...
    tau_warn: float = 0.01  # ... or an update ratio sigma1(dW)/sigma1(W) at or above this
    # watching closer (the Monitor's default cadence samples attention every 100 steps): when a head's
    # sigma_1(Wq^T Wk) grows by watch_growth within warn_window steps, or a collapse episode or candidate
    # is open, attention is sampled with the spectra (every 10 steps) for watch_hold steps more
    watch_growth: float = 4.0
    watch_hold: int = 100
    watch_early: int = 30  # ... and within the run's first 30 steps every watch_early_every steps
    watch_early_every: int = 2
    note_ratio: float = 0.25  # info note: an update a quarter of the weights' size (60x tau = 0.004) ...
    note_horizon: int = 50  # ... within the first 50 steps: "no warmup", not a collapse
    # plateau and Eureka-moment (plateau.py)
    plateau_window: int = 200  # steps of loss in the plateau test
    plateau_rel: float = 0.125  # the mean losses of the window's halves (in steps) differ by at most 12.5%
    plateau_qk_ratio: float = 0.5  # grad_ratio_qk_v below this: the softmax-induced plateau (a warning)
    plateau_min_frac: float = 0.25  # a plateau sits at this fraction of the first sampled loss or above
    plateau_qk_growth: float = 1.6  # sigma_1(Wq^T Wk) grew at most this much over the window (heads' geometric
    # mean; float("inf"): off) ...
    plateau_uniformity: float = 0.72  # ... and attention entropy is at least this fraction of uniform's (0: off)
    eureka_depth: float = 0.425  # the loss at most 1 - this of the plateau's level (when it was flagged) ...
    eureka_drop: float = 0.25  # ... and this far (relative) below the plateau's own trend ...
    eureka_noise: float = 2.0  # ... and this many noise deviations of the plateau below it, at 2 samples
    eureka_span: int = 20  # ... the median loss of the samples of the last this many steps (one batch is noise)
    # loss spikes (spike.py)
    spike_sigma: float = 6.0  # loss above EMA + spike_sigma * EMA std is a spike
    spike_warmup: int = 10  # samples before spikes are judged

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # a string, None or a bool is a mistake here (an int where a float is expected is fine)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"AlertConfig.{f.name}={value!r}: expected a number, got {type(value).__name__}; "
                                  f"pass e.g. AlertConfig({f.name}={f.default!r})")
            whole = f.name in _COUNTS or f.name in _STEPS
            if whole and (not math.isfinite(value) or value != int(value)):
                raise ConfigError(f"AlertConfig.{f.name}={value!r}: expected a whole number of "
                                  f"{'samples' if f.name in _COUNTS else 'steps'}, e.g. {f.default!r}")
            if f.name in _COUNTS:
                if int(value) < 1:
                    raise ConfigError(f"AlertConfig.{f.name}={value!r}: expected an integer >= 1")
            elif f.name in _STEPS:
                if int(value) < 0 or (f.name == "plateau_window" and int(value) < 2):
                    raise ConfigError(f"AlertConfig.{f.name}={value!r}: expected a number of steps, "
                                      f"{'>= 2' if f.name == 'plateau_window' else '>= 0'}")
            elif f.name == "plateau_uniformity":
                if not 0 <= value <= 1:
                    raise ConfigError(f"AlertConfig.plateau_uniformity={value!r}: expected a fraction of uniform "
                                      "attention's entropy between 0 and 1 (0 switches the test off)")
            elif f.name == "uniform_frac":
                if not 0 < value <= 1:
                    raise ConfigError(f"AlertConfig.uniform_frac={value!r}: expected a fraction of uniform "
                                      "attention's entropy, above 0 and at most 1 (0.8 is 80%)")
            elif f.name == "exit_factor":
                if not value >= 1:
                    raise ConfigError(f"AlertConfig.exit_factor={value!r}: expected a factor >= 1 (the exit line sits "
                                      "this many times beyond the entry line; under 1 it would sit inside it, and a "
                                      "head at the same value would be both in and out), e.g. 1.5")
            elif f.name == "plateau_qk_growth":
                if not value >= 1:
                    raise ConfigError(f"AlertConfig.plateau_qk_growth={value!r}: expected a growth factor >= 1 "
                                      "(float('inf') switches the test off)")
            elif f.name == "eureka_depth":
                if not 0 <= value < 1:
                    raise ConfigError(f"AlertConfig.eureka_depth={value!r}: expected the drop's depth as a fraction of "
                                      "the plateau's level, at least 0 (0: the trend's line alone) and below 1")
            elif f.name == "eureka_drop":
                if not 0 < value < 1:
                    raise ConfigError(f"AlertConfig.eureka_drop={value!r}: expected the drop under the plateau's "
                                      "trend as a fraction of it, above 0 and below 1 (0.25 is 25%)")
            elif not value > 0:
                raise ConfigError(f"AlertConfig.{f.name}={value!r}: expected a positive number")
