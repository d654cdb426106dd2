"""The spectral step limit on the collapse reproduction: no warmup, warmup twin, step limit.

    .venv/bin/python -m evaluation.steplimit --seeds 0 1 2 --steps 300 --tau 0.004

For each seed, trains the demo GPT (``hooks.demo``: character-level, Python's
standard library source, AdamW lr 5e-3) three ways: without warmup (the collapse
setting), with a 100-step linear warmup (the healthy twin), and without warmup
but wrapped in :class:`hooks.SpectralStepLimit` for each ``--tau``. Prints one
table: final loss (mean of the last 50 steps), the alerts raised (counts by
kind, first ``malignant_collapse`` step), the per-layer mean effective learning
rate (lr x applied scale, averaged over all matrices of the layer and over the
sampled steps, as the Monitor logged it in ``step_limit_lr/L<layer>/mean``; for
the plain runs the schedule's mean lr) and the largest exact ratio
sigma_1(applied dW)/sigma_1(W_prev) over tau seen on the sampled steps (the
power iteration's honesty). About 40-80 s per run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from hooks.demo import DEFAULT_LR, DemoRun, Schedule, train


def first(alerts, kind: str) -> int | None:
    steps = [a.step for a in alerts if a.kind == kind]
    return min(steps) if steps else None


def read_metrics(logdir: Path) -> dict[str, list[float]]:
    series: dict[str, list[float]] = defaultdict(list)
    for line in (logdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        series[r["tag"]].append(math.nan if r["value"] is None else r["value"])
    return series


def run(seed: int, warmup: int, tau: float | None, steps: int, logdir: Path) -> dict:
    monitor, losses = train(DemoRun(logdir=logdir, steps=steps, seed=seed, warmup=warmup, step_limit=tau, quiet=True))
    alerts = monitor.alert_sink.history
    series = read_metrics(logdir)
    labels = [layer.label for layer in monitor.layers]
    if tau is None:
        schedule = Schedule(warmup)
        lr = [DEFAULT_LR * schedule(s) for s in range(steps)]
        layer_lr = {label: sum(lr) / len(lr) for label in labels}
        worst = None
    else:
        layer_lr = {label: _mean(series[f"step_limit_lr/{label}/mean"]) for label in labels}
        exact = [v for tag, vals in series.items() if tag.startswith("step_limit_ratio_exact/") for v in vals]
        worst = max(exact) / tau
    name = f"limit {tau:g}" if tau is not None else (f"warmup {warmup}" if warmup else "no warmup")
    return {"seed": seed, "run": name, "loss": sum(losses[-50:]) / len(losses[-50:]),
            "critical": first(alerts, "malignant_collapse"), "kinds": dict(Counter(a.kind for a in alerts)),
            "lr": layer_lr, "worst": worst}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def row(r: dict) -> str:
    lrs = " ".join(f"{label} {v:.1e}" for label, v in r["lr"].items())
    worst = "   -" if r["worst"] is None else f"{r['worst']:4.2f}"
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r["kinds"].items())) or "none"
    return (f"{r['seed']:>4}  {r['run']:<12} {r['loss']:6.3f}  {str(r['critical']):>8}  {worst}  "
            f"{lrs}  |  {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tau", type=float, nargs="+", default=[0.004])
    parser.add_argument("--no-baselines", action="store_true", help="only the step-limited runs")
    args = parser.parse_args()
    arms = [] if args.no_baselines else [(0, None), (100, None)]
    arms += [(0, tau) for tau in args.tau]
    print(f"{'seed':>4}  {'run':<12} {'loss':>6}  {'1st crit':>8}  {'r/tau':>4}  mean effective lr per layer  |"
          "  alerts by kind", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for warmup, tau in arms:
                print(row(run(seed, warmup, tau, args.steps, Path(tmp) / f"s{seed}-w{warmup}-t{tau}")), flush=True)


if __name__ == "__main__":
    main()
