"""Before a collapse: a warning that predicts, and an honest note about large first updates.

``collapse_warning`` (per head, an episode): over the last ``warn_window`` steps the head's
``sigma_1(Wq^T Wk)`` grew by ``sigma_growth`` or more *while* its attention entropy and
attention rank both fell (by ``entropy_drop`` and ``rank_drop`` of their value at the
window's start), its largest attention logit reached ``logit_factor`` times the entropy of
uniform attention over the same keys (the mean ``ln(keys)``: logits that large can put a
row's mass on one key; attention-logit growth, Dehghani et al. 2023, which QK-norm bounds),
with a concentrated spectrum (``SEC >= sec_warn``) or large steps (update ratio
``>= tau_warn``), and the head is not yet malignant: Qi et al.'s loop (a large, concentrated
``Wq^T Wk`` making attention sparse and low-rank) seen under way, held for ``warn_persist``
samples (1 by default: tuned, docs/alerts.md#evaluation).
Growth of ``sigma_1`` alone is what every no-warmup run shows in its first steps.

``large_early_updates`` (info, once per run): in the first ``note_horizon`` steps an update
ratio ``sigma_1(dW)/sigma_1(W) >= note_ratio`` (about 60x the paper's tau of 0.004): the run has no, or a
short, warmup at this learning rate. A fact about the schedule, not a prediction.
"""

from __future__ import annotations

import math

import numpy as np

from diag.catalog.tags import head_label
from diag.detectors.base import Alert, Observation
from diag.detectors.collapse import group_by_layer
from diag.detectors.config import AlertConfig
from diag.detectors.episodes import Closed, Dwell, Episodes

__all__ = ["CollapseWarning", "EarlyUpdates"]

TODO = ("add or lengthen warmup, lower the learning rate, or bound the step (QK-norm, sigmaReparam, a spectral "
        "step limit); watch attn_entropy and attn_rank of this head")


# a warning in a run's first warn_window steps: near the collapse boundary such an early trend decides nothing yet
# (docs/alerts.md#does-a-runs-outcome-survive-another-rounding); how often one is followed by a collapse is
# measured in docs/alerts.md#collapse_warning
EARLY = ("This early in a run the trend can still turn around (how often: the docs section this alert links to); "
         "watch whether malignant_collapse follows. ")


