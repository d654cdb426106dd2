"""Fit ``collapse_risk`` on the design runs and report it on others.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.risk fit RUNS_DIR      # writes diag/detectors/risk_model.json
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.risk calibrate RUNS_DIR --set tuning   # rewrites the mapping
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.report RUNS_DIR --set report   # the report (evaluation.report)

The samples: every recorded run of the set that can collapse (the GPT and the ViT), replayed at the steps where
a Monitor with a closer look on would sample spectra and attention together (every 10 steps, every 2 in the
first 30), with the update ratios the default cadence measures (every 100 steps): the features
of :mod:`diag.detectors.risk` per head. The label of a head (layer) at step ``t``: its malignant episode, by the
ground truth's states (:mod:`evaluation.truth`), is established at a step in ``(t, t + horizon]``;
samples of a head (layer) already established are left out (the risk is of an onset).

``fit``: a logistic regression per head (standardised features, L2 with C = 0.1, scikit-learn), then a
one-feature logistic fit of the layer's label on its ``k``-th largest head logit (``k`` heads make a layer
collapse), cross-fitted by seed; samples at the closer look's steps and at the default cadence's.
``calibrate``: an isotonic recalibration of the layer's probability on the forecasts the Monitor logs on the
tuning runs (:func:`calibrate`).
``report``:
Brier score and its skill over two baselines fitted on the design runs (the base rate per learning rate, and
a configuration-only model: learning rate, warmup, QK-norm) and calibration in bins.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diag.detectors.base import Observation
from diag.detectors.config import RiskConfig, StatesConfig
from diag.detectors.risk import FEATURES, MODEL_FILE, HeadTrend, RiskModel, layer_logit, observe_features
from diag.detectors.states import head_key, layer_needs
from evaluation.forecasts import forecasts, outcome_at
from evaluation.seeds import SETS
from evaluation.truth import Run, load_runs, malignant_episodes

HORIZON = RiskConfig().risk_horizon


def dense_steps(step: int) -> bool:
    """Where a closer look samples spectra and attention together: every 10 steps, every 2 in the first 30."""
    return step % 10 == 0 or (step < 30 and step % 2 == 0)


def sparse_steps(step: int) -> bool:
    """Where the default cadence samples them together without a closer look: every 100 steps (attention every
    50, the spectra every 20 in between feed the trends)."""
    return step % 20 == 0


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


def samples_of(run: Run, cfg: RiskConfig | None = None, horizon: int = HORIZON, dense: bool = True) -> list[Sample]:
    """The samples of one run: ``dense``, where a closer look samples (every 10 steps, every 2 in the first 30);
    else where the default cadence alone samples (attention every 50 steps, spectra every 20)."""
    cfg = cfg or RiskConfig()
    st = StatesConfig()
    heads, layers = malignant_episodes(run)
    trends: dict[str, HeadTrend] = {}
    due = dense_steps if dense else sparse_steps
    out = []
    for o in run.obs:
        updates = o.loss is None and all(k.startswith("update_") for m in o.layers.values() for k in m)
        if updates:
            if updates_due(o.step):
                observe_features(trends, o, cfg.risk_window, cfg.update_fresh)
            continue
        if not due(o.step):
            continue
        layers_now = o.layers if dense or o.step % 50 == 0 else {
            label: {k: v for k, v in m.items() if not k.startswith("attn_")} for label, m in o.layers.items()}
        for label, x in observe_features(trends, Observation(o.step, o.loss, layers_now), cfg.risk_window,
                                         cfg.update_fresh).items():
            n = x.shape[0]
            head_y = np.array([outcome_at(heads.get(head_key(label, h, n), []), o.step, horizon) for h in range(n)])
            out.append(Sample(run.name, run.spec.lr, run.spec.warmup, run.spec.twin, label, o.step, x, head_y,
                              outcome_at(layers.get(label, []), o.step, horizon), layer_needs(n, st)))
    return out


def collapse_runs(root: Path, set_name: str) -> list[Run]:
    return [r for r in load_runs(root, SETS[set_name]) if r.spec.task in ("lm", "vit") and r.spec.steps <= 400]


def _head_model(samples: list[Sample], c: float) -> RiskModel:
    from sklearn.linear_model import LogisticRegression

    xs = np.concatenate([s.x[s.head_y >= 0] for s in samples])
    ys = np.concatenate([s.head_y[s.head_y >= 0] for s in samples])
    mean, scale = xs.mean(0), xs.std(0)
    scale[scale == 0] = 1.0
    head = LogisticRegression(C=c, max_iter=3000).fit((xs - mean) / scale, ys)
    return RiskModel(mean, scale, head.coef_[0], float(head.intercept_[0]), 1.0, 0.0, HORIZON)


def _kth_logit(model: RiskModel, s: Sample) -> float | None:
    """The layer's deciding head logit (:func:`layer_logit`: heads already established count as collapsed)."""
    return layer_logit(model.head_logits(s.x), s.k, s.head_y == -1)


