"""Fit ``collapse_risk`` on the design runs and report it on others.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.risk fit RUNS_DIR      # writes diag/detectors/risk_model.json
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.risk report RUNS_DIR --set report [--figure docs/img/x.png]

The samples: every recorded run of the set that can collapse (the GPT and the ViT), replayed at the steps where
a Monitor with a closer look on would sample spectra and attention together (every 10 steps, every 2 in the
first 30), with the update ratios the default cadence measures (every 100 steps): the features
of :mod:`diag.detectors.risk` per head. The label of a head (layer) at step ``t``: its malignant episode, by the
one definition of the states (:mod:`evaluation.truth`), is established at a step in ``(t, t + horizon]``;
samples of a head (layer) already established are left out (the risk is of an onset).

``fit``: a logistic regression per head (standardised features, L2, scikit-learn), then a one-feature logistic
fit of the layer's label on its ``k``-th largest head logit (``k`` heads make a layer collapse). ``report``:
Brier score and its skill over two baselines fitted on the design runs (the base rate per learning rate, and
a configuration-only model: learning rate, warmup, QK-norm), calibration in bins, and per-run warning figures.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diag.detectors.base import Observation
from diag.detectors.config import RiskConfig, StatesConfig
from diag.detectors.risk import FEATURES, MODEL_FILE, HeadTrend, RiskModel, observe_features
from diag.detectors.states import head_key, layer_needs
from evaluation.seeds import SETS
from evaluation.truth import Run, load_runs, states

HORIZON = RiskConfig().risk_horizon


def fit_steps(step: int) -> bool:
    return step % 10 == 0 or (step < 30 and step % 2 == 0)


def updates_due(step: int) -> bool:
    """The steps whose update ratio the default cadence measures (hooks.monitor.cadence.DEFAULT_CADENCE)."""
    return step % 100 == 0


@dataclass
class Sample:
    run: str
    lr: float
    warmup: int
    twin: str
    label: str  # layer
    step: int
    x: np.ndarray  # (heads, features)
    head_y: np.ndarray  # (heads,) 1: established within the horizon; -1: already established (left out)
    layer_y: int  # 1, 0, or -1 (already established)
    k: int


def _onsets(run: Run, cfg: StatesConfig) -> tuple[dict[str, list[tuple[int, int | None]]], dict[str, list]]:
    heads, layers = defaultdict(list), defaultdict(list)
    for e in states(run, cfg):
        if e.state == "malignant":
            (heads if "/" in e.where else layers)[e.where].append((e.opened, e.until))
    return heads, layers


def _label(episodes: list[tuple[int, int | None]], t: int, horizon: int) -> int:
    for opened, until in episodes:
        if opened <= t and (until is None or until > t):
            return -1
        if t < opened <= t + horizon:
            return 1
    return 0


def samples_of(run: Run, cfg: RiskConfig | None = None, horizon: int = HORIZON) -> list[Sample]:
    cfg = cfg or RiskConfig()
    st = StatesConfig()
    heads, layers = _onsets(run, st)
    trends: dict[str, HeadTrend] = {}
    out = []
    for o in run.obs:
        updates = o.loss is None and all(k.startswith("update_") for m in o.layers.values() for k in m)
        if updates:
            if updates_due(o.step):
                observe_features(trends, o, cfg.risk_window, cfg.update_fresh)
            continue
        if not fit_steps(o.step):
            continue
        for label, x in observe_features(trends, Observation(o.step, o.loss, o.layers), cfg.risk_window,
                                         cfg.update_fresh).items():
            n = x.shape[0]
            head_y = np.array([_label(heads.get(head_key(label, h, n), []), o.step, horizon) for h in range(n)])
            out.append(Sample(run.name, run.spec.lr, run.spec.warmup, run.spec.twin, label, o.step, x, head_y,
                              _label(layers.get(label, []), o.step, horizon), layer_needs(n, st)))
    return out


def collapse_runs(root: Path, set_name: str) -> list[Run]:
    return [r for r in load_runs(root, SETS[set_name]) if r.spec.task in ("lm", "vit") and r.spec.steps <= 400]


def fit(samples: list[Sample], c: float = 1.0) -> RiskModel:
    from sklearn.linear_model import LogisticRegression

    xs = np.concatenate([s.x[s.head_y >= 0] for s in samples])
    ys = np.concatenate([s.head_y[s.head_y >= 0] for s in samples])
    mean, scale = xs.mean(0), xs.std(0)
    scale[scale == 0] = 1.0
    head = LogisticRegression(C=c, max_iter=2000).fit((xs - mean) / scale, ys)
    model = RiskModel(mean, scale, head.coef_[0], float(head.intercept_[0]), 1.0, 0.0, HORIZON)
    layer = [(float(np.sort(model.head_logits(s.x))[::-1][s.k - 1]), s.layer_y) for s in samples if s.layer_y >= 0]
    z = np.array([[v] for v, _ in layer])
    top = LogisticRegression(C=100.0, max_iter=2000).fit(z, np.array([y for _, y in layer]))
    model.layer_scale, model.layer_bias = float(top.coef_[0][0]), float(top.intercept_[0])
    return model


def brier(p: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((p - y) ** 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("fit", "explore"))
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", default="design")
    parser.add_argument("--out", type=Path, default=MODEL_FILE)
    args = parser.parse_args()
    runs = collapse_runs(args.runs, args.set)
    samples = [s for r in runs for s in samples_of(r)]
    print(f"{len(runs)} runs, {len(samples)} layer samples, "
          f"{sum(s.layer_y == 1 for s in samples)} layer positives, "
          f"{sum(int((s.head_y == 1).sum()) for s in samples)} head positives")
    model = fit(samples)
    model.fitted_on = f"{args.set} runs of evaluation/seeds.py ({len(runs)} runs)"
    for name, w in zip(FEATURES, model.weights):
        print(f"  {name:20s} {w:+.3f}")
    print(f"  layer: scale {model.layer_scale:.3f} bias {model.layer_bias:.3f}")
    if args.command == "fit":
        args.out.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