class CollapseWarning:
    """Trend of sigma_1, entropy and rank per head over a window of steps (needs spectra and attention)."""

    def __init__(self, cfg: AlertConfig, malignant: Episodes | None = None) -> None:
        self.cfg = cfg
        self.malignant = malignant  # the attention states' malignant episodes: a malignant head is past warning
        self.episodes = Episodes(Dwell(cfg.warn_persist, cfg.collapse_dwell), Dwell(2, cfg.exit_dwell))
        self.trend: dict[str, list[list[float]]] = {}  # head -> [[step, sigma_1, entropy, rank], ...]
        self.update_ratio: dict[str, float] = {}  # layer -> last max(update_ratio_q, update_ratio_k)
        self.sigma_prev: dict[str, list] = {}  # layer -> [step, sigma_1 per head] of the previous sample
        self.sigma_trend: dict[str, list[list[float]]] = {}  # layer -> [[step, sigma_1 per head...], ...]
        self.watch: str | None = None  # why attention should be sampled closely now (wants_attention)

    def observe(self, obs: Observation) -> list[Alert]:
        alerts: list[Alert] = []
        for label, m in obs.layers.items():
            ratios = [float(m[k][0]) for k in ("update_ratio_q", "update_ratio_k") if k in m]
            if ratios:
                self.update_ratio[label] = max(ratios)
            if all(k in m for k in ("qk_sigma1", "attn_entropy", "attn_rank")):
                alerts += group_by_layer(label, self._layer(obs.step, label, m))
            if "qk_sigma1" in m:
                self.sigma_prev[label] = [obs.step, [float(v) for v in m["qk_sigma1"]]]
                trend = [p for p in self.sigma_trend.get(label, []) if p[0] >= obs.step - self.cfg.warn_window]
                self.sigma_trend[label] = trend + [[float(obs.step), *self.sigma_prev[label][1]]]
        if any("qk_sigma1" in m or "attn_entropy" in m for m in obs.layers.values()):
            self.watch = self._watch_reason()
        return alerts

    def wants_attention(self) -> str | None:
        """Why attention should be sampled at the spectra's cadence now, or None: a head's sigma_1 grew by
        ``watch_growth`` within ``warn_window`` steps, or a collapse warning or a malignant state is open or
        being confirmed on some head. The Monitor's default cadence reads attention every 100 steps
        otherwise; this makes the warning and the collapse alert arrive within tens of steps."""
        return self.watch

    def _watch_reason(self) -> str | None:
        best = None
        for label, trend in self.sigma_trend.items():
            first, last = trend[0], trend[-1]
            for h, (a, b) in enumerate(zip(first[1:], last[1:])):
                growth = b / a if a > 0 and math.isfinite(a) and math.isfinite(b) else 0.0
                if growth >= self.cfg.watch_growth and (best is None or growth > best[0]):
                    best = (growth, f"{label}/{head_label(h, len(first) - 1)}", int(last[0] - first[0]))
        if best is not None:
            return f"sigma_1(Wq^T Wk) of {best[1]} grew x{best[0]:.1f} in {best[2]} steps"
        warned = [k for k in self.episodes.keys if self.episodes.since(k) is not None]
        if warned:
            return f"a collapse warning is open or being confirmed on {warned[0]}"
        candidates = [] if self.malignant is None else [
            k for k in self.malignant.keys if self.malignant.since(k) is not None and not self.malignant.active(k)]
        if candidates:  # an established malignant episode is not watched closely for ever
            return f"a malignant state is being confirmed on {candidates[0]}"
        return None

    def _layer(self, step: int, label: str, m: dict[str, np.ndarray]) -> list[Alert]:
        out = []
        n = len(m["qk_sigma1"])
        sec = m["qk_sec"] if "qk_sec" in m else np.full(n, math.nan)
        fast = self.update_ratio.get(label, 0.0) >= self.cfg.tau_warn
        for h in range(n):
            where = f"{label}/{head_label(h, n)}"
            point = [float(step), float(m["qk_sigma1"][h]), float(m["attn_entropy"][h]), float(m["attn_rank"][h])]
            history = [p for p in self.trend.get(where, []) if p[0] >= step - self.cfg.warn_window] + [point]
            self.trend[where] = history
            inside, outside, values = self._tests(history, float(sec[h]) >= self.cfg.sec_warn or fast)
            if inside and "attn_max_logit" in m and "attn_entropy_uniform" in m:
                logit = float(m["attn_max_logit"][h])
                line = self.cfg.logit_factor * float(m["attn_entropy_uniform"][0])
                values["attn_max_logit"] = logit
                inside = math.isfinite(logit) and logit >= line
            if self.malignant is not None and self.malignant.active(where):
                inside, outside = False, True
            event = self.episodes.update(where, step, inside, outside)
            if isinstance(event, Closed):
                out.append(Alert(step, "collapse_warning", "info", where, f"resolved: the trend towards collapse "
                                 f"stopped or became a collapse at step {event.until}, after {event.duration} steps",
                                 {"duration_steps": float(event.duration)}, "resolved", event.since))
            elif event is not None:
                span = int(step - history[0][0])
                previous = self.sigma_prev.get(label)
                if previous is not None and previous[1][h] > 0:  # the last interval alone, as measured
                    values["sigma1_growth_last"] = point[1] / previous[1][h]
                if values.pop("near", 0.0):  # the late phase: say how close the head already is
                    what = (f"its attention entropy is down to {values['attn_entropy']:.2f} nats (rank "
                            f"{values['attn_rank']:.1f}) while sigma_1(Wq^T Wk) still grew "
                            f"x{values['sigma1_growth']:.1f} over the last {span} steps")
                else:
                    what = (f"over the last {span} steps sigma_1(Wq^T Wk) grew x{values['sigma1_growth']:.1f} while "
                            f"attention entropy fell {values['entropy_drop']:.0%} and attention rank "
                            f"{values['rank_drop']:.0%}")
                out.append(Alert(step, "collapse_warning", "warning", where, (
                    f"towards malignant collapse since step {event.since}: {what}"
                    + (f", its largest logit at {values['attn_max_logit']:.1f}" if "attn_max_logit" in values else "")
                    + ". " + (EARLY if step <= self.cfg.warn_window else "") +
                    f"What to do: {TODO}"), values, "firing", event.since))
        return out

    def _tests(self, history: list[list[float]], concentrated: bool) -> tuple[bool, bool, dict[str, float]]:
        (s0, sigma0, e0, r0), (s1, sigma1, e1, r1) = history[0], history[-1]
        if not all(math.isfinite(x) and x > 0 for x in (sigma0, sigma1, e0, r0)) or not math.isfinite(e1 + r1):
            return False, False, {}
        values = {"sigma1_growth": sigma1 / sigma0, "entropy_drop": 1.0 - e1 / e0, "rank_drop": 1.0 - r1 / r0,
                  "qk_sigma1": sigma1, "attn_entropy": e1, "attn_rank": r1}
        covered = s1 - s0 >= 0.5 * self.cfg.warn_window
        falling = values["entropy_drop"] >= self.cfg.entropy_drop and values["rank_drop"] >= self.cfg.rank_drop
        # a trend of three samples counts before the window is half covered: a run's first steps can collapse
        # a head within ten steps (the closer look samples them every 2 steps, hooks.monitor.cadence.CloserLook)
        fast = (covered or len(history) >= 3) and falling and values["sigma1_growth"] >= self.cfg.sigma_growth
        # the loop's late phase: a head already near the sparse line whose sigma_1 still grows
        near = covered and e1 <= self.cfg.near_entropy and values["sigma1_growth"] >= self.cfg.near_growth
        inside = concentrated and (fast or near)
        if inside and not fast:
            values["near"] = 1.0
        f = self.cfg.exit_factor  # hysteresis: the trend is over when neither test holds beyond its line
        outside = covered and (values["entropy_drop"] < self.cfg.entropy_drop / f
                               or values["rank_drop"] < self.cfg.rank_drop / f) and e1 > self.cfg.near_entropy * f
        return inside, outside, values

    def state_dict(self) -> dict:
        return {"warning_episodes": self.episodes.state_dict(), "trend": self.trend,
                "update_ratio": dict(self.update_ratio), "sigma_prev": dict(self.sigma_prev),
                "sigma_trend": self.sigma_trend}

    def load_state_dict(self, state: dict) -> None:
        self.episodes.load_state_dict(state.get("warning_episodes", {}))
        self.trend = {k: [list(p) for p in v] for k, v in state.get("trend", {}).items()}
        self.update_ratio = dict(state.get("update_ratio", {}))
        self.sigma_prev = {k: list(v) for k, v in state.get("sigma_prev", {}).items()}
        self.sigma_trend = {k: [list(p) for p in v] for k, v in state.get("sigma_trend", {}).items()}
        self.watch = self._watch_reason()