def fit(samples: list[Sample], c: float = 0.1) -> RiskModel:
    """The head model on every sample; the layer's mapping from its k-th head logit fitted on logits each made
    by a head model that did not see that run's seed (cross-fitting: in-sample logits are overconfident, and
    the mapping would pass that on)."""
    from sklearn.linear_model import LogisticRegression

    model = _head_model(samples, c)
    seed_of = {s.run: s.run.rsplit("-s", 1)[1] for s in samples}
    z, y = [], []
    for seed in sorted(set(seed_of.values())):
        other = _head_model([s for s in samples if seed_of[s.run] != seed], c)
        for s in samples:
            logit = _kth_logit(other, s) if seed_of[s.run] == seed and s.layer_y >= 0 else None
            if logit is not None:
                z.append(logit)
                y.append(s.layer_y)
    top = LogisticRegression(C=100.0, max_iter=2000).fit(np.array(z)[:, None], np.array(y))
    model.layer_scale, model.layer_bias = float(top.coef_[0][0]), float(top.intercept_[0])
    return model


def calibrate(runs: list[Run], model: RiskModel) -> int:
    """Recalibrate the layer's probability on the forecasts a Monitor at its default cadence logs on ``runs``
    (the tuning set's): :func:`recalibrate`. The fit samples a closer look's steps; the Monitor forecasts where
    its cadence and its closer look sample, which weighs the samples differently: without the recalibration,
    forecasts of 0.2-0.8 under-forecast and those of 0.8-1 are over-confident on held-out runs, a
    miscalibration no single slope and intercept mends (a Platt fit on the tuning runs moves one bin into its
    interval and the other out). Returns the number of forecasts."""
    model.calibration = []
    fs = [f for r in runs for f in forecasts(r)]
    recalibrate(model, np.array([f.p for f in fs]), np.array([f.y for f in fs]))
    return len(fs)


def recalibrate(model: RiskModel, p: np.ndarray, y: np.ndarray, knots: int = 41) -> None:
    """Isotonic regression of the outcomes ``y`` on the forecasts ``p`` (scikit-learn's, monotone, clipped at
    the ends), stored in ``model.calibration`` at ``knots`` points over [0, 1] (interpolated in between)."""
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(np.asarray(p, float), np.asarray(y))
    xs = np.linspace(0.0, 1.0, knots)
    model.calibration = [xs.tolist(), [float(v) for v in iso.predict(xs)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("fit", "calibrate", "explore"))
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", nargs="+", default=["design"],
                        help="the sets whose runs are fitted on (calibrate: e.g. tuning report2)")
    parser.add_argument("--out", type=Path, default=MODEL_FILE)
    args = parser.parse_args()
    runs = [r for name in args.set for r in collapse_runs(args.runs, name)]
    sets = " and ".join(args.set)
    if args.command == "calibrate":
        model = RiskModel.shipped()
        model.calibration = []
        args.out.write_text(json.dumps(model.to_dict(), indent=1) + "\n")  # the forecasts before any calibration
        n = calibrate(runs, model)
        model.calibrated_on = f"the {sets} runs of evaluation/seeds.py ({len(runs)} runs, {n} forecasts)"
        print(f"{model.calibrated_on}: " + ", ".join(f"{x:.2f} -> {v:.3f}" for x, v in zip(*model.calibration)
                                                     if round(x * 40) % 4 == 0))
        args.out.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    samples = [s for r in runs for dense in (True, False) for s in samples_of(r, dense=dense)]
    print(f"{len(runs)} runs, {len(samples)} layer samples, "
          f"{sum(s.layer_y == 1 for s in samples)} layer positives, "
          f"{sum(int((s.head_y == 1).sum()) for s in samples)} head positives")
    model = fit(samples)
    model.fitted_on = f"the {sets} runs of evaluation/seeds.py ({len(runs)} runs)"
    for name, w in zip(FEATURES, model.weights):
        print(f"  {name:20s} {w:+.3f}")
    print(f"  layer: scale {model.layer_scale:.3f} bias {model.layer_bias:.3f}")
    if args.command == "fit":
        args.out.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
