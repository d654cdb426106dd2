"""The loss around a collapse: its windows, their falls, and the trend it had before the collapse.

What :mod:`diag.detectors.damage` reads. A loss sample is ``(step, loss)``. A **window** ending at a sample is the
samples of the last ``steps`` steps, and at least :data:`MIN_WINDOW` samples (``loss_mean`` covers the steps
between two samples, so at a loss sampled every 100 steps a 50-step window is the last 3 samples, 300 steps). A
window's **fall** is its least-squares slope times ``steps``, as a fraction of its mean: positive when the loss
falls.

The **trend** before a collapse that began at ``since``: the samples of the ``fit_steps`` steps before it (at least
:data:`MIN_FIT` samples) and those of their last half and quarter (:data:`SCALES`; :data:`MIN_FIT` samples each at
least, or half the whole span's and :data:`MIN_RECENT` at least where the loss is sampled rarely), each fitted with
a curve whose fall slows down as healthy loss curves' do over such a span: a saturating exponential
``a + b exp(-(s - first) / tau)``, a line as ``tau`` grows without bound. Least squares for each ``tau`` of a grid
(``a`` and ``b`` are linear for a given ``tau``), the best ``tau`` refined between its neighbours. Every ``tau``
whose fit the samples do not reject (its squared residuals exceed the best's by less than ``q`` noise variances,
``q`` Student's t quantile squared: a 99% profile-likelihood interval) is a plausible continuation. The noise is
the least residual deviation of a best fit over :data:`MIN_FIT` samples or more.

:meth:`Trend.line` is the **highest** plausible continuation of every span at each step, the most pessimistic one
the samples allow: where they cannot pin ``tau`` down, or a shorter span shows the loss levelling off, about flat
at its recent level; where the whole span is one the curve does not follow (the first steps' plunge, a sudden drop
inside it), its fits stay high and wide. It is read over :meth:`Trend.horizon`, as many steps after the collapse as
the trend was fitted over, and held at its value there beyond it: never extrapolated further.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["MIN_FIT", "MIN_WINDOW", "Series", "Trend", "fall", "fit_trend"]

MIN_WINDOW = 3  # loss samples each window needs
MIN_FIT = 8  # loss samples the trend needs: 3 parameters (a, b, tau) and 5 to estimate the noise
MIN_RECENT = 5  # ... and its last half and quarter at least, where the loss is sampled rarely
TAUS = tuple(2.0 ** (k / 2) for k in range(-8, 11))  # tau in units of the fitted span, 1/16 to 32 (and a line)
SCALES = (1.0, 0.5, 0.25)  # the trend is fitted over the whole span, and over its last half and quarter
Z = 2.5758293035489  # the standard normal's 99.5% quantile


class Series:
    """Loss samples in step order, as parallel lists of their steps and values."""

    def __init__(self, pairs: Sequence[Sequence[float]] = ()) -> None:
        self.steps: list[int] = [int(p[0]) for p in pairs]
        self.values: list[float] = [float(p[1]) for p in pairs]

    def add(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)

    def window(self, steps: int, before: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the last samples (of those at steps before ``before``) spanning ``steps`` steps: those
        after the step ``steps`` before the last one, and at least :data:`MIN_WINDOW` when there are so many."""
        end = len(self.steps) if before is None else bisect.bisect_left(self.steps, before)
        if not end:
            return np.zeros(0), np.zeros(0)
        first = bisect.bisect_right(self.steps, self.steps[end - 1] - steps, 0, end)
        first = min(first, max(end - MIN_WINDOW, 0))
        return np.array(self.steps[first:end], dtype=np.float64), np.array(self.values[first:end], dtype=np.float64)

    def forget(self, steps: int, samples: int) -> None:
        """Keep the samples of the last ``steps`` steps, and at least the last ``samples``; trimmed when at least
        half the list can go (amortised, not at every sample; what is kept beyond that changes no result)."""
        first = bisect.bisect_left(self.steps, self.steps[-1] - steps) if self.steps else 0
        first = min(first, max(len(self.steps) - samples, 0))
        if first > len(self.steps) // 2:
            del self.steps[:first], self.values[:first]

    def pairs(self) -> list[list]:
        return [[s, v] for s, v in zip(self.steps, self.values)]


