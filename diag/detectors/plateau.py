"""Loss plateaus with small Q/K gradients (Hoffmann et al.) and the Eureka-moment that ends them.

Windows are in steps. The loss is, where the Monitor measured it, the mean loss of the steps since the previous
sample (``Observation.loss_mean``: ten batches at the default cadence, not one), else the sampled step's. A
plateau is recognised by its mechanism (Hoffmann et al.: attention that has not learned where to look gets
softmax-damped Q/K gradients and cannot start to), not by where the loss sits: the mean losses of the two halves
of the last ``plateau_window`` steps differ by at most ``plateau_rel``, and at least one layer is **stuck**: its
Q/K-to-V gradient ratio, averaged over the window, is at most ``plateau_qk_ratio`` and every one of its heads
keeps an attention entropy within ``plateau_entropy_gap`` nats of uniform's (the window's mean of the layer's
least uniform head: no head of the layer has learned to select; a gap of g nats is a perplexity of ``exp(-g)``
of the keys in play, the same share of them at any context length); and, where the window holds them, the stuck
layers' ``sigma_1(Wq^T Wk)`` moved at most ``plateau_qk_motion`` per unit of the Q/K update ratios applied
meanwhile (:func:`_motion`: the heads' geometric mean growth, schedule-free) and grew at most
``plateau_max_growth`` over the window (a flat loss while the query/key product still grows is another state);
and the latest Q/K update ratio is at least ``plateau_min_update`` of the largest since half a window into the run
(the learning rate has not decayed away: a schedule's tail is flat because training stopped). The
plateau is an episode, ``since`` the first sample of the window inside its band (at most ``1 + plateau_rel``
times the level); while it lasts its trend is refitted. The Eureka-moment: the loss, the median of the samples
of the last ``eureka_span`` steps, is at two samples (in a row, or with one sample just over the line between
them) at most ``1 - eureka_depth`` of the plateau's level (its trend at the step it was flagged: how deep the drop is)
and below the plateau's own extrapolated trend by ``eureka_drop`` of it and by ``eureka_noise`` times the
plateau's noise (it leaves the plateau against the plateau's own trend: a slow sink that the trend follows down
to the depth line is no moment), while the Q/K gradient share rises above its plateau mean or the attention
entropy falls below it (when those signals are there). The moment closes the plateau (one ``resolved`` record).
"""

from __future__ import annotations

import math

import numpy as np

from diag.catalog.alerts import ALERTS
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import PlateauConfig

__all__ = ["Plateau", "fit_trend"]

TODO = ALERTS["eureka_plateau"].todo


# While the plateau lasts its trend follows the loss, except for samples whose smoothed loss lies more than this
# many of its own standard errors under the trend (the start of a drop must not drag the trend along). Chosen
# among 1, 2, 3 on the tuning seeds (docs/alerts.md#eureka_plateau). A line of half the plateau's per-sample
# noise at any cadence would, at the default cadence (a median of 2 samples), leave out a quarter of the
# plateau's own low samples: the trend would drift above a slowly sinking loss and a moment come early.
REFIT_SE = 1.0
MIN_POINTS = 4  # the fewest samples a trend is fitted on


def fit_trend(points: list[list[float]]) -> tuple[float, float, float]:
    """Least squares ``loss = a + b * step`` over ``[[step, loss, ...], ...]``: (a, b, noise), the noise
    the residuals' median absolute deviation scaled to a standard deviation; a rising fit becomes the flat
    mean (b = 0)."""
    steps, losses = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    if np.ptp(steps) == 0:
        return float(losses.mean()), 0.0, 1.4826 * float(np.median(np.abs(losses - np.median(losses))))
    b, a = np.polyfit(steps, losses, 1)
    residuals = losses - (a + b * steps)
    noise = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))  # robust: one spike is not noise
    if b > 0:  # a plateau does not climb: a rising fit is noise, and extrapolated it would drift away
        a, b = float(losses.mean()), 0.0
    return float(a), float(b), noise


