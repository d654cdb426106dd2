"""Which signal families a step samples: one period per family (docs/cost.md).

The families differ widely in cost (measured per family in
docs/cost.md#the-default-cadence; measurements live there only) and in how fast
what they watch moves. The default cadence samples the cheap families, the loss
and the Q/K/V gradient norms (what the loss-spike, non-finite and plateau
detectors read) every 10 steps, the spectra (sigma_1 growth) every 20, and the
costly ones, attention (the collapse detectors) every 50 steps and update ratios
every 100; every step number that is a multiple of a family's period samples that
family, so step 0, 100, 200, ... sample all of them and the tags of each family
carry the steps it was sampled at. :class:`CloserLook` adds attention and the
spectra at the 10-step steps while the detectors ask for them (a head's sigma_1
grows fast, a collapse is being confirmed, the first updates are large), and
attention alone at every step (``watch_every``) while a layer is one head short of a collapse.

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

__all__ = ["SIGNALS", "FAMILIES", "DEFAULT_CADENCE", "Cadence", "CloserLook", "CloserLookConfig", "resolve_cadence"]

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


@dataclass(frozen=True)
class CloserLookConfig:
    """How the closer look samples (docs/cost.md#watching-closer): for ``hold`` steps after the detectors last
    asked, every ``early_every`` steps within the run's first ``early`` steps, and every ``confirm_every`` steps
    while a malignant state is being confirmed (every step: the dwell judged on the steps the evaluation's ground
    truth judges it on; on every second step a head whose entropy alternates around the exit line was
    established where the attention of every step has no collapse, docs/alerts.md#episodes); and attention alone
    every ``watch_every`` steps while a layer is one established head short of a malignant collapse (its next
    head's entry is seen at most ``watch_every - 1`` steps late, so a layer collapse that stays established that
    long is counted from where it began: docs/cost.md#watching-closer)."""

    hold: int = 100
    early: int = 30
    early_every: int = 2
    confirm_every: int = 1
    watch_every: int = 1

    def __post_init__(self) -> None:
        for name, low in (("hold", 0), ("early", 0), ("early_every", 1), ("confirm_every", 1), ("watch_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"CloserLookConfig({name}={value!r}): expected an integer >= {low}")


class CloserLook:
    """Attention (and the spectra) sampled at the cadence's shortest period while the detectors ask for it
    (docs/cost.md#watching-closer).

    The default cadence reads attention every 50 steps: cheap, but a collapse that builds in 50
    steps would be seen late. When a head's sigma_1(Wq^T Wk) grows fast, or a collapse warning or
    a malignant state is being confirmed, or the run's first updates are large
    (``Detectors.wants_attention``), attention, and the spectra when they are sampled less often,
    are also sampled at every step that samples the loss, until ``hold`` steps after the last such
    reason. Within the run's first ``early`` steps a close look samples every ``early_every`` steps
    instead: a head of a run with large first updates can collapse within ten steps (measured:
    established at steps 7 and 10, docs/alerts.md#evaluation), before the 10-step cadence's second
    sample. While a malignant state is being confirmed (a candidate's dwell, or a head come between the malignant
    lines: ``Detectors.confirming``) it samples every ``confirm_every`` steps, and while a
    layer is one established head short of a malignant collapse (``Detectors.watching``) attention alone every
    ``watch_every`` steps. Off (``period`` None) when attention is already sampled at the shortest period.
    """

    def __init__(self, cadence: Cadence, hold: int = CloserLookConfig.hold, enabled: bool = True,
                 early: int = CloserLookConfig.early, early_every: int = CloserLookConfig.early_every,
                 confirm_every: int = CloserLookConfig.confirm_every,
                 watch_every: int = CloserLookConfig.watch_every) -> None:
        base = cadence.base
        self.families = frozenset(f for f in ("attention", "spectra") if cadence.periods.get(f, base) > base)
        self.period = base if enabled and "attention" in self.families else None
        self.hold = hold
        self.early = early if early_every < base else 0  # steps [0, early) sample every early_every steps
        self.early_every = early_every
        self.confirm_every = confirm_every
        self.watch_every = watch_every
        self.until = -1  # the last step that samples attention closely
        self.confirm_until = -1  # ... and the last that samples it every confirm_every steps to confirm a state
        self.look_until = -1  # ... the last of the look the detectors asked for (attention and the spectra)
        self.watch_until = -1  # ... the last that samples attention alone every watch_every steps

    def adds(self, step: int) -> frozenset[str]:
        """The families ``step`` samples beyond the cadence (none, or attention and maybe the spectra); a step
        the cadence does not sample can sample them within the first ``early`` steps, and while a state is
        being confirmed."""
        if self.period is None or step > self.until:
            return _NOTHING
        if step <= self.confirm_until or step <= self.look_until:
            every = (self.confirm_every if step <= self.confirm_until else self.early_every if step < self.early
                     else self.period)
            if step % every == 0:
                return self.families
        return _ATTENTION if step <= self.watch_until and step % self.watch_every == 0 else _NOTHING

    def watch(self, step: int, reason: str | None) -> bool:
        """After the detectors judged ``step``: while they watch a layer (``reason``: one head short of a
        collapse), attention alone is sampled every ``watch_every`` steps, up to the next judged step's
        period on (renewed at each judged step while the reason holds). True when a watch starts."""
        if self.period is None or not reason or self.watch_every >= self.period:
            return False
        started = step >= self.watch_until
        self.watch_until = max(self.watch_until, step + self.period)
        self.until = max(self.until, self.watch_until)
        return started

    def update(self, step: int, reason: str | None, confirm: int = 0) -> bool:
        """After the detectors judged ``step``: extend the close look if they gave a reason. True when a
        close look starts (none was on). ``confirm`` (steps, from ``Detectors.confirming``): a state that
        needs that many more steps of attention to be established or cleared is sampled every
        ``confirm_every`` steps meanwhile: a dwell judged on samples 10 or 50 steps apart (or 2) misses what
        happens between them (docs/alerts.md#episodes)."""
        if self.period is None or not reason:
            return False
        started = step >= self.look_until
        self.look_until = max(self.look_until, step + self.hold)
        self.until = max(self.until, self.look_until)
        if confirm > 0 and self.confirm_every < self.period:
            self.confirm_until = max(self.confirm_until, step + confirm)
            self.until = max(self.until, self.confirm_until)
        return started

    def heed(self, step: int, detectors: Detector) -> list[str]:
        """:meth:`watch` and :meth:`update` with what ``detectors`` ask for (``watching``, ``wants_attention``
        and ``confirming``). Returns what started at this step, in words: a watch, a close look (none, one or
        both)."""
        if self.period is None:
            return []
        watched, reason = detectors.watching(), detectors.wants_attention()
        started = []
        if self.watch(step, watched):
            started.append(f"{watched}: attention sampled every {self.watch_every} steps while it is")
        if self.update(step, reason, detectors.confirming()):
            confirming = step <= self.confirm_until
            dense = self.confirm_until if confirming else self.early - 1
            every = self.confirm_every if confirming else self.early_every
            early = step <= dense
            then = f" up to step {dense}, then every {self.period}" if early else ""
            started.append(f"{reason}: attention sampled every {every if early else self.period} steps{then} until "
                           f"at least step {self.until}")
        return started
