"""Replay the detectors over recorded runs: thresholds tuned on one set of seeds, reported on another.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.detectors RUNS_DIR [--show RUN] [--markdown]
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.detectors RUNS_DIR --compare RUNS_DIR2

``RUNS_DIR`` holds one folder per run written by ``evaluation/record.py`` (named
``collapse-...-s<seed>`` or ``eureka-...-s<seed>``; the Monitor sampled every step). Each run is
replayed at ``every`` 2, 5, 10 and 20 by keeping the observations whose step is a multiple of
``every``: what a Monitor at that interval would have passed the detectors; and at the Monitor's
default per-family cadence (``"default"``: each family's metrics at the steps its period names,
plus the closer look the detectors ask for, as ``hooks.monitor.cadence.CloserLook`` adds it). Seeds below
20 tune, seeds 20 and up are held out (until the late-phase collapse warning, odd seeds below 20
were held out; they were consulted to design it, docs/alerts.md#evaluation). Ground truth never
looks at the detectors:

* established collapse: the first step ``t`` at which one head is malignant and from which, over
  ``[t, t + 50)`` steps, it is malignant (attention entropy <= 0.5 nats and effective rank <= 10%
  of its rows, Qi et al.'s sparse and low-rank state, fixed lines) in at least 80% of the every-step
  samples;
* hovering: no established collapse, yet one head malignant in at least half of the samples of some
  50 steps (``AMBIGUOUS``): such runs count neither as warned nor as false alerts, and are listed;
* accuracy jump: the first held-out evaluation above halfway from the no-indicator accuracy to
  the run's final accuracy (``evaluation/eureka.py``), none if the final accuracy is not 0.2 above it;
* a warning is in time if its first firing precedes the established collapse; a collapse alert on
  a run with no established collapse is false; a Eureka-moment is on time if its ``since`` step is
  within 2 intervals of the jump, an interval being ``max(every, 20)`` (the held-out accuracy is
  evaluated every 20 steps, so the jump is known to 20 steps only); it is false if the last held-out
  accuracy before it is still within 0.05 of the no-indicator ceiling, or on a run with no jump;
* a plateau is flagged if its alert comes before the jump; a plateau alert on a language-model run
  (the collapse runs: their loss never sits still for 200 steps in the sense of the Eureka task)
  counts against the Eureka thresholds when they are tuned.

Folders named ``healthy-...`` come from ``evaluation/healthy.py --out`` (Hugging Face language
models trained with warmup and cosine decay; the Monitor at its default cadence, so they are replayed
as recorded, at ``default`` only): none collapses or stalls, so every warning or critical alert on
them is false, and their plateau alerts count against the Eureka thresholds when they are tuned.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from diag.detectors import AlertConfig, Detectors, Observation
from evaluation.record import load_observations
from hooks import SIGNALS
from hooks.monitor.cadence import CloserLook, resolve_cadence

EVERYS = ("default", 2, 5, 10, 20)  # "default": the Monitor's per-family cadence
ESTABLISHED_STEPS, ESTABLISHED_SHARE = 50, 0.8
AMBIGUOUS = 0.5  # no established collapse, yet one head malignant in half the samples of 50 steps: hovering
SPARSE, LOW_RANK = 0.5, 0.1  # the ground truth's fixed lines (not AlertConfig's)
# warn_window 20 and warn_persist 1 were chosen on the even seeds with the grid (20, 40) x (1, 2) before the
# late-phase test and the 2-step early look existed (10 was worse on them since); fixed here to keep the grid small
COLLAPSE_GRID = {"sigma_growth": (4.0, 8.0, 16.0), "entropy_drop": (0.25, 0.4), "logit_factor": (2.0, 3.0, 4.0),
                 "near_entropy": (0.75, 1.0, 1.25), "near_growth": (1.5, 2.0)}
# plateau_window and plateau_rel change the plateau detector only
EUREKA_GRID = {"eureka_depth": (0.375, 0.425, 0.475), "plateau_qk_ratio": (0.4, 0.5, 0.6),
               "plateau_window": (150, 200), "plateau_rel": (0.05, 0.125), "eureka_span": (20, 40)}
PLATEAU_MARGIN = 0.05  # accuracy within 0.05 of the no-indicator ceiling: still on the plateau
FRESH_SEED = 20  # runs of this seed and up are held out, the others tune
EVAL_EVERY = 20  # steps between held-out evaluations: the accuracy jump is known to this resolution


@dataclass
class Run:
    name: str
    task: str
    seed: int
    obs: list[Observation]
    info: dict
    peak: float = 0.0  # collapse runs: peak_share of the run

    @property
    def split(self) -> str:
        """Seeds below 20 tune (the odd ones were held out until they were consulted to design the late-phase
        warning, docs/alerts.md#evaluation); seeds 20 and up, recorded after that, are held out."""
        return "held-out" if self.seed >= FRESH_SEED else "tuning"


def load_runs(folder: Path) -> list[Run]:
    runs = []
    for path in sorted(folder.iterdir()):
        if (path / "run.json").exists() and (path / "observations.jsonl").exists():
            info = json.loads((path / "run.json").read_text())
            obs = load_observations(path / "observations.jsonl")
            task = info["config"]["task"]
            runs.append(Run(path.name, task, info["config"]["seed"], obs, info,
                            peak_share(obs) if task == "collapse" else 0.0))
    return runs


FAMILY_OF = {"grad_": "grads", "qk_": "spectra", "attn_": "attention", "update_": "updates"}


def family(metric: str) -> str:
    return next(f for prefix, f in FAMILY_OF.items() if metric.startswith(prefix))


def replay(obs: list[Observation], cfg: AlertConfig, every: int | str) -> list:
    """The alerts a Monitor at ``every`` (an int: every family every ``every`` steps; ``"default"``: the
    per-family default cadence with its closer look) would have raised on this run."""
    det = Detectors(cfg)
    if every != "default":
        return [a for o in obs if o.step % every == 0 for a in det.observe(o)]
    cadence = resolve_cadence(None, None, SIGNALS)
    closer = CloserLook(cadence, cfg.watch_hold, early=cfg.watch_early, early_every=cfg.watch_early_every)
    out = []
    for o in obs:
        if o.loss is None and all(family(k) == "updates" for m in o.layers.values() for k in m):
            if cadence.is_due("updates", o.step):  # the update ratio of a step that sampled updates
                out += det.observe(o)
                closer.update(o.step, det.wants_attention())  # as Monitor._finish_updates
            continue
        due = cadence.due(o.step) | closer.adds(o.step)
        if not due:
            continue
        layers = {label: {k: v for k, v in m.items() if family(k) in due} for label, m in o.layers.items()}
        out += det.observe(Observation(o.step, o.loss if "loss" in due else None, layers))
        closer.update(o.step, det.wants_attention())
    return out


def established_collapse(obs: list[Observation]) -> int | None:
    """Ground truth from the attention logged at every step (module docstring)."""
    series: dict[str, list[tuple[int, bool]]] = {}
    for o in obs:
        for label, m in o.layers.items():
            if "attn_entropy" not in m:
                continue
            rows = float(m["attn_rows"][0])
            for h, (e, r) in enumerate(zip(m["attn_entropy"], m["attn_rank"])):
                bad = bool(e <= SPARSE and r <= LOW_RANK * rows)
                series.setdefault(f"{label}/{h}", []).append((o.step, bad))
    best = None
    for points in series.values():
        for i, (t, bad_now) in enumerate(points):
            if not bad_now:  # the stretch starts at a malignant sample
                continue
            span = [bad for s, bad in points[i:] if s < t + ESTABLISHED_STEPS]
            if points[-1][0] >= t + ESTABLISHED_STEPS - 1 and sum(span) >= ESTABLISHED_SHARE * len(span):
                best = t if best is None else min(best, t)
                break
    return best


def peak_share(obs: list[Observation]) -> float:
    """The largest share of every-step samples in which one head is malignant, over any ``[t, t + 50)`` that
    ends inside the run: a run with no established collapse whose peak share is AMBIGUOUS or more hovers at
    the malignant line and counts neither as warned nor as a false alert."""
    series: dict[str, list[tuple[int, bool]]] = {}
    for o in obs:
        for label, m in o.layers.items():
            if "attn_entropy" in m:
                rows = float(m["attn_rows"][0])
                for h, (e, r) in enumerate(zip(m["attn_entropy"], m["attn_rank"])):
                    series.setdefault(f"{label}/{h}", []).append((o.step, bool(e <= SPARSE and r <= LOW_RANK * rows)))
    best = 0.0
    for points in series.values():
        last = points[-1][0]
        for i, (t, _) in enumerate(points):
            if t + ESTABLISHED_STEPS - 1 > last:
                break
            span = [bad for s, bad in points[i:] if s < t + ESTABLISHED_STEPS]
            best = max(best, sum(span) / len(span))
    return best


def accuracy_jump(info: dict) -> int | None:
    evals, blind = info["evals"], info["blind"]
    final = sum(acc for _, _, acc in evals[-3:]) / 3
    if final < blind + 0.2:
        return None
    return next((s for s, _, acc in evals if acc > (blind + final) / 2), None)


def first(alerts: list, kind: str, attr: str = "step") -> int | None:
    steps = [getattr(a, attr) for a in alerts if a.kind == kind and a.status == "firing"]
    return min(steps) if steps else None


def records_per_key(alerts: list) -> int:
    """The most records (firing and resolved) of one kind on one head, layer or run."""
    counts = Counter((a.kind, a.where) for a in alerts)
    return max(counts.values(), default=0)


def replay_run(run: Run, cfg: AlertConfig, every) -> list:
    """:func:`replay` at ``every``; a healthy run (recorded by a Monitor at its default cadence) as recorded."""
    if run.task == "healthy":
        det = Detectors(cfg)
        return [a for o in run.obs for a in det.observe(o)]
    return replay(run.obs, cfg, every)


def judge_healthy(run: Run, cfg: AlertConfig, every, truth=None) -> dict:
    """A healthy run, replayed as recorded (the Monitor's default cadence): its warning and critical alerts."""
    alerts = replay_run(run, cfg, every)
    bad = [a for a in alerts if a.status == "firing" and a.level != "info"]
    return {"run": run.name, "every": every, "healthy": True, "warnings": sorted({f"{a.kind}@{a.step}" for a in bad}),
            "plateau_alerts": sum(a.kind == "eureka_plateau" and a.status == "firing" for a in alerts),
            "records": records_per_key(alerts)}


def judge_collapse(run: Run, cfg: AlertConfig, every: int, truth: int | None) -> dict:
    alerts = replay(run.obs, cfg, every)
    warn, crit = first(alerts, "collapse_warning"), first(alerts, "malignant_collapse")
    alarm = min((s for s in (warn, crit) if s is not None), default=None)
    hovering = truth is None and run.peak >= AMBIGUOUS
    return {"run": run.name, "every": every, "truth": truth, "warning": warn, "critical": crit,
            "in_time": truth is not None and alarm is not None and alarm < truth,
            "lead": None if truth is None or alarm is None else truth - alarm, "hovering": hovering,
            "false": truth is None and not hovering and alarm is not None,
            "note": first(alerts, "large_early_updates"),
            "plateau_alerts": sum(a.kind == "eureka_plateau" and a.status == "firing" for a in alerts),
            "records": records_per_key(alerts), "n_alerts": sum(a.status == "firing" for a in alerts)}


def at_plateau(info: dict, step: int) -> bool:
    """Held-out accuracy at the last evaluation up to ``step`` still at the plateau's ceiling (+ PLATEAU_MARGIN)."""
    seen = [acc for s, _, acc in info["evals"] if s <= step]
    return not seen or seen[-1] <= info["blind"] + PLATEAU_MARGIN


def judge_eureka(run: Run, cfg: AlertConfig, every: int, jump: int | None) -> dict:
    alerts = replay(run.obs, cfg, every)
    plateau, moment = first(alerts, "eureka_plateau"), first(alerts, "eureka_moment", "since")
    moments = [a.since for a in alerts if a.kind == "eureka_moment"]
    # the jump is known to EVAL_EVERY steps only; the default cadence samples the loss every 10 steps
    interval = max(10 if every == "default" else every, EVAL_EVERY)
    off = None if moment is None or jump is None else (moment - jump) / interval
    false = sum(1 for m in moments if jump is None or at_plateau(run.info, m))
    return {"run": run.name, "every": every, "jump": jump, "plateau": plateau, "moment": moment, "offset": off,
            "plateau_in_time": plateau is not None and jump is not None and plateau < jump,
            "on_time": off is not None and abs(off) <= 2, "false": false, "records": records_per_key(alerts),
            "collapse_alerts": sum(a.kind in ("collapse_warning", "malignant_collapse") for a in alerts)}


def score_collapse(rows: list[dict]) -> tuple:
    missed = sum(r["truth"] is not None and not r["in_time"] for r in rows)
    false = sum(r["false"] for r in rows)
    return (missed + false, -sum(r["lead"] or 0 for r in rows))


def score_eureka(rows: list[dict]) -> tuple:
    """Late or missing moments, false moments, plateaus not flagged before the jump, and plateau alerts on
    the language-model runs (which never sit on a plateau in their 200-400 steps); then the moments' offsets."""
    eureka = [r for r in rows if "jump" in r]
    late = sum(r["jump"] is not None and not r["on_time"] for r in eureka)
    missed = sum(r["jump"] is not None and not r["plateau_in_time"] for r in eureka)
    lm = sum(r["plateau_alerts"] > 0 for r in rows if "truth" in r or "healthy" in r)
    return (late + sum(r["false"] for r in eureka) + missed + lm, sum(abs(r["offset"] or 0) for r in eureka))


def judge_any(run: Run, cfg: AlertConfig, every, truth) -> dict:
    return JUDGE[run.task](run, cfg, every, truth)


JUDGE = {"collapse": judge_collapse, "eureka": judge_eureka, "healthy": judge_healthy}


def everys(run: Run) -> tuple:
    """The intervals a run is replayed at: healthy runs were recorded at the default cadence only."""
    return ("default",) if run.task == "healthy" else EVERYS


def tune(runs: list[Run], grid: dict, judge, score, truth) -> AlertConfig:
    best, best_cfg = None, AlertConfig()
    for values in itertools.product(*grid.values()):
        cfg = replace(AlertConfig(), **dict(zip(grid, values)))
        rows = [judge(r, cfg, every, truth[r.name]) for r in runs for every in everys(r)]
        s = score(rows)
        if best is None or s < best:
            best, best_cfg = s, cfg
    return best_cfg


def runs_table(runs: list[Run], truth: dict) -> list[str]:
    out = ["| run | split | steps | ground truth |", "|---|---|---|---|"]
    for r in runs:
        what = {"collapse": "established collapse", "eureka": "accuracy jump", "healthy": "stall"}[r.task]
        shown = f"{what} at {truth[r.name]}" if truth[r.name] is not None else f"no {what}"
        if r.task == "collapse" and truth[r.name] is None and r.peak >= AMBIGUOUS:
            shown = f"hovering: one head malignant in {r.peak:.0%} of 50 steps at most"
        out.append(f"| {r.name} | {r.split} | {r.info['config']['steps']} | {shown} |")
    return out


def summary(rows: list[dict]) -> list[str]:
    """One markdown row per (split, every): the figures docs/alerts.md reports."""
    out = ["| split | every | collapses warned in time | lead (steps) | false collapse alerts | plateaus flagged "
           "| moments within 2 intervals | false moments | most records of one kind on one head "
           "| hovering runs with a collapse alert | language-model runs with a plateau alert "
           "| healthy runs with a warning |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for split in ("tuning", "held-out"):
        for every in EVERYS:
            rs = [r for r in rows if r["split"] == split and r["every"] == every]
            col = [r for r in rs if "truth" in r]
            est = [r for r in col if r["truth"] is not None]
            hover = [r for r in col if r["hovering"]]
            leads = sorted(r["lead"] for r in est if r["in_time"])
            eur = [r for r in rs if "jump" in r and "normsoftmax" not in r["run"]]
            jumped = [r for r in eur if r["jump"] is not None]
            healthy = [r for r in rs if "healthy" in r]
            warned = f"{sum(bool(r['warnings']) for r in healthy)}/{len(healthy)}" if healthy else "-"
            out.append(
                f"| {split} | {every} | {sum(r['in_time'] for r in est)}/{len(est)} | "
                f"{'-' if not leads else f'{leads[0]}-{leads[-1]}'} | "
                f"{sum(r['false'] for r in col)}/{len(col) - len(est) - len(hover)} no-collapse runs | "
                f"{sum(r['plateau_in_time'] for r in jumped)}/{len(jumped)} | "
                f"{sum(r['on_time'] for r in jumped)}/{len(jumped)} | {sum(r['false'] for r in eur)} | "
                f"{max((r['records'] for r in rs), default=0)} | "
                f"{sum(r['critical'] is not None or r['warning'] is not None for r in hover)}/{len(hover)} | "
                f"{sum(r['plateau_alerts'] > 0 for r in col)}/{len(col)} | "
                f"{warned} |")
    return out


def healthy_table(rows: list[dict]) -> list[str]:
    """The healthy runs one by one: every warning or critical alert on them is false."""
    healthy = [r for r in rows if "healthy" in r]
    if not healthy:
        return []
    out = ["| run | split | warning or critical alerts (kind@step) |", "|---|---|---|"]
    out += [f"| {r['run']} | {r['split']} | {', '.join(r['warnings']) or 'none'} |" for r in healthy]
    return out


def outcome(run: Run) -> str:
    """A collapse run's ground truth in words: established (at the step), hovering, or none."""
    truth = established_collapse(run.obs)
    if truth is not None:
        return f"established at {truth}"
    return "hovering" if run.peak >= AMBIGUOUS else "none"


def compare(runs: list[Run], others: list[Run]) -> list[str]:
    """The same configurations recorded twice (e.g. ``--threads 1`` and ``--threads 2``: the same seed under
    another floating-point reduction order): does the ground truth agree? A markdown table."""
    theirs = {r.name: r for r in others if r.task == "collapse"}
    out = ["| run | this recording | the other | same outcome |", "|---|---|---|---|"]
    same = total = 0
    for r in runs:
        if r.task != "collapse" or r.name not in theirs:
            continue
        a, b = outcome(r), outcome(theirs[r.name])
        agree = a.split(" at ")[0] == b.split(" at ")[0]
        same, total = same + agree, total + 1
        out.append(f"| {r.name} | {a} | {b} | {'yes' if agree else 'no'} |")
    out.append(f"\n{same} of {total} runs keep their outcome (established, hovering or none).")
    return out


def trust(runs: list[Run]) -> list[str]:
    """What followed each run's first collapse_warning at the default cadence (docs/alerts.md#collapse_warning):
    a markdown table by when it came (first ``warn_window`` steps, later, none) and, for the early ones, by
    learning rate; the outcome is the ground truth (established, hovering, none)."""
    window = AlertConfig().warn_window
    table: dict[str, Counter] = {}
    for r in runs:
        if r.task != "collapse":
            continue
        alerts = replay(r.obs, AlertConfig(), "default")
        steps = [a.step for a in alerts if a.kind == "collapse_warning" and a.status == "firing"]
        result = outcome(r).split(" at ")[0]
        when = "none" if not steps else f"in the first {window} steps" if min(steps) <= window else "later"
        table.setdefault(when, Counter())[result] += 1
        if when != "none" and min(steps) <= window:
            table.setdefault(f"of which lr {r.info['config']['lr']:g}", Counter())[result] += 1
    out = ["| first `collapse_warning` | runs | established collapse | hovering at the line | no collapse |",
           "|---|---|---|---|---|"]
    for when in sorted(table, key=lambda k: (k.startswith("none"), k.startswith("later"), k)):
        c = table[when]
        out.append(f"| {when} | {sum(c.values())} | {c['established']} | {c['hovering']} | {c['none']} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--show", help="print the alerts of this run at --every with the defaults")
    parser.add_argument("--every", default="10", help="an integer, or default (the per-family cadence)")
    parser.add_argument("--no-tune", action="store_true", help="report the defaults on every run")
    parser.add_argument("--markdown", action="store_true", help="end with the summary table of docs/alerts.md")
    parser.add_argument("--trust", action="store_true", help="only the table of what followed each run's first "
                        "collapse_warning (docs/alerts.md#collapse_warning)")
    parser.add_argument("--compare", type=Path, metavar="RUNS_DIR2",
                        help="only compare the ground truth of the collapse runs recorded in both folders")
    args = parser.parse_args()
    runs = load_runs(args.runs)
    if args.trust:
        print("\n".join(trust(runs)))
        return
    if args.compare:
        print("\n".join(compare(runs, load_runs(args.compare))))
        return
    if args.show:
        run = next(r for r in runs if r.name == args.show)
        every = args.every if args.every == "default" else int(args.every)
        for a in replay_run(run, AlertConfig(), every):
            print(f"{a.step:5d} {a.status:8s} {a.level:8s} {a.kind:20s} {a.where:8s} since {a.since}  {a.message}")
        return
    truth = {r.name: established_collapse(r.obs) if r.task == "collapse" else
             accuracy_jump(r.info) if r.task == "eureka" else None for r in runs}
    collapse = [r for r in runs if r.task == "collapse"]
    eureka = [r for r in runs if r.task == "eureka" and "normsoftmax" not in r.name]
    cfg = AlertConfig()
    if not args.no_tune:
        cfg_c = tune([r for r in collapse if r.split == "tuning"], COLLAPSE_GRID, judge_collapse, score_collapse,
                     truth)
        healthy = [r for r in runs if r.task == "healthy"]
        cfg_e = tune([r for r in eureka + collapse + healthy if r.split == "tuning"], EUREKA_GRID, judge_any,
                     score_eureka, truth)
        cfg = replace(cfg_c, **{k: getattr(cfg_e, k) for k in EUREKA_GRID})
        print("tuned:", {k: getattr(cfg, k) for k in (*COLLAPSE_GRID, *EUREKA_GRID)})
    rows = []
    for r in runs:
        for every in everys(r):
            row = JUDGE[r.task](r, cfg, every, truth[r.name])
            rows.append({"split": r.split, **row})
            print(json.dumps(rows[-1]))
    if args.markdown:
        print("\n".join(runs_table(runs, truth) + [""] + summary(rows) + [""] + healthy_table(rows)))


if __name__ == "__main__":
    main()
