"""Each detector's thresholds, a small dataclass checked by the kinds of its fields; ``AlertConfig`` holds them all.

A field's annotation says what it may hold (``Positive``, ``Fraction``, ``Steps``, ``Samples``, ...): one
check, :meth:`Checked.__post_init__`, reads the annotations and refuses anything else with a ``ConfigError``
that names the field, what was wrong and an example. Why each default: docs/alerts.md#defaults.

    AlertConfig(sparse_entropy=0.3)                      # a field by its name: it goes to its detector's config
    AlertConfig(states=StatesConfig(sparse_entropy=0.3))  # the same
    cfg.states.sparse_entropy, cfg.sparse_entropy         # the same value
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Annotated, get_type_hints

from diag.errors import ConfigError

__all__ = ["AlertConfig", "Checked", "DamageConfig", "EarlyUpdatesConfig", "PlateauConfig", "RiskConfig",
           "SpikeConfig", "StatesConfig"]


@dataclass(frozen=True)
class Kind:
    """What a field may hold: a number in [lo, hi] (open ends where said), whole for counts."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    whole: str = ""  # "steps" or "samples": a whole number of them
    meaning: str = ""  # said in the error, e.g. "a fraction: 0.8 is 80%"

    def problem(self, value: float) -> str | None:
        if self.whole and (not math.isfinite(value) or value != int(value)):
            return f"expected a whole number of {self.whole}"
        low = value > self.lo if self.lo_open else value >= self.lo
        high = value < self.hi if self.hi_open else value <= self.hi
        if low and high:
            return None
        lo, hi = ("(" if self.lo_open else "[") + f"{self.lo:g}", f"{self.hi:g}" + (")" if self.hi_open else "]")
        return f"expected {self.meaning or 'a number'} in {lo}, {hi}"


Positive = Annotated[float, Kind(0, lo_open=True, meaning="a positive number")]
Fraction = Annotated[float, Kind(0, 1, lo_open=True, hi_open=True, meaning="a fraction (0.25 is 25%)")]
Share = Annotated[float, Kind(0, 1, meaning="a fraction from 0 to 1 (0.8 is 80%)")]
Probability = Annotated[float, Kind(0, 1, meaning="a probability")]
Factor = Annotated[float, Kind(1, meaning="a factor of at least 1")]
Steps = Annotated[int, Kind(0, whole="steps", meaning="a number of steps")]
Samples = Annotated[int, Kind(1, whole="samples", meaning="a number of samples")]


class Checked:
    """Validates every field against the ``Kind`` in its annotation (and that it is a number at all)."""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self), include_extras=True)
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Kind)]
            # a string, None or a bool is a mistake here (an int where a float is expected is fine)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"{type(self).__name__}.{f.name}={value!r}: expected a number, got "
                                  f"{type(value).__name__}; pass e.g. {f.name}={f.default!r}")
            for kind in kinds:
                problem = kind.problem(float(value))
                if problem:
                    raise ConfigError(f"{type(self).__name__}.{f.name}={value!r}: {problem}, e.g. {f.default!r}")
                if kind.whole:
                    object.__setattr__(self, f.name, int(value))


@dataclass(frozen=True)
class StatesConfig(Checked):
    """The attention states (:mod:`diag.detectors.states`): lines per sample, dwells in steps, layers by share."""

    sparse_entropy: Positive = 0.5  # nats: at or below, a query spreads its mass over ~1.6 keys or fewer
    low_rank_frac: Positive = 0.1  # effective rank <= 1 + 10% of (rows - 1): a few keys serve every query
    uniform_frac: Annotated[float, Kind(0, 1, lo_open=True, meaning="a fraction of uniform attention's "
                                        "entropy (0.8 is 80%)")] = 0.8
    collapse_persist: Samples = 2  # samples a head must stay in a state to establish it ...
    collapse_dwell: Steps = 10  # ... spanning at least this many steps
    exit_factor: Annotated[float, Kind(1, meaning="a factor of at least 1 (the exit line sits this many times "
                                       "beyond the entry line)")] = 1.5
    exit_dwell: Steps = 50  # an episode ends once its exit test held this many steps (and 2 samples)
    layer_share: Fraction = 0.5  # a layer is in a state when this share of its heads (and 2 or more) are
    # an attention sink: one key position holds at least half of the queries' mass, averaged over the sampled
    # sequences (sinks hold 0.83-1.0; the reproductions' collapsed heads 0.13-0.36 on their best fixed position:
    # docs/metrics.md#attention-sinks)
    sink_share: Fraction = 0.5


@dataclass(frozen=True)
class RiskConfig(Checked):
    """``collapse_risk``, a logged number and the closer look's reason to watch a layer (:mod:`diag.detectors.risk`)."""

    risk_horizon: Steps = 50  # p = P(a layer's malignant collapse established within this many steps)
    watch_risk: Probability = 0.2  # the Monitor samples attention closely while a layer's p is this or more ...
    watch_growth: Factor = 4.0  # ... or a head's sigma_1(Wq^T Wk) grew this much within risk_window steps
    risk_window: Annotated[int, Kind(1, whole="steps", meaning="a number of steps")] = 20  # trend window
    update_fresh: Steps = 20  # an update ratio older than this many steps is not used (missing, not stale)