def fall(steps: np.ndarray, values: np.ndarray, w: int) -> tuple[float, float]:
    """(how far the loss falls per ``w`` steps over the samples (``steps``, ``values``), as a fraction of their
    mean: the least-squares slope times ``w`` over the mean, positive when it falls; that mean). NaN with fewer
    than :data:`MIN_WINDOW` samples or a mean of 0."""
    if len(steps) < MIN_WINDOW or steps[-1] == steps[0]:
        return math.nan, math.nan
    n = len(steps)
    mean, sc = float(values.sum()) / n, steps - steps.sum() / n
    slope = float(sc @ (values - mean) / (sc @ sc))
    return (-slope * w / mean if mean else math.nan), mean


def t_squared(nu: int) -> float:
    """Student's t 99.5% quantile for ``nu`` degrees of freedom, squared (the F(1, nu) 99% quantile): the
    Cornish-Fisher series of Abramowitz & Stegun 26.7.5, within 5% of the exact value from ``nu = 2``."""
    z = Z
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
             (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return (z + sum(g / nu ** (i + 1) for i, g in enumerate(terms))) ** 2


@dataclass(frozen=True)
class Trend:
    """The loss before a collapse that began at ``since``: the plausible continuations ``(a, b, tau, first)`` of
    each span, fitted from step ``first`` (``tau`` in steps; None: the line ``a + b (s - first)``); ``start``, the
    first step of the whole span (the horizon is as long); the noise (the least residual deviation of a span's best
    fit); the fall and mean of the window just before ``since``. No fits when fewer than :data:`MIN_FIT` samples
    came before it."""

    since: int
    start: int
    fits: tuple[tuple[float, float, float | None, int], ...]
    noise: float
    fall_before: float
    level_before: float
    # the samples show the loss's fall slowing down as one exponential would (:func:`_slowing`); a fall that is
    # straight, speeds up or slows down ever faster (a warmup, a sudden drop) says nothing of where it levels off
    slowing: bool = False

    @cached_property
    def at(self) -> float:
        """The loss's level at the collapse: the line at ``since``."""
        return float(self.line(np.array([self.since]))[0])

    @property
    def horizon(self) -> int:
        """The last step at which the trend is read: as many steps after ``since`` as it was fitted over."""
        return 2 * self.since - self.start

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(a, b, tau (inf for a line), first, is a line): the fits as arrays, one entry each."""
        a, b, tau, first = (np.array(column, dtype=np.float64) for column in zip(*self.fits))
        is_line = np.isnan(tau)
        return a, b, np.where(is_line, np.inf, tau), first, is_line

    def line(self, steps: np.ndarray) -> np.ndarray:
        """The most pessimistic continuation at ``steps``: the highest plausible fit's value at each (at the
        horizon beyond it)."""
        a, b, tau, first, is_line = self._arrays
        t = np.minimum(np.atleast_1d(np.asarray(steps, dtype=np.float64)), self.horizon)[None, :] - first[:, None]
        x = np.where(is_line[:, None], t, np.exp(-t / tau[:, None]))  # (fits, steps)
        return (a[:, None] + b[:, None] * x).max(axis=0)

    def state(self) -> list:
        return [self.since, self.start, [list(f) for f in self.fits], self.noise, self.fall_before,
                self.level_before, self.slowing]

    @classmethod
    def of_state(cls, state: list) -> Trend:
        since, start, fits, noise, fall_before, level_before, slowing = state
        return cls(int(since), int(start), tuple((float(a), float(b), None if t is None else float(t), int(f))
                                                 for a, b, t, f in fits), float(noise), float(fall_before),
                   float(level_before), bool(slowing))


def fit_trend(series: Series, since: int, fit_steps: int, window_steps: int) -> Trend:
    """The :class:`Trend` of the samples before ``since``: fitted over the last ``fit_steps`` steps before it (at
    least :data:`MIN_FIT` samples) and over their last half and quarter (:data:`SCALES`), the window of
    ``window_steps`` before it for its fall. Whether the fall slows down is the whole span's."""
    fall_before, level_before = fall(*series.window(window_steps, before=since), window_steps)
    end = bisect.bisect_left(series.steps, since)
    spans: list[tuple[int, int, list, float]] = []  # (first step, samples, plausible fits, deviation), longest first
    least = MIN_FIT
    for scale in SCALES:
        first = min(bisect.bisect_left(series.steps, since - scale * fit_steps, 0, end), max(end - least, 0))
        if end - first < least or any(series.steps[first] == span[0] for span in spans):
            continue
        spans.append((series.steps[first], end - first,
                      *_fit(series.steps[first:end], series.values[first:end], since)))
        if scale == 1:  # the shorter spans: MIN_FIT samples where the whole span holds twice as many, else half of
            # its samples (MIN_RECENT at least), so that a loss sampled rarely still has its recent samples read apart
            least = max(MIN_RECENT, min(MIN_FIT, (end - first) // 2))
    if not spans:
        return Trend(since, since, (), math.nan, fall_before, level_before)
    slowing = _slowing(spans[0][2], [fits for _, _, fits, _ in spans[1:]])
    # the loss's noise about its curve: the least deviation of a span of MIN_FIT samples or more (a longer span the
    # curve does not follow, or a noise that grows with the loss in a plunge, leaves larger residuals)
    noise = min(deviation for _, n, _, deviation in spans if n >= MIN_FIT)
    return Trend(since, spans[0][0], tuple(f for _, _, fits, _ in spans for f in fits), noise, fall_before,
                 level_before, slowing)


def _slowing(whole: list, recent: list[list]) -> bool:
    """Whether the loss's fall slows down as one exponential would: every plausible fit over the whole span falls
    and slows down (no straight line), and each shorter span allows a time constant at least half the whole
    span's shortest (a fall that slows down ever faster, as at the end of a warmup, comes to its floor sooner than
    any exponential fitted to its past says: its continuation is not known)."""
    if not all(tau is not None and b > 0 for _, b, tau, _ in whole):
        return False
    shortest = min(tau for _, _, tau, _ in whole)
    return all(max(math.inf if tau is None else tau for _, _, tau, _ in fits) >= shortest / 2 for fits in recent)


def _solve(s: np.ndarray, v: np.ndarray, taus: list[float | None]) -> tuple[np.ndarray, ...]:
    """(a, b, squared residuals) of the least-squares fit ``a + b x`` for each ``tau``: ``x = exp(-s / tau)``, or
    ``s`` for None (a line)."""
    x = np.stack([s if tau is None else np.exp(-s / tau) for tau in taus])  # (taus, samples)
    xc, vc = x - x.mean(axis=1, keepdims=True), v - v.mean()
    b = (xc @ vc) / np.maximum((xc * xc).sum(axis=1), 1e-300)
    a = v.mean() - b * x.mean(axis=1)
    return a, b, ((v - a[:, None] - b[:, None] * x) ** 2).sum(axis=1)


def _fit(steps: list[int], values: list[float], since: int) -> tuple[list, float]:
    """The plausible fits ``(a, b, tau, first)`` of the samples, and the best fit's residual deviation: the grid
    of :data:`TAUS`, and the best time constant between its neighbours on the grid, refined twice."""
    first = steps[0]
    s = np.array(steps, dtype=np.float64) - first
    v = np.array(values, dtype=np.float64)
    span = float(since - first)
    taus: list[float | None] = [t * span for t in TAUS] + [None]
    a, b, rss = _solve(s, v, taus)
    i = int(rss.argmin())
    if taus[i] is not None:
        lo, hi = taus[max(i - 1, 0)], taus[min(i + 1, len(TAUS) - 1)]
        for _ in range(2):  # 9 points between the neighbours, then between the new best's
            fine = list(np.geomspace(lo, hi, 9))
            fa, fb, frss = _solve(s, v, fine)
            j = int(frss.argmin())
            lo, hi = fine[max(j - 1, 0)], fine[min(j + 1, 8)]
        taus.append(fine[j])
        a, b, rss = np.append(a, fa[j]), np.append(b, fb[j]), np.append(rss, frss[j])
    nu = len(v) - 3
    best = float(rss.min())
    # the rounding of the sums: a curve that the samples follow exactly leaves residuals of this order
    floor = len(v) * (1e-12 * float(np.abs(v).max())) ** 2
    allowed = best + t_squared(nu) * max(best / nu, floor)
    return [(float(a[k]), float(b[k]), None if taus[k] is None else float(taus[k]), first)
            for k in range(len(taus)) if rss[k] <= allowed], math.sqrt(best / nu)
