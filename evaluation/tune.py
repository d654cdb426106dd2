"""Choose the plateau's thresholds on the tuning runs (evaluation/seeds.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.tune RUNS_DIR

The choices, each printed as a table of every value tried (``--only depth``: the last one alone):

* ``plateau_qk_motion``, how little the query/key product may move per unit of its updates on a plateau: every
  softmax Eureka plateau of the tuning set flagged before its accuracy jump at every cadence, minus two for each
  plateau alert on a healthy run (the design set's: the tuning set has none) that the NormSoftmax twin test does
  not call a real plateau and that does not sit at the corpus's context-free loss (a run stuck there is no
  healthy run); ties go to the value in the middle of the best ones. It is also chosen leaving each
  healthy family out, to show whether that family's report depends on its own runs. On the consulted runs
  every value from 0.2 up, off included, flags every plateau with no healthy alert, because
  ``plateau_max_growth`` already holds the healthy runs' windows; the shipped 0.25 keeps the test as a second
  line over the largest motion a plateau needed, 0.19 (docs/alerts.md#defaults).
* ``plateau_max_growth``, how much sigma_1(Wq^T Wk) may grow over a plateau's window, and
  ``plateau_min_update``, how small the Q/K updates may have become against their largest window's: the same
  score, each with the other fields at their defaults, and each also chosen leaving every healthy family out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diag.detectors import AlertConfig
from evaluation import detectors as judge
from evaluation.seeds import SETS
from evaluation.truth import Run, load_runs

QK_MOTION = (0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6, float("inf"))
MAX_GROWTH = (1.2, 1.3, 1.35, 1.5, 2.0, float("inf"))
MIN_UPDATE = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)
EUREKA_DEPTH = (0.34, 0.355, 0.365, 0.375, 0.38, 0.385, 0.39, 0.395, 0.4, 0.425)


def plateau_rows(runs: list[Run], name: str, value: float) -> list[dict]:
    """The Eureka runs (softmax) and the Hugging Face runs judged with one plateau field at ``value``."""
    cfg = AlertConfig(**{name: value})
    eureka = [r for r in runs if r.spec.task == "vit" and r.spec.steps > 1000 and not r.spec.twin]
    hf = [r for r in runs if r.spec.task == "hf"]
    return judge.rows_of(eureka, cfg) + judge.rows_of(hf, cfg)


def plateau_score(rows: list[dict]) -> tuple[int, int, int]:
    eureka = [r for r in rows if r["kind"] == "eureka" and r["jump"] is not None]
    flagged = sum(r["plateau_in_time"] for r in eureka)
    # a plateau at the corpus's context-free loss is no healthy run's (a BERT stuck there with its twin,
    # docs/alerts.md#masked-language-models-a-plateau-at-the-context-free-loss): its alert is not false
    false = sum(r["plateau_alerts"] > 0 and not r["plateau_real"] and not r.get("context_free") for r in rows
                if r["kind"] == "hf" and not r["twin"])
    return flagged - 2 * false, flagged, false


def _middle(scores: dict[float, int]) -> float:
    top = max(scores.values())
    best = [v for v in sorted(scores) if scores[v] == top]
    return best[len(best) // 2]


def tune_one(runs: list[Run], name: str, values: tuple[float, ...]) -> tuple[float, list[str], dict[str, float]]:
    """One plateau field (``plateau_qk_motion``, ``plateau_max_growth``, ``plateau_min_update``) with the others
    at their defaults: the score of :func:`plateau_score`; ties go to the value in the middle of the best ones;
    also chosen leaving each healthy family out."""
    table = [f"| {name} | Eureka plateaus flagged before the jump (runs x cadences) | plateau alerts on "
             "healthy runs without a real plateau | score |", "|---|---|---|---|"]
    rows = {v: plateau_rows(runs, name, v) for v in values}
    scores = {}
    for v in values:
        scores[v], flagged, false = plateau_score(rows[v])
        table.append(f"| {v:g} | {flagged} | {false} | {scores[v]} |")
    families = sorted({r["model"] for r in rows[values[0]] if r.get("model")})  # the healthy families given
    left_out = {family: _middle({v: plateau_score([r for r in rows[v] if r.get("model") != family])[0]
                                 for v in values}) for family in families}
    return _middle(scores), table, left_out


def tune_depth(runs: list[Run]) -> tuple[float, list[str]]:
    """``eureka_depth``: the moments within 2 sampling intervals of the accuracy jump over the softmax Eureka runs
    at every cadence (the shipped value was chosen on the consulted runs, docs/evaluation.md); every plateau
    must still be flagged before its jump and no moment be false. The value in the
    middle of the flat top: of those within 2 moments of the best count (less than one run at its five cadences),
    so that the choice does not rest on one moment."""
    eureka = [r for r in runs if r.spec.task == "vit" and r.spec.steps > 1000 and not r.spec.twin]
    table = ["| eureka_depth | moments within 2 intervals | within 4 | plateaus flagged before the jump | "
             "false moments |", "|---|---|---|---|---|"]
    scores = {}
    for value in EUREKA_DEPTH:
        rows = [r for r in judge.rows_of(eureka, AlertConfig(eureka_depth=value)) if r["jump"] is not None]
        within = [sum(r["offset"] is not None and abs(r["offset"]) <= n for r in rows) for n in (2, 4)]
        flagged, false = sum(r["plateau_in_time"] for r in rows), sum(r["false_moments"] for r in rows)
        table.append(f"| {value:g} | {within[0]}/{len(rows)} | {within[1]}/{len(rows)} | {flagged}/{len(rows)} | "
                     f"{false} |")
        if flagged == len(rows) and false == 0:
            scores[value] = within[0]
    top = max(scores.values())
    flat = [v for v in sorted(scores) if scores[v] >= top - 2]
    return flat[len(flat) // 2], table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="folders holding the runs (a run in several: the first)")
    parser.add_argument("--set", nargs="+", default=["tuning"], choices=sorted(SETS),
                        help="the sets tuned on (several: their runs together, each counted once)")
    parser.add_argument("--only", choices=("plateau", "depth"), help="one of the choices")
    args = parser.parse_args()
    found = {}
    for root in args.runs:
        for name in args.set:
            for r in load_runs(root, SETS[name]):
                found.setdefault(r.name, r)
    runs = list(found.values())
    print(f"{' and '.join(args.set)}: {len(runs)} runs of {sum(len(SETS[n]) for n in args.set)} planned\n")
    if not any(r.spec.task == "hf" for r in runs):  # the tuning set has none: the design set's healthy runs
        runs += [r for r in load_runs(args.runs[0], SETS["design"]) if r.spec.task == "hf"]
    if args.only in (None, "plateau"):
        for name, values in (("plateau_qk_motion", QK_MOTION), ("plateau_max_growth", MAX_GROWTH),
                             ("plateau_min_update", MIN_UPDATE)):
            value, table, left_out = tune_one(runs, name, values)
            print("\n".join(table) + f"\n\n{name}: {value:g}")
            print("chosen leaving each healthy family out: " + ", ".join(f"{k} {v:g}" for k, v in left_out.items()))
    if args.only == "depth":  # chosen on the Eureka runs of the sets given (docs/alerts.md#eureka_moment)
        value, table = tune_depth(runs)
        print("\n".join(table) + f"\n\neureka_depth: {value:g}")


if __name__ == "__main__":
    main()
