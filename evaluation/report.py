"""The one replay of a frozen set: its judged rows, its headlines and every table, written beside its manifest.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.report RUNS_DIR --set SET \\
        --figure docs/img/collapse_risk_calibration_SET.png

Replays a set frozen and sealed by :mod:`evaluation.freeze` (and refuses any other: one not sealed, one whose
detectors' source differs from the frozen one, one whose records changed since the seal, one replayed already).
Writes ``evaluation/frozen/SET/judged.json`` (per run: every goal's verdict with the evidence, its judged row at
every cadence: onsets, records, damage) and ``evaluation/frozen/SET/report.md``, which it also
prints: the headlines (:mod:`evaluation.headlines`: each run counted once, 95% Wilson intervals), the collapse
runs at every cadence (each layer's record against its own onset, evaluation.matching), the twin test, the
false records per run and layer, the Eureka runs, the healthy runs with the NormSoftmax twin's verdict on each
plateau alert, and ``collapse_risk``'s Brier score, its skill over two baselines and its calibration in bins with
90% intervals (the runs resampled, and beside it the interval that counts forecasts as independent). Nothing
here tunes anything: the thresholds are AlertConfig's defaults.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from diag.detectors import AlertConfig
from evaluation import detectors as judge
from evaluation import tables
from evaluation.forecasts import Forecast, brier, forecasts
from evaluation.freeze import FROZEN, Refused, replayable, write_json
from evaluation.headlines import headline_table, verdicts
from evaluation.provenance import ROOT, head, now
from evaluation.seeds import SETS
from evaluation.spec import RunSpec
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


def judged_runs(rows: list[dict]) -> dict[str, dict]:
    """Per run: its kind, every goal's verdict, and the evidence (its judged row at every cadence)."""
    by_run: dict[str, dict] = {}
    for r in rows:
        by_run.setdefault(r["run"], {})[r["every"]] = r
    return {run: {"kind": rs["default"]["kind"], "verdicts": verdicts(rs),
                  "evidence": {str(every): row for every, row in rs.items()}} for run, rs in by_run.items()}


def report_text(name: str, manifest: dict, runs: list, rows: list[dict], judged: dict[str, dict],
                design: list, baseline: str) -> str:
    """The report of a frozen set in markdown: its provenance, the headline table, every table."""
    missing = manifest.get("missing", [])
    unrecorded = f", not recorded: {', '.join(missing)}" if missing else ""
    parts = [f"# {name}: the frozen replay", "",
             f"Frozen at {manifest['frozen_at']} (detectors at {manifest['detector_commit']}, source hash "
             f"{manifest['detector_hash'][:16]}), sealed at {manifest['sealed_at']}; {len(runs)} runs replayed of "
             f"{len(manifest['runs'])} planned{unrecorded}. A run counts once in every headline; intervals are 95% "
             "Wilson intervals.", "",
             "## Headlines", "", *headline_table({run: j["verdicts"] for run, j in judged.items()}), ""]
    for title, table in (("Collapse runs, per cadence", tables.collapse_table), ("The twin test", tables.damage_table),
                         ("False records, per run and layer", tables.false_records_table),
                         ("Collapse runs one by one", tables.runs_table), ("Eureka runs", tables.eureka_table),
                         ("Eureka runs one by one", tables.eureka_runs_table), ("Healthy runs", tables.healthy_table)):
        parts += [f"## {title}", "", *table(rows), ""]
    parts += ["## The plateau's signals on the Eureka runs", "", *tables.plateau_signals_table(runs), ""]
    collapsing = [r for r in runs if r.spec.task in ("lm", "vit") and r.spec.steps <= 400]
    fs = [f for r in collapsing for f in forecasts(r)]
    design_fs = [f for r in design if r.spec.task in ("lm", "vit") and r.spec.steps <= 400 for f in forecasts(r)]
    if fs:
        parts += ["## collapse_risk", "", *risk_tables(fs, design_fs, baseline), ""]
    return "\n".join(parts)


def baseline_runs(root: Path, name: str) -> tuple[list, str]:
    """The runs the configuration-only baseline is fitted on: the design set's GPT runs under ``root``, else the
    tuning set's (never the set reported)."""
    design = [r for r in load_runs(root, SETS["design"]) if r.spec.task == "lm"]
    if not design and name not in ("design", "tuning"):
        return [r for r in load_runs(root, SETS["tuning"]) if r.spec.task == "lm"], "tuning"
    return design, "design"


def replay(name: str, root: Path, frozen: Path = FROZEN, source: Path = ROOT) -> tuple[str, list]:
    """The one replay of the frozen set ``name`` recorded under ``root`` (:func:`evaluation.freeze.replayable`
    checks it against the detectors' source under ``source``): writes its ``judged.json`` and ``report.md``;
    returns the report's text and the runs replayed."""
    manifest = replayable(name, root, frozen, source)
    specs = [RunSpec.from_dict(e["spec"]) for run, e in manifest["runs"].items() if run not in manifest["missing"]]
    runs = load_runs(root, specs)
    rows = judge.rows_of(runs, AlertConfig())
    judged = judged_runs(rows)
    design, baseline = baseline_runs(root, name)
    text = report_text(name, manifest, runs, rows, judged, design, baseline)
    write_json(frozen / name / "judged.json", {"set": name, "replayed_at": now(), "replayed_at_commit": head(source),
                                               "detector_hash": manifest["detector_hash"],
                                               "missing": manifest["missing"], "runs": judged})
    (frozen / name / "report.md").write_text(text + "\n")
    return text, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", required=True, choices=sorted(SETS))
    parser.add_argument("--frozen", type=Path, default=FROZEN, help="the frozen sets' folder")
    parser.add_argument("--figure", type=Path, help="write the calibration figure here")
    args = parser.parse_args()
    try:
        text, runs = replay(args.set, args.runs, args.frozen)
    except Refused as refused:
        raise SystemExit(f"refused: {refused}") from None
    print(text)
    if args.figure:
        collapsing = [r for r in runs if r.spec.task in ("lm", "vit") and r.spec.steps <= 400]
        figure([f for r in collapsing for f in forecasts(r)], args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