class EarlyUpdates:
    """The info note: large update ratios in the first steps (needs the ``updates`` signal)."""

    def __init__(self, cfg: AlertConfig) -> None:
        self.cfg = cfg
        self.noted = False
        self.step = -1  # the last step observed

    def wants_attention(self) -> str | None:
        """Within the first ``note_horizon`` steps of a run noted for large first updates: such runs are the
        ones whose heads collapse in tens of steps, so the Monitor samples their attention closely."""
        if self.noted and self.step <= self.cfg.note_horizon:
            return "the first updates are large (no or a short warmup)"
        return None

    def observe(self, obs: Observation) -> list[Alert]:
        self.step = max(self.step, obs.step)
        if self.noted or obs.step > self.cfg.note_horizon:
            return []
        ratios = [(float(m[k][0]), label) for label, m in obs.layers.items()
                  for k in ("update_ratio_q", "update_ratio_k") if k in m and math.isfinite(float(m[k][0]))]
        if not ratios or max(ratios)[0] < self.cfg.note_ratio:
            return []
        self.noted = True
        ratio, label = max(ratios)
        return [Alert(obs.step, "large_early_updates", "info", "", (
            f"the update of step {obs.step} is large next to the weights: sigma_1(dW)/sigma_1(W) = {ratio:.3g} in "
            f"{label} (Qi et al. bound it at tau = 0.004). This is what a run without (or with a short) warmup "
            "looks like at this learning rate; it does not predict a collapse by itself. What to do: nothing "
            "if the run is meant to have no warmup; collapse_warning says when a head is heading for collapse"),
            {"update_ratio": ratio}, "firing", obs.step)]

    def state_dict(self) -> dict:
        return {"noted_early_updates": self.noted, "early_updates_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.noted = bool(state.get("noted_early_updates", False))
        self.step = int(state.get("early_updates_step", -1))