@dataclass(frozen=True)
class DamageConfig(Checked):
    """``collapse_damage`` (critical) and ``collapse_stall`` (:mod:`diag.detectors.damage`): the loss after a
    collapse against its level and its trend before it."""

    damage_window: Annotated[int, Kind(2, whole="steps", meaning="a number of steps")] = 50  # the loss's windows
    # (and 3 samples or more)
    damage_fit: Annotated[int, Kind(2, whole="steps", meaning="a number of steps")] = 200  # the trend before a
    # collapse is fitted over this many steps (and 5 samples or more) and read over as many after it
    damage_rel: Fraction = 0.05  # critical: the loss above its level, or its trend, by 5% (the twin test's line) ...
    damage_noise: Positive = 3.0  # ... and by this many of the trend's noise deviations
    stall_rel: Fraction = 0.01  # a window whose loss falls by less than 1% of its level has stopped falling


@dataclass(frozen=True)
class EarlyUpdatesConfig(Checked):
    """The ``large_early_updates`` note (:mod:`diag.detectors.early_updates`)."""

    note_ratio: Positive = 0.25  # an update a quarter the size of the weights (60x tau = 0.004) ...
    note_horizon: Steps = 50  # ... within the first 50 steps: "no warmup", not a collapse


@dataclass(frozen=True)
class PlateauConfig(Checked):
    """``eureka_plateau`` and ``eureka_moment`` (:mod:`diag.detectors.plateau`)."""

    plateau_window: Annotated[int, Kind(2, whole="steps", meaning="a number of steps")] = 200
    plateau_rel: Positive = 0.125  # the mean losses of the window's halves differ by at most 12.5%
    plateau_qk_ratio: Positive = 0.5  # a stuck layer's grad_ratio_qk_v at most this: the softmax-induced plateau
    # above the Eureka plateaus' motions on the evaluation's consulted runs (0.08-0.19), so that a plateau is
    # flagged at every cadence alike (docs/alerts.md#defaults)
    plateau_qk_motion: Positive = 0.25  # ln sigma_1(Wq^T Wk) growth per unit of Q/K update ratio (inf: off) ...
    plateau_max_growth: Factor = 1.35  # ... and sigma_1(Wq^T Wk) grew at most 1.35x over the window (inf: off)
    plateau_entropy_gap: Positive = 1.0  # ... and each of its heads within this many nats of uniform's entropy
    # (inf: off): a perplexity of at least exp(-1) = 37% of the keys in play, at any context length
    plateau_min_update: Share = 0.25  # ... and the Q/K updates at least this share of their largest window's (0: off)
    eureka_depth: Annotated[float, Kind(0, 1, hi_open=True, meaning="the drop's depth as a fraction of the "
                                        "plateau's level")] = 0.385
    eureka_drop: Fraction = 0.25  # ... and this far (relative) below the plateau's own trend ...
    eureka_noise: Positive = 2.0  # ... and this many noise deviations of the plateau below it, at 2 samples
    eureka_span: Steps = 20  # ... the median loss of the samples of the last this many steps


@dataclass(frozen=True)
class SpikeConfig(Checked):
    """``loss_spike`` (:mod:`diag.detectors.spike`)."""

    spike_sigma: Positive = 6.0  # loss above EMA + spike_sigma * EMA std is a spike
    spike_warmup: Samples = 10  # samples before spikes are judged


_PARTS = {"states": StatesConfig, "risk": RiskConfig, "damage": DamageConfig, "early": EarlyUpdatesConfig,
          "plateau": PlateauConfig, "spike": SpikeConfig}
_OWNER = {f.name: part for part, cls in _PARTS.items() for f in fields(cls)}


class AlertConfig:
    """Every detector's config. Takes the parts (``states=StatesConfig(...)``) or any field by its name, which
    goes to its part; reads a field by its name too. Immutable: :meth:`replace` makes a changed copy."""

    __slots__ = tuple(_PARTS)

    def __init__(self, **values: object) -> None:
        given = {part: values.pop(part) for part in _PARTS if part in values}
        for part, cls in _PARTS.items():
            if part in given and not isinstance(given[part], cls):
                raise ConfigError(f"AlertConfig({part}=...): expected a {cls.__name__}, got "
                                  f"{type(given[part]).__name__}")
        unknown = sorted(set(values) - set(_OWNER))
        if unknown:
            raise ConfigError(f"AlertConfig: unknown field(s) {unknown}; the fields are {sorted(_OWNER)} "
                              "(docs/alerts.md#defaults)")
        for part, cls in _PARTS.items():
            mine = {k: v for k, v in values.items() if _OWNER[k] == part}
            base = given.get(part, cls())
            object.__setattr__(self, part, replace(base, **mine) if mine else base)

    def __getattr__(self, name: str) -> object:
        part = _OWNER.get(name)
        if part is None:
            raise AttributeError(f"AlertConfig has no field {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AlertConfig is immutable: use cfg.replace({name}=...)")

    def replace(self, **values: object) -> AlertConfig:
        return AlertConfig(**{part: getattr(self, part) for part in _PARTS}, **values)

    def fields(self) -> dict[str, object]:
        """Every field by its name, with its value."""
        return {name: getattr(self, name) for name in _OWNER}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AlertConfig) and all(getattr(self, p) == getattr(other, p) for p in _PARTS)

    def __repr__(self) -> str:
        return "AlertConfig(" + ", ".join(f"{p}={getattr(self, p)!r}" for p in _PARTS) + ")"
