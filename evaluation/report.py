"""The tables and the figure of docs/alerts.md#evaluation, from the recorded runs of one set, in one command.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.report RUNS_DIR --set report \\
        --figure docs/img/collapse_risk_calibration.png

Prints, in markdown: the collapse runs at every cadence (critical records against the established collapses,
``collapse_warning`` against them, leads); the twin test (damage against the QK-norm twin, and whether an alert
came before it); ``collapse_risk``'s Brier score and skill over two baselines, and its calibration in bins with
90% intervals (the runs resampled, and beside it the interval that counts forecasts as independent);
``collapse_warning`` away from the boundary learning rate; the Eureka runs; the healthy runs with the
NormSoftmax twin's verdict on each plateau alert. A run counts once in each figure (per cadence where the
figure is per cadence). Nothing here tunes anything: the thresholds are AlertConfig's defaults.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from diag.detectors import AlertConfig
from evaluation import detectors as judge
from evaluation.forecasts import Forecast, brier, forecasts
from evaluation.seeds import BOUNDARY_LR, SETS
from evaluation.truth import load_runs

BINS = ((0.0, 0.2), (0.2, 0.8), (0.8, 1.0000001))


def lr_base_rate(fs: list[Forecast]) -> np.ndarray:
    """The frequency of the outcome among the forecasts of the same task and learning rate (the set's own
    climatology: the baseline knows the outcome rate of every learning rate exactly)."""
    groups: dict[tuple, list[int]] = {}
    for f in fs:
        groups.setdefault((f.task, f.lr, f.warmup, f.twin), []).append(f.y)
    rate = {k: float(np.mean(v)) for k, v in groups.items()}
    return np.array([rate[(f.task, f.lr, f.warmup, f.twin)] for f in fs])


def config_model(train: list[Forecast]):
    """A logistic model of the outcome on the configuration alone: ln lr, warmup, QK-norm, ln(step + 1)."""
    from sklearn.linear_model import LogisticRegression

    def x(fs):
        return np.array([[math.log(f.lr), float(f.warmup > 0), float(f.twin == "qknorm"), math.log(f.step + 1)]
                         for f in fs])

    model = LogisticRegression(C=1.0, max_iter=1000).fit(x(train), np.array([f.y for f in train]))
    return lambda fs: model.predict_proba(x(fs))[:, 1]


def interval90(k: int, n: int) -> tuple[float, float]:
    """The Jeffreys 90% interval of a frequency k / n."""
    from scipy.stats import beta

    if n == 0:
        return (math.nan, math.nan)
    lo = 0.0 if k == 0 else float(beta.ppf(0.05, k + 0.5, n - k + 0.5))
    hi = 1.0 if k == n else float(beta.ppf(0.95, k + 0.5, n - k + 0.5))
    return lo, hi


def run_interval90(fs: list[Forecast], mask: np.ndarray, draws: int = 2000) -> tuple[float, float]:
    """The 90% interval of a bin's observed frequency with the run as the unit: the runs are resampled with
    replacement (a percentile bootstrap, seeded). A run's forecasts at consecutive steps share its fate, so
    treating its few hundred forecasts as independent trials (``interval90``) makes the interval far too
    narrow: the set holds some fifty runs, not ten thousand coin flips."""
    runs = sorted({f.run for f in fs})
    index = {r: i for i, r in enumerate(runs)}
    which = np.array([index[f.run] for f in fs])
    y = np.array([f.y for f in fs], float)
    k = np.bincount(which[mask], weights=y[mask], minlength=len(runs))
    n = np.bincount(which[mask], minlength=len(runs)).astype(float)
    if n.sum() == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(runs), size=(draws, len(runs)))
    kk, nn = k[picks].sum(1), n[picks].sum(1)
    freq = kk[nn > 0] / nn[nn > 0]
    return float(np.quantile(freq, 0.05)), float(np.quantile(freq, 0.95))


def risk_tables(fs: list[Forecast], design: list[Forecast], fitted_on: str = "design") -> list[str]:
    p, y = np.array([f.p for f in fs]), np.array([f.y for f in fs], float)
    b = brier(p, y)
    base = brier(lr_base_rate(fs), y)
    fitted = bool(design) and len({f.y for f in design}) == 2
    cfg_p = config_model(design)(fs) if fitted else np.full(len(fs), y.mean())
    conf = brier(cfg_p, y)
    config_row = (f"configuration only (ln lr, warmup, QK-norm, ln step; fitted on the {fitted_on} runs)" if fitted
                  else "configuration only: not fitted (no design or tuning GPT runs recorded under RUNS, or none "
                       "collapsed); this set's overall frequency instead")
    out = [f"{len(fs)} forecasts on {len({f.run for f in fs})} runs, {int(y.sum())} followed by a collapse within "
           "the horizon.", "",
           "| forecast | Brier score | skill of collapse_risk over it |", "|---|---|---|",
           f"| collapse_risk | {b:.4f} | - |",
           f"| the learning rate's base rate (this set's own frequency per setting) | {base:.4f} | "
           f"{1 - b / base:.3f} |" if base > 0 else "| base rate | 0 | - |",
           f"| {config_row} | {conf:.4f} | {1 - b / conf:.3f} |" if conf > 0 else "| configuration | 0 | - |", "",
           "| predicted | forecasts (runs) | mean predicted | observed frequency | its 90% interval, runs "
           "resampled | inside | the interval counting forecasts as independent | inside |",
           "|---|---|---|---|---|---|---|---|"]
    for lo, hi in BINS:
        mask = (p >= lo) & (p < hi)
        n, k = int(mask.sum()), int(y[mask].sum())
        a, c = interval90(k, n)
        ra, rc = run_interval90(fs, mask)
        mean = float(p[mask].mean()) if n else math.nan
        inside = "-" if not n else "yes" if a <= mean <= c else "no"
        run_inside = "-" if not n else "yes" if ra <= mean <= rc else "no"
        nruns = len({f.run for f, m in zip(fs, mask) if m})
        out.append(f"| [{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'} | {n} ({nruns}) | {mean:.3f} | "
                   f"{k / n if n else math.nan:.3f} | {ra:.3f}-{rc:.3f} | {run_inside} | {a:.3f}-{c:.3f} | "
                   f"{inside} |")
    return out


def figure(fs: list[Forecast], path: Path) -> None:
    """Predicted against observed in ten bins, with the 90% intervals (runs resampled) and the count per bin."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p, y = np.array([f.p for f in fs]), np.array([f.y for f in fs], float)
    edges = np.linspace(0, 1, 11)
    fig = Figure(figsize=(5.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="#888888", lw=1, ls="--", label="perfect calibration")
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (p >= lo) & (p < hi if hi < 1 else p <= hi)
        n = int(mask.sum())
        if not n:
            continue
        k = int(y[mask].sum())
        a, c = run_interval90(fs, mask)
        x = float(p[mask].mean())
        ax.errorbar(x, k / n, yerr=[[max(0.0, k / n - a)], [max(0.0, c - k / n)]], fmt="o", color="#1f77b4", capsize=3)
        ax.annotate(str(n), (x, k / n), textcoords="offset points", xytext=(6, -10), fontsize=7)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="collapse_risk (mean in the bin)",
           ylabel="observed frequency of a collapse within 50 steps",
           title="collapse_risk on the report runs\n(90% intervals, runs resampled; forecasts per bin)")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def warning_table(rows: list[dict]) -> list[str]:
    """collapse_warning away from the boundary learning rate, at the default cadence: per run."""
    rs = [r for r in rows if r["kind"] == "collapse" and r["every"] == "default" and r["lr"] != BOUNDARY_LR]
    est = [r for r in rs if r["onset"] is not None]
    none = [r for r in rs if r["onset"] is None]
    warned = [r for r in est if r["warned"]]
    leads = sorted(r["lead"] for r in warned)
    return ["| runs | collapses | caught before the onset | false alarms (runs without a layer collapse) | "
            "warnings leading by 5 steps or more | leads (steps) |", "|---|---|---|---|---|---|",
            f"| {len(rs)} | {len(est)} | {len(warned)}/{len(est)} | "
            f"{sum(r['false_warning'] for r in none)}/{len(none)} | "
            f"{sum(r['lead'] >= 5 for r in warned)}/{len(warned)} | "
            f"{'-' if not leads else f'{leads[0]}-{leads[-1]} (median {leads[len(leads) // 2]})'} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", default="report", choices=sorted(SETS))
    parser.add_argument("--figure", type=Path, help="write the calibration figure here")
    args = parser.parse_args()
    runs = load_runs(args.runs, SETS[args.set])
    # the configuration-only baseline is fitted on the design runs of the GPT, or where those are not recorded
    # under RUNS on the tuning set's (never on the set reported)
    design = [r for r in load_runs(args.runs, SETS["design"]) if r.spec.task == "lm"]
    baseline = "design"
    if not design and args.set not in ("design", "tuning"):
        design, baseline = [r for r in load_runs(args.runs, SETS["tuning"]) if r.spec.task == "lm"], "tuning"
    print(f"{args.set}: {len(runs)} runs of {len(SETS[args.set])} planned\n")
    rows = judge.rows_of(runs, AlertConfig())
    for title, table in (("Collapse runs", judge.collapse_table), ("The twin test", judge.damage_table),
                         ("collapse_warning away from the boundary", warning_table),
                         ("Eureka runs", judge.eureka_table), ("Eureka runs one by one", judge.eureka_runs_table),
                         ("Healthy runs", judge.healthy_table),
                         ("Collapse runs one by one", judge.runs_table)):
        print(f"### {title}\n\n" + "\n".join(table(rows)) + "\n")
    print("### The plateau's signals on the Eureka runs\n\n" + "\n".join(judge.plateau_signals_table(runs)) + "\n")
    collapsing = [r for r in runs if r.spec.task in ("lm", "vit") and r.spec.steps <= 400]
    fs = [f for r in collapsing for f in forecasts(r)]
    design_fs = [f for r in design if r.spec.task in ("lm", "vit") and r.spec.steps <= 400 for f in forecasts(r)]
    print("### collapse_risk\n\n" + "\n".join(risk_tables(fs, design_fs, baseline)) + "\n")
    if args.figure:
        figure(fs, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
