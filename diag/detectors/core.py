"""Judgement: detectors as small state machines, and the channels alerts go out on.

Detectors read an :class:`Observation` (per-layer arrays of per-head values, the
loss) and return :class:`Alert` objects. They hold only plain Python state, so
``state_dict()``/``load_state_dict()`` carry them across a resumed run. The
thresholds and the reasoning behind each default are in ``docs/alerts.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from diag.errors import ConfigError, DiagError
from diag.outputs.sinks import FanOut, Record
from diag.outputs.tags import head_label

__all__ = [
    "Alert",
    "AlertConfig",
    "Observation",
    "Detectors",
    "AlertSink",
    "TrainingHalted",
    "attention_state",
]

log = logging.getLogger("diag")
LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


@dataclass(frozen=True)
class Alert:
    step: int
    kind: str  # e.g. "malignant_collapse", "collapse_warning", "eureka_plateau"
    level: str  # "info", "warning" or "critical"
    where: str  # "L03/H05", "L03" or "" for the whole model
    message: str
    values: dict[str, float] = field(default_factory=dict)


class TrainingHalted(DiagError):
    """Raised by ``Monitor.step`` on a critical alert when ``stop_on_critical=True``."""

    def __init__(self, alert: Alert) -> None:
        super().__init__(f"training stopped by diag at step {alert.step}: {alert.message}")
        self.alert = alert


@dataclass
class Observation:
    """One sampled step: ``layers[label][metric]`` is an array over heads (or of size 1)."""

    step: int
    loss: float | None
    layers: dict[str, dict[str, np.ndarray]]


@dataclass
class AlertConfig:
    """Detector thresholds; see docs/alerts.md for why each default is what it is."""

    sparse_entropy: float = 0.5  # nats: below, a query spreads its mass over ~1.6 keys or fewer
    low_rank_frac: float = 0.1  # attention effective rank below 10% of its rows is low-rank
    uniform_frac: float = 0.8  # entropy at 80% of uniform attention's over the same keys is "uniform"
    collapse_persist: int = 2  # consecutive samples in the malignant state -> critical
    sigma_growth: float = 4.0  # sigma_1 growing this many times per 10 steps (between samples) ...
    sec_warn: float = 0.5  # ... with SEC_s at or above this -> early warning
    tau_warn: float = 0.01  # ... or an update ratio sigma1(dW)/sigma1(W) above this
    plateau_window: int = 20  # samples of loss in the plateau test
    plateau_rel: float = 0.05  # relative change of the loss across the window
    plateau_qk_ratio: float = 0.4  # grad_ratio_qk_v below this during a plateau
    plateau_min_frac: float = 0.25  # a plateau sits at this fraction of the first sampled loss or above
    eureka_drop: float = 0.3  # a relative loss drop below the plateau level marks the moment
    spike_sigma: float = 6.0  # loss above EMA + spike_sigma * EMA std is a spike
    spike_warmup: int = 10  # samples before spikes are judged

    def __post_init__(self) -> None:
        for name in ("sparse_entropy", "low_rank_frac", "uniform_frac", "sigma_growth", "sec_warn", "tau_warn",
                     "plateau_rel", "plateau_qk_ratio", "plateau_min_frac", "eureka_drop", "spike_sigma"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"AlertConfig.{name}={getattr(self, name)!r}: expected a positive number")
        for name in ("collapse_persist", "plateau_window", "spike_warmup"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"AlertConfig.{name}={getattr(self, name)!r}: expected an integer >= 1")


def attention_state(
    entropy: float, rank: float, rows: float, cfg: AlertConfig, uniform_entropy: float = math.inf
) -> str:
    """The state of one head's attention.

    'malignant': sparse (entropy <= sparse_entropy) and low-rank (rank <= low_rank_frac * rows);
    'benign': sparse, not low-rank; 'uniform': low-rank with entropy >= uniform_frac of
    what uniform attention over the same keys would have; otherwise 'normal'.
    """
    sparse = entropy <= cfg.sparse_entropy
    low_rank = rank <= cfg.low_rank_frac * max(rows, 1.0)
    if sparse:
        return "malignant" if low_rank else "benign"
    return "uniform" if low_rank and entropy >= cfg.uniform_frac * uniform_entropy else "normal"


class Detectors:
    """All detectors in one state machine: collapse, plateau/Eureka, non-finite, spikes."""

    def __init__(self, cfg: AlertConfig | None = None) -> None:
        self.cfg = cfg or AlertConfig()
        self.sigma_prev: dict[str, tuple[int, list[float]]] = {}  # layer -> (step, sigma_1 per head)
        self.update_ratio: dict[str, float] = {}
        self.malignant_run: dict[str, int] = {}
        self.head_state: dict[str, str] = {}
        self.warned_layers: set[str] = set()
        self.losses: deque[float] = deque(maxlen=self.cfg.plateau_window)
        self.qk_ratios: deque[float] = deque(maxlen=self.cfg.plateau_window)
        self.plateau_level: float | None = None
        self.first_loss: float | None = None
        self.ema: float | None = None
        self.emvar = 0.0
        self.n_loss = 0
        self.nonfinite: set[str] = set()

    def state_dict(self) -> dict:
        state = {k: v for k, v in vars(self).items() if k != "cfg"}
        state["losses"], state["qk_ratios"] = list(self.losses), list(self.qk_ratios)
        state["warned_layers"], state["nonfinite"] = sorted(self.warned_layers), sorted(self.nonfinite)
        return json.loads(json.dumps(state))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.losses = deque(state["losses"], maxlen=self.cfg.plateau_window)
        self.qk_ratios = deque(state["qk_ratios"], maxlen=self.cfg.plateau_window)
        self.warned_layers, self.nonfinite = set(state["warned_layers"]), set(state["nonfinite"])

    def observe(self, obs: Observation) -> list[Alert]:
        alerts = self._nonfinite(obs)
        for label, metrics in obs.layers.items():
            alerts += self._collapse(obs.step, label, metrics)
        if obs.loss is not None and math.isfinite(obs.loss):
            alerts += self._spike(obs.step, obs.loss)
            alerts += self._plateau(obs.step, obs.loss, obs.layers)
        return alerts

    # ------------------------------------------------------------- collapse

    def _collapse(self, step: int, label: str, m: dict[str, np.ndarray]) -> list[Alert]:
        alerts = []
        ratios = [float(m[k][0]) for k in ("update_ratio_q", "update_ratio_k") if k in m]
        if ratios:
            self.update_ratio[label] = max(ratios)
        if "qk_sigma1" in m:
            previous = self.sigma_prev.get(label)
            self.sigma_prev[label] = (step, [float(v) for v in m["qk_sigma1"]])
            if previous is not None and step > previous[0]:
                alerts += self._early_warning(step, label, m, previous)
        if "attn_entropy" in m and "attn_rows" in m:
            rows = float(m["attn_rows"][0])
            uniform = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
            n = len(m["attn_entropy"])
            for h, (e, r) in enumerate(zip(m["attn_entropy"], m["attn_rank"])):
                where = f"{label}/{head_label(h, n)}"
                alerts += self._head_state(step, where, float(e), float(r), rows, uniform)
        return alerts

    def _early_warning(self, step: int, label: str, m: dict, previous: tuple[int, list[float]]) -> list[Alert]:
        """sigma_1 growth per 10 steps, (now / before) ** (10 / steps between the samples)."""
        if label in self.warned_layers:
            return []
        with np.errstate(all="ignore"):
            ratio = np.asarray(m["qk_sigma1"]) / np.maximum(np.asarray(previous[1]), 1e-12)
            growth = ratio ** (10.0 / (step - previous[0]))
        h = int(np.nanargmax(growth)) if np.isfinite(growth).any() else 0
        concentrated = float(m["qk_sec"][h]) >= self.cfg.sec_warn if "qk_sec" in m else False
        fast_steps = self.update_ratio.get(label, 0.0) >= self.cfg.tau_warn
        if growth[h] >= self.cfg.sigma_growth and (concentrated or fast_steps):
            self.warned_layers.add(label)
            values = {"sigma1_growth": float(growth[h]), "qk_sigma1": float(m["qk_sigma1"][h])}
            if "qk_sec" in m:
                values["qk_sec"] = float(m["qk_sec"][h])
            why = "a concentrated spectrum" if concentrated else "large update ratios in the layer"
            return [Alert(step, "collapse_warning", "warning", f"{label}/{head_label(h, len(growth))}",
                          f"{label} head {h}: sigma_1(Wq^T Wk) grows {growth[h]:.1f}x per 10 steps with {why}; "
                          "malignant entropy collapse may follow (consider warmup or a lower "
                          "learning rate)", values)]
        return []

    def _head_state(self, step: int, where: str, e: float, r: float, rows: float, uniform: float) -> list[Alert]:
        finite = math.isfinite(e) and math.isfinite(r)
        state = attention_state(e, r, rows, self.cfg, uniform) if finite else "normal"
        previous = self.head_state.get(where, "normal")
        self.head_state[where] = state
        run = self.malignant_run.get(where, 0) + 1 if state == "malignant" else 0
        self.malignant_run[where] = run
        values = {"attn_entropy": e, "attn_rank": r, "attn_rows": rows}
        if state == "malignant" and run == self.cfg.collapse_persist:
            return [Alert(step, "malignant_collapse", "critical", where,
                          f"{where}: malignant entropy collapse (attention sparse, entropy {e:.2f} nats, "
                          f"and low-rank, effective rank {r:.1f} of {rows:.0f} rows) for {run} samples", values)]
        if state in ("benign", "uniform") and previous != state:
            kind = "benign_collapse" if state == "benign" else "uniform_attention"
            return [Alert(step, kind, "info", where, f"{where}: attention is {state} "
                          f"(entropy {e:.2f} nats, effective rank {r:.1f} of {rows:.0f} rows)", values)]
        return []

    # ------------------------------------------------------- loss and values

    def _nonfinite(self, obs: Observation) -> list[Alert]:
        """Fires on entry into a non-finite state, per kind; only kinds this observation shows are judged."""
        seen: dict[str, bool] = {}
        if obs.loss is not None:
            seen["loss"] = not math.isfinite(obs.loss)
        for metrics in obs.layers.values():
            checks = (("weights", ("qk_sigma1",)), ("gradients", ("grad_norm_q", "grad_norm_k", "grad_norm_v")))
            for kind, keys in checks:
                if all(k in metrics for k in keys):
                    bad = not all(np.isfinite(metrics[k]).all() for k in keys)
                    seen[kind] = seen.get(kind, False) or bad
        new = sorted(k for k, bad in seen.items() if bad and k not in self.nonfinite)
        self.nonfinite = {k for k in self.nonfinite if k not in seen} | {k for k, bad in seen.items() if bad}
        return [Alert(obs.step, f"nonfinite_{what}", "critical", "", f"non-finite {what} at step {obs.step}")
                for what in new]

    def _spike(self, step: int, loss: float) -> list[Alert]:
        self.n_loss += 1
        if self.ema is None:
            self.ema = loss
            return []
        std = math.sqrt(self.emvar)
        mean = self.ema
        spike = self.n_loss > self.cfg.spike_warmup and loss > mean + self.cfg.spike_sigma * max(std, 1e-8)
        delta = loss - mean
        self.ema += 0.1 * delta
        self.emvar = 0.9 * (self.emvar + 0.1 * delta * delta)
        if spike:
            return [Alert(step, "loss_spike", "warning", "", f"loss spike at step {step}: {loss:.4g} "
                          f"against a running mean of {mean:.4g}", {"loss": loss, "running_mean": mean})]
        return []

    def _plateau(self, step: int, loss: float, layers: dict) -> list[Alert]:
        if self.first_loss is None:
            self.first_loss = loss
        self.losses.append(loss)
        ratios = [float(m["grad_ratio_qk_v"][0]) for m in layers.values() if "grad_ratio_qk_v" in m]
        if ratios:
            self.qk_ratios.append(float(np.mean(ratios)))
        if self.plateau_level is not None:
            if loss <= self.plateau_level * (1 - self.cfg.eureka_drop):
                level, self.plateau_level = self.plateau_level, None
                self.losses.clear()
                self.qk_ratios.clear()
                return [Alert(step, "eureka_moment", "info", "", f"Eureka-moment at step {step}: loss fell "
                              f"from a plateau at {level:.4g} to {loss:.4g}", {"loss": loss, "plateau": level})]
            return []
        n = self.cfg.plateau_window
        if len(self.losses) < n or len(self.qk_ratios) < n:
            return []
        first, second = np.mean(list(self.losses)[: n // 2]), np.mean(list(self.losses)[n // 2:])
        flat = abs(first - second) <= self.cfg.plateau_rel * abs(first)
        high = second >= self.cfg.plateau_min_frac * self.first_loss  # not a run that has converged
        ratio = float(np.mean(self.qk_ratios))
        if flat and high and ratio <= self.cfg.plateau_qk_ratio:
            self.plateau_level = float(second)
            return [Alert(step, "eureka_plateau", "warning", "", f"loss plateau at {second:.4g} over {n} "
                          f"samples while Q/K gradients are {ratio:.2f}x of V's: the model may be stuck "
                          "before a Eureka-moment", {"loss": float(second), "grad_ratio_qk_v": ratio})]
        return []


class AlertSink:
    """Sends alerts to TensorBoard (text + scalar per kind), the ``diag`` logger,
    ``alerts.jsonl``, a user callback, and optionally stops training."""

    def __init__(
        self,
        sinks: FanOut,
        path: Path | None,
        callback: Callable[[Alert], None] | None = None,
        stop_on_critical: bool = False,
    ) -> None:
        self.sinks, self.path, self.callback, self.stop = sinks, path, callback, stop_on_critical
        self.history: list[Alert] = []
        self._append_failed = False

    def emit(self, alerts: list[Alert]) -> None:
        if not alerts:
            return
        self.history += alerts
        record = Record(alerts[0].step)
        for a in alerts:
            tag = f"alerts/{a.kind}"
            record.scalars[tag] = record.scalars.get(tag, 0.0) + 1.0
            line = f"**{a.level}** {a.where} {a.message}".strip()
            record.texts[tag] = record.texts.get(tag, "") + line + "\n\n"
            log.log(LEVELS[a.level], "diag alert: %s", a.message)
        self.sinks.write(record)
        self._append_jsonl(alerts)
        self._call_back(alerts)
        critical = [a for a in alerts if a.level == "critical"]
        if self.stop and critical:
            self.sinks.flush()
            raise TrainingHalted(critical[0])

    def _append_jsonl(self, alerts: list[Alert]) -> None:
        if self.path is None:
            return
        # One os.write on an O_APPEND descriptor, no user-space buffer (as diag.outputs.sinks.JsonlSink):
        # a process killed at any moment leaves whole lines only.
        data = "".join(json.dumps(asdict(a)) + "\n" for a in alerts).encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
        except OSError as err:
            if not self._append_failed:  # reported once; the other channels go on
                self._append_failed = True
                log.error("diag: cannot append to %s (%s); alerts still go to the other channels", self.path, err)

    def _call_back(self, alerts: list[Alert]) -> None:
        if self.callback is None:
            return
        for a in alerts:
            try:
                self.callback(a)
            except Exception as err:  # noqa: BLE001 - a user callback must not kill training
                log.error("diag: on_alert callback raised %r for %s", err, a.kind)