def _log_sigma(obs: Observation) -> dict[str, list[float]] | None:
    """ln sigma_1(Wq^T Wk) per layer and head (NaN where it is not a positive finite number), or None without
    spectra: a head's growth over a window is the change of its value."""
    out = {}
    for label, m in obs.layers.items():
        if "qk_sigma1" in m:
            sigma = np.atleast_1d(np.asarray(m["qk_sigma1"], float))
            good = np.isfinite(sigma) & (sigma > 0)
            out[label] = [float(np.log(x)) if ok else math.nan for x, ok in zip(sigma, good)]
    return out or None


def _layer_signals(obs: Observation) -> dict[str, list[float]]:
    """Per layer ``[Q/K-to-V gradient ratio, attention entropy of its least uniform head as a fraction of
    uniform's, uniform's entropy less that head's in nats]``, NaN where the sample does not hold the signal."""
    out = {}
    for label, m in obs.layers.items():
        ratio = float(m["grad_ratio_qk_v"][0]) if "grad_ratio_qk_v" in m else math.nan
        least = gap = math.nan
        if "attn_entropy" in m and "attn_entropy_uniform" in m:
            entropy = np.atleast_1d(np.asarray(m["attn_entropy"], float))
            uniform = float(np.atleast_1d(np.asarray(m["attn_entropy_uniform"], float))[0])
            if entropy.size and np.isfinite(entropy).all() and math.isfinite(uniform) and uniform > 0:
                least, gap = float(entropy.min()) / uniform, uniform - float(entropy.min())
        if math.isfinite(ratio) or math.isfinite(least):
            out[label] = [ratio, least, gap]
    return out


def stuck_layers(points: list[list], qk_ratio: float, entropy_gap: float) -> dict[str, tuple[float, float, float]]:
    """The layers stuck over the window ``points``: ``{label: (mean Q/K-to-V ratio, mean uniformity of the least
    uniform head, mean gap of that head's entropy under uniform's in nats)}`` for each layer whose mean ratio is at
    most ``qk_ratio`` and whose mean gap is at most ``entropy_gap`` (``inf``: not asked, a layer without attention
    samples may be stuck)."""
    values: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for p in points:
        for label, signals in (p[5] or {}).items():
            for column, x in zip(values.setdefault(label, ([], [], [])), signals):
                if math.isfinite(x):
                    column.append(x)
    out = {}
    for label, columns in values.items():
        ratio, least, gap = (float(np.mean(v)) if v else math.nan for v in columns)
        if ratio <= qk_ratio and (math.isinf(entropy_gap) or gap <= entropy_gap):
            out[label] = (ratio, least, gap)
    return out


def _growth(points: list[list], layers: set[str] | None = None) -> float:
    """The geometric mean, over the heads (of ``layers``, or all) whose sigma_1 is known at both, of the growth
    of sigma_1(Wq^T Wk) between the window's first and last samples that have spectra (NaN if fewer than 2, or no
    head in common: a layer whose spectra failed at one end does not count)."""
    have = [p[4] for p in points if p[4]]
    if len(have) < 2:
        return math.nan
    first, last = have[0], have[-1]
    labels = first.keys() & last.keys() & (layers if layers is not None else first.keys())
    changes = [b - a for label in labels for a, b in zip(first[label], last[label])
               if math.isfinite(a) and math.isfinite(b)]
    return float(np.exp(np.mean(changes))) if changes else math.nan


def _mean_update(updates: list[list[float]], last: float) -> float:
    """The Q/K update ratio over the window's steps up to ``last``: each sample holds until the next (a run's first
    steps, sampled densely and with the largest updates, weigh as many steps as they last, not as many samples as
    they have); NaN without one."""
    ratios = sorted((s, u) for s, u in updates if math.isfinite(u) and u > 0)
    if not ratios:
        return math.nan
    ends = [s for s, _ in ratios[1:]] + [max(last, ratios[-1][0]) + 1.0]
    weights = [e - s for (s, _), e in zip(ratios, ends)]
    return sum(u * w for (_, u), w in zip(ratios, weights)) / sum(weights)


