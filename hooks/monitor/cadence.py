"""Which signal families a step samples: one period per family (docs/cost.md).

The families differ widely in cost (measured per family in
docs/cost.md#the-default-cadence; measurements live there only) and in how fast
what they watch moves. The default cadence samples the cheap families, the loss
and the Q/K/V gradient norms (what the loss-spike, non-finite and plateau
detectors read) every 10 steps, the spectra (sigma_1 growth) every 20, and the
costly ones, attention (the collapse detectors) every 50 steps and update ratios
every 100; every step number that is a multiple of a family's period samples that
family, so step 0, 100, 200, ... sample all of them and the tags of each family
carry the steps it was sampled at. :class:`CloserLook` adds attention (and the
spectra) while the detectors ask for it: at every step while a head is near the
malignant lines, with every loss sample while a layer is at risk.

``Monitor(every=N)`` samples every family every N steps.
``Monitor(cadence={"attention": 50})`` changes the named periods only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from diag.detectors import Detector
from diag.errors import ConfigError

__all__ = ["SIGNALS", "FAMILIES", "DEFAULT_CADENCE", "Cadence", "CloserLook", "resolve_cadence"]

_NOTHING: frozenset[str] = frozenset()
_ATTENTION: frozenset[str] = frozenset({"attention"})

SIGNALS = ("spectra", "attention", "grads", "updates")  # the families a Monitor may leave out
FAMILIES = ("loss", "grads", "spectra", "attention", "updates")

# Steps between two samples of each family when neither ``every`` nor ``cadence`` names it.
DEFAULT_CADENCE: Mapping[str, int] = {"loss": 10, "grads": 10, "spectra": 20, "attention": 50, "updates": 100}


@dataclass(frozen=True)
class Cadence:
    """periods: family -> steps between its samples (only the families that are on)."""

    periods: Mapping[str, int]

    def due(self, step: int) -> frozenset[str]:
        """The families sampled at ``step``. Most steps sample nothing: one modulo says so (the hot path)."""
        if step % self._gcd:
            return _NOTHING
        return frozenset(f for f, period in self.periods.items() if step % period == 0)

    def is_due(self, family: str, step: int) -> bool:
        period = self.periods.get(family)
        return period is not None and step % period == 0

    @cached_property
    def _gcd(self) -> int:
        """Every period is a multiple of it: a step that is not samples no family."""
        return math.gcd(*self.periods.values()) if self.periods else 1

    @property
    def base(self) -> int:
        """The shortest period: no step between two of its multiples samples anything."""
        return min(self.periods.values(), default=1)

    @property
    def full(self) -> int:
        """The least common multiple of the periods: the steps that sample every family."""
        return math.lcm(*self.periods.values()) if self.periods else 1


def resolve_cadence(every: int | None, cadence: Mapping[str, int] | None, signals: Iterable[str]) -> Cadence:
    """The periods of the families that are on (``signals``, some of :data:`SIGNALS`, plus the loss).

    every: None for :data:`DEFAULT_CADENCE`, else every family every ``every`` steps.
    cadence: periods that override either, e.g. ``{"attention": 50}``.
    """
    unknown = set(signals) - set(SIGNALS)
    if unknown:
        raise ConfigError(f"Monitor(signals=...) has unknown {sorted(unknown)}; choose from {SIGNALS}")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"Monitor(every={every!r}): expected an integer >= 1 or None (the default per-family "
                          f"cadence {dict(DEFAULT_CADENCE)}), e.g. every=10")
    if cadence is not None and not isinstance(cadence, Mapping):
        raise ConfigError(f"Monitor(cadence={cadence!r}): expected a mapping family -> steps between samples, "
                          "e.g. cadence={'attention': 50}")
    overrides = dict(cadence or {})
    unknown = sorted(set(overrides) - set(FAMILIES))
    if unknown:
        raise ConfigError(f"Monitor(cadence=...) has unknown families {unknown}; choose from {FAMILIES}")
    for family, period in overrides.items():
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ConfigError(f"Monitor(cadence={{{family!r}: {period!r}}}): expected an integer >= 1 "
                              f"(steps between two samples of {family})")
    on = {"loss", *signals}
    periods = {f: overrides.get(f, DEFAULT_CADENCE[f] if every is None else every) for f in FAMILIES if f in on}
    return Cadence(periods)


class CloserLook:
    """Attention sampled closer while the detectors ask for it (docs/cost.md#watching-closer), by how near the
    attention is to the collapse lines:

    * **near** (``Detectors.near``: a head inside or between the malignant lines, not in an established sink, of a
      layer not yet collapsed, for up to twice the entry dwell from when it came there): attention at every step,
      and the spectra with every loss sample. A collapse's dwell is judged on the steps it lasts, not on samples
      50 steps apart: a head hovering at the entropy line can sit inside it between two samples and above it at
      each;
    * **at risk** (``Detectors.at_risk``: a layer's ``collapse_risk`` at ``watch_risk`` or more, a head's
      ``sigma_1`` growing ``watch_growth``-fold within ``risk_window`` steps, large first updates): attention and
      the spectra with every loss sample (the cadence's shortest period), so that the risk is judged on fresh
      attention.

    The detectors are asked again at every judged step, so a look lasts while its reason does. Off (``period``
    None) when attention is already sampled at the shortest period. On several processes rank 0's detectors
    decide and every rank takes the same look (:mod:`hooks.monitor.sharedlook`)."""

    def __init__(self, cadence: Cadence, enabled: bool = True) -> None:
        base = cadence.base
        self.families = frozenset(f for f in ("attention", "spectra") if cadence.periods.get(f, base) > base)
        self.period = base if enabled and "attention" in self.families else None
        self.near_until = -1  # the last step that samples attention at every step
        self.risk_until = -1  # the last step that samples attention and the spectra with every loss sample
        self.until = -1  # the later of the two

    def adds(self, step: int) -> frozenset[str]:
        """The families ``step`` samples beyond the cadence: none, attention alone (a step between two loss
        samples while a head is near the lines), or attention and maybe the spectra."""
        if self.period is None or step > self.until:
            return _NOTHING
        if step % self.period == 0:
            return self.families
        return _ATTENTION if step <= self.near_until else _NOTHING

    def heed(self, step: int, detectors: Detector) -> list[str]:
        """After the detectors judged ``step``: extend the look their reasons ask for. Returns what started at this
        step, in words (nothing while a look goes on)."""
        if self.period is None:
            return []
        started = []
        near, risk = detectors.near(), detectors.at_risk()
        if near:
            if step > self.near_until:
                started.append(f"{near}: attention sampled at every step")
            self.near_until = step + 1
        if risk:
            if step > self.risk_until:
                started.append(f"{risk}: attention and the spectra sampled every {self.period} steps")
            self.risk_until = step + self.period
        self.until = max(self.near_until, self.risk_until)
        return started