def _motion(points: list[list], updates: list[list[float]], layers: set[str] | None = None) -> tuple[float, float]:
    """(growth, motion): the growth of sigma_1(Wq^T Wk) of ``layers`` over the window (:func:`_growth`) and how far
    that is per unit of the Q/K update ratios the optimizer applied meanwhile,
    ``ln(growth) / (steps * mean update ratio)``: ~0 when the steps Q and K take are noise (Hoffmann et al.'s
    plateau), near the alignment of a head learning otherwise. Schedule-free: a decaying learning rate shrinks the
    growth and the updates alike. NaN without two spectra samples or an update ratio in the window."""
    growth = _growth(points, layers)
    have = [p[0] for p in points if p[4]]
    if not math.isfinite(growth) or growth <= 0 or len(have) < 2:
        return growth, math.nan
    mean = _mean_update(updates, have[-1])
    if not math.isfinite(mean):
        return growth, math.nan
    return growth, math.log(growth) / ((have[-1] - have[0]) * mean)


def _mean(points: list[list[float]], column: int) -> float:
    values = [p[column] for p in points if math.isfinite(p[column])]
    return float(np.mean(values)) if values else math.nan


class Plateau(Detector):
    """The loss history ``losses``: ``[[step, loss, qk_ratio, entropy, ln_sigma1, layers], ...]``
    over the window (``ln_sigma1``: ``{layer: [ln sigma_1 per head]}`` or None, :func:`_log_sigma`; ``layers``:
    :func:`_layer_signals`); ``recent`` and ``below`` keep the first four fields."""

    def __init__(self, cfg: PlateauConfig) -> None:
        self.cfg = cfg
        self.losses: list[list[float]] = []
        # while one lasts: {"since", "a", "b", "noise", "ratio", "entropy", "level"}
        self.plateau: dict | None = None
        self.below: list[list[float]] = []  # the samples whose smoothed loss is under the moment's line ...
        self.gap = 0  # ... with this many samples over it since the last one under (0 or 1)
        self.recent: list[list[float]] = []  # the samples of the last eureka_span steps (the smoothed loss)
        self.start: int | None = None  # the first step of the current watch (the run's, or after a moment)
        self.updates: list[list[float]] = []  # [step, mean Q/K update ratio over layers] in the window
        self.peak_update: float | None = None  # the largest Q/K update ratio since half a window in (observe)

    def observe(self, obs: Observation) -> list[Alert]:
        ratios = [(float(m["update_ratio_q"][0]) + float(m["update_ratio_k"][0])) / 2 for m in obs.layers.values()
                  if "update_ratio_q" in m and "update_ratio_k" in m]
        if ratios:
            self.updates = [u for u in self.updates if u[0] > obs.step - self.cfg.plateau_window] + \
                [[float(obs.step), float(np.mean(ratios))]]
            # the largest update since half a window into the run: a run without warmup takes first steps as large
            # as its weights, which would make any later one small
            if obs.step >= self.cfg.plateau_window / 2:
                self.peak_update = max(self.peak_update or 0.0, float(np.mean(ratios)))
        # the mean loss of the steps since the previous sample where the Monitor measured it: a single batch's
        # loss at the default cadence scatters sqrt(10) times as much, and the moment's line is crossed by noise
        loss = obs.loss if obs.loss_mean is None else obs.loss_mean
        if loss is None or not math.isfinite(loss):
            return []
        self.start = obs.step if self.start is None else self.start
        ratios = [float(m["grad_ratio_qk_v"][0]) for m in obs.layers.values() if "grad_ratio_qk_v" in m]
        entropies = [float(np.mean(m["attn_entropy"])) for m in obs.layers.values() if "attn_entropy" in m]
        point = [float(obs.step), loss, float(np.mean(ratios)) if ratios else math.nan,
                 float(np.mean(entropies)) if entropies else math.nan, _log_sigma(obs),
                 _layer_signals(obs)]
        if self.plateau is not None:
            return self._moment(obs.step, point)
        self.losses = [p for p in self.losses if p[0] > obs.step - self.cfg.plateau_window] + [point]
        return self._plateau(obs.step)

    def _plateau(self, step: int) -> list[Alert]:
        window = self.cfg.plateau_window
        if len(self.losses) < MIN_POINTS or step - self.start < window - 1:  # a whole window seen, at any interval
            return []
        a, b, noise = fit_trend(self.losses)
        level = a + b * step
        mid = step - window / 2
        halves = ([p[1] for p in self.losses if p[0] <= mid], [p[1] for p in self.losses if p[0] > mid])
        first, second = (float(np.mean(h)) if h else math.nan for h in halves)
        # the window's halves (in steps): the loss fell by at most plateau_rel, and did not rise beyond what its
        # own noise explains (two standard errors of the difference of the halves' means): a rising loss is no
        # plateau
        rise_noise = 2.0 * noise * math.sqrt(sum(1.0 / max(len(h), 1) for h in halves))
        flat = first - second <= self.cfg.plateau_rel * first and second - first <= rise_noise
        stuck = stuck_layers(self.losses, self.cfg.plateau_qk_ratio, self.cfg.plateau_entropy_gap)
        (growth, motion) = _motion(self.losses, self.updates, set(stuck)) if stuck else (math.nan, math.nan)
        # what the alert claims is measured, or the test is switched off: a missing signal (no spectra, no update
        # ratio, no attention in the window) is missing, not a pass
        still = math.isinf(self.cfg.plateau_qk_motion) or motion <= self.cfg.plateau_qk_motion
        # ... and it did not grow much in all (a window over the run's first steps, whose update ratios are as
        # large as the weights, can show a query/key product grown 3-7x as a small motion per unit of them)
        settled = math.isinf(self.cfg.plateau_max_growth) or growth <= self.cfg.plateau_max_growth
        # ... and the optimizer still moves Q and K: a loss that went flat because the learning rate decayed
        # (a cosine schedule's tail, whose Q/K updates are a few percent of what they were) has stopped training,
        # it is not stuck (Hugging Face GPT-2 under warmup + cosine goes flat over its last steps, and its
        # NormSoftmax twin is no faster there)
        # The updates now, the latest sample's (at the default cadence they are sampled every 100 steps: a window's
        # mean would still average the steps before a cosine decay), against the largest sample since half a
        # window into the run (observe)
        update = self.updates[-1][1] if self.updates else math.nan
        moving = (self.cfg.plateau_min_update == 0 or not math.isfinite(update) or self.peak_update is None
                  or update >= self.cfg.plateau_min_update * self.peak_update)
        if not (flat and stuck and still and settled and moving):
            return []
        ratio = float(np.mean([r for r, _, _ in stuck.values()]))
        uniformity = min(u for _, u, _ in stuck.values())
        gap = max(g for _, _, g in stuck.values())
        # the plateau began where the loss came down into its band (a window flat to plateau_rel may still hold
        # the end of the fall before it); how fast it sinks is measured from there
        band = level * (1.0 + self.cfg.plateau_rel)
        since = int(next((p[0] for p in self.losses if p[1] <= band), self.losses[0][0]))
        on = [p for p in self.losses if p[0] >= since]
        self.plateau = {"since": since, "a": a, "b": b, "noise": noise, "ratio": _mean(self.losses, 2),
                        "entropy": _mean(self.losses, 3), "level": level}
        slope = fit_trend(on)[1] if len(on) >= MIN_POINTS else b
        sinking = -100.0 * slope / level if level > 0 else 0.0  # the fall per 100 steps, relative
        names = ", ".join(sorted(stuck))
        evidence = [f"Q/K gradients are {ratio:.2f}x of V's"]
        if math.isfinite(gap):
            evidence.append(f"every head's attention entropy is within {gap:.2f} nats of uniform's (at least "
                            f"{uniformity:.0%} of it: each query spreads over {math.exp(-gap):.0%} or more of the "
                            "keys it sees, as perplexity)")
        if math.isfinite(motion):
            evidence.append(f"sigma_1(Wq^T Wk) moved {motion:.2f} per unit of the Q/K updates (grew x{growth:.2f})")
        slow = (f" The loss still sinks {sinking:.1%} per 100 steps, as Eureka plateaus do before their moment; on "
                "a language model whose loss keeps falling steadily, read this as attention learning slowly."
                if sinking >= 0.005 else "")
        return [Alert(step, "eureka_plateau", "warning", "", (
            f"the loss has been on a plateau near {level:.4g} since step {since} (the mean losses of the halves of "
            f"the last {window} steps differ by {(first - second) / first:.1%}) while attention in {names} has not "
            f"learned where to look ({', '.join(evidence)}): the model may be stuck before a Eureka-moment.{slow} "
            f"What to do: {TODO}"),
            {"loss": level, "grad_ratio_qk_v": ratio, "noise": noise, "qk_sigma1_growth": growth,
             "qk_motion": motion,
             "attn_uniformity": uniformity, "attn_entropy_gap": gap, "loss_sink_per_100": sinking},
            "firing", since)]

    def _moment(self, step: int, point: list[float]) -> list[Alert]:
        p = self.plateau
        expected = p["a"] + p["b"] * step
        # the trend's own line and the depth line under the level the plateau was flagged at (a plateau saved
        # before it had a level takes the trend's value at the first step after the resume); the moment needs
        # the loss under both
        level = p.setdefault("level", expected)
        trend_drop = max(self.cfg.eureka_drop * abs(expected), self.cfg.eureka_noise * p["noise"])
        drop = max(trend_drop, expected - (1.0 - self.cfg.eureka_depth) * level)
        self.recent = [q for q in self.recent if q[0] > step - self.cfg.eureka_span] + [point[:4]]
        smoothed = float(np.median([q[1] for q in self.recent]))  # the same steps at any interval
        if smoothed > expected - drop:
            # one sample just over the line (nearer to it than to the trend) between two under it does not reset
            # the count (at a coarse cadence one noisy batch would otherwise push the moment a whole interval or
            # more later); a second one, or one back near the trend, does
            near = smoothed <= expected - 0.5 * drop
            self.gap = 1 if self.below and not self.gap and near else 0
            self.below = self.below if self.gap else []
            # the smoothed loss's own standard error: a median of n samples scatters ~1.25 sigma / sqrt(n)
            margin = REFIT_SE * 1.25 * p["noise"] / math.sqrt(len(self.recent))
            # on the plateau, not on its way down: neither the smoothed loss nor this sample (3 noise deviations:
            # the first samples of a drop, which the median still hides) is under the trend
            if smoothed >= expected - min(margin, 0.5 * trend_drop) and point[1] >= expected - 3.0 * p["noise"]:
                self.below, self.gap = [], 0  # back on the plateau
                self._refit(point)
            return []
        if self.gap:  # the pair across the gap: the sample before it and this one
            self.below = self.below[-1:]
        self.gap = 0
        self.below.append(point[:4])
        rising = math.isfinite(point[2]) and point[2] > p["ratio"]
        sharper = math.isfinite(point[3]) and point[3] < p["entropy"]
        unknown = not (math.isfinite(point[2]) or math.isfinite(point[3]))
        if len(self.below) < 2 or not (rising or sharper or unknown):
            return []
        since = int(self.below[0][0])
        duration = since - p["since"]
        self.plateau, self.below, self.gap, self.losses, self.start = None, [], 0, [], None
        self.recent = []
        deep = f", {1 - smoothed / level:.0%} under its level {level:.4g} when flagged" if level > 0 else ""
        values = {"loss": smoothed, "plateau": expected, "plateau_level": level,
                  "grad_ratio_qk_v": point[2], "attn_entropy": point[3]}
        return [Alert(step, "eureka_plateau", "info", "", f"resolved: the plateau ended at step {since} after "
                      f"{duration} steps", {"duration_steps": float(duration)}, "resolved", p["since"]),
                Alert(step, "eureka_moment", "info", "", (
                    f"Eureka-moment at step {since}: the loss left its plateau ({smoothed:.4g} over the last "
                    f"{self.cfg.eureka_span} steps against {expected:.4g} on the plateau's trend{deep}) while the Q/K "
                    f"gradient share rose or attention entropy fell. What to do: {ALERTS['eureka_moment'].todo}"),
                    values, "firing", since)]

    def _refit(self, point: list[float]) -> None:
        """Still on the plateau: the window rolls on and the trend follows it (a plateau may sink slowly);
        while the smoothed loss is more than ``REFIT_SE`` of its standard errors (at most half the trend's drop)
        under the trend, or the sample itself more than 3 noise deviations, no sample is added, and the noise
        never grows, so a slow drop cannot drag the trend along. (The noise measured when the plateau was
        flagged would keep the band wide enough for the trend to follow a gradual drop all the way down:
        held-out seed 26 would lose its moment; docs/alerts.md#eureka_plateau.)"""
        self.losses = [q for q in self.losses if q[0] > point[0] - self.cfg.plateau_window] + [point]
        a, b, noise = fit_trend(self.losses)
        noise = min(noise, self.plateau["noise"])  # a start of the drop in the window must not widen the band
        self.plateau.update(a=a, b=b, noise=noise, ratio=_mean(self.losses, 2), entropy=_mean(self.losses, 3))

    def state_dict(self) -> dict:
        # "loss_points" keeps its three fields, so that an older version still loads this state; the signals of
        # the plateau's entry tests have a key of their own
        return {"losses": [p[1] for p in self.losses], "loss_points": [[p[0], p[2], p[3]] for p in self.losses],
                "loss_signals": [[p[4], p[5]] for p in self.losses],
                "plateau": self.plateau, "below": self.below, "below_gap": self.gap,
                "loss_start": self.start,
                "recent": self.recent, "plateau_updates": self.updates, "plateau_peak_update": self.peak_update}

    def load_state_dict(self, state: dict) -> None:
        points = state.get("loss_points", [])  # format 1 has losses but no points: the window starts afresh
        # a state without "loss_signals", or with a layer-free second field: unknown, as if those signals had not
        # been sampled
        signals = state.get("loss_signals") or [[None, None]] * len(points)
        # a layer's signals saved without the entropy gap (two fields) have it unknown
        self.losses = [[p[0], loss, p[1], p[2], sig if isinstance(sig, dict) else None,
                        {k: ([float(x) for x in v] + [math.nan] * 3)[:3] for k, v in layers.items()}
                        if isinstance(layers, dict) else {}]
                       for loss, p, (sig, layers) in zip(state.get("losses", []), points, signals)]
        self.plateau = state.get("plateau") if isinstance(state.get("plateau"), dict) else None
        self.below = [list(p) for p in state.get("below", [])]
        self.gap = 1 if state.get("below_gap") == 1 and self.below else 0
        self.recent = [list(p) for p in state.get("recent", [])]
        self.start = state.get("loss_start", self.losses[0][0] if self.losses else None)
        self.updates = [list(u) for u in state.get("plateau_updates", [])]
        peak = state.get("plateau_peak_update")
        self.peak_update = float(peak) if isinstance(peak, (int, float)) else None
