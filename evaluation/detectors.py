"""Replay the detectors over recorded runs and judge them against the ground truth of evaluation/truth.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.detectors RUNS_DIR --set report --markdown
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.detectors RUNS_DIR --show RUN_NAME --every default

``RUNS_DIR`` holds the runs of evaluation/seeds.py (``python -m evaluation.plan``). Each run recorded at
``every=1`` is replayed at ``every`` 2, 5, 10 and 20 (the observations whose step is a multiple of ``every``:
what a Monitor at that interval passes its detectors) and at the Monitor's default per-family cadence
(``"default"``: each family at its own period, plus the closer look the detectors ask for, as
``hooks.monitor.cadence.CloserLook`` adds it). Hugging Face runs, recorded with every family every 10 steps, are
replayed at the default cadence only (the design set's, recorded at the Monitor's default cadence itself, as
recorded).
A collapse run's records are judged per layer and per head against their own onsets, within a window on both
sides (:mod:`evaluation.matching`). A run counts once in every figure, whatever the cadences it is replayed at;
``--markdown`` prints the tables of :mod:`evaluation.tables` (a frozen set's report: :mod:`evaluation.report`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from diag.detectors import AlertConfig, Detectors, Observation
from evaluation.matching import COLLAPSE, match, records_of
from evaluation.seeds import BOUNDARY_LR, SETS
from evaluation.spec import EVERYS
from evaluation.truth import (
    Run,
    accuracy_jump,
    accuracy_rise,
    at_context_free,
    collapse_onset,
    damage,
    load_run,
    load_runs,
    onsets,
    plateau_by_twin,
    settled,
    states,
    stuck_with_twin,
)
from hooks.monitor.cadence import CloserLook, resolve_cadence
from hooks.monitor.monitor import SIGNALS

FAMILY_OF = {"grad_": "grads", "qk_": "spectra", "attn_": "attention", "update_": "updates"}
PLATEAU_MARGIN = 0.05  # held-out accuracy within 0.05 of the no-indicator ceiling: still on the plateau
EVAL_EVERY = 20  # steps between held-out evaluations of the Eureka task

# the runs judged as healthy: no warning or critical record may reach them (a fine-tune's sinks are its baseline)
HEALTHY = ("healthy", "sinks")


def family(metric: str) -> str:
    return next(f for prefix, f in FAMILY_OF.items() if metric.startswith(prefix))


def replay(obs: list[Observation], cfg: AlertConfig, every: int | str, losses: list[float] | None = None) -> list:
    """The alerts a Monitor at ``every`` (an int: every family every ``every`` steps; ``"default"``: the
    per-family default cadence with its closer look) would have raised on this run. ``losses``: the run's loss
    at every step (index = step), for the mean loss between two loss samples the Monitor hands its detectors
    (``Observation.loss_mean``); by default the observations' own losses (a run recorded at ``every=1``)."""
    det = Detectors(cfg)
    if every != "default":
        means = LossMeans(obs, losses)
        return [a for o in obs if o.step % every == 0 for a in det.observe(means.given(o))]
    return [a for _, alerts in at_default_cadence(obs, det, losses) for a in alerts]


class LossMeans:
    """``Observation.loss_mean`` as a live Monitor computes it: the mean loss of the steps after the last
    observation given with a loss, up to this one's, from the run's every-step losses."""

    def __init__(self, obs: list[Observation], losses: list[float] | None) -> None:
        self.loss_at = dict(enumerate(losses)) if losses is not None else \
            {o.step: o.loss for o in obs if o.loss is not None}
        self.last = -1

    def given(self, o: Observation) -> Observation:
        if o.loss is None:
            return o
        seen = [self.loss_at[t] for t in range(self.last + 1, o.step + 1) if t in self.loss_at]
        self.last = o.step
        return Observation(o.step, o.loss, o.layers, sum(seen) / len(seen) if seen else None)


def at_default_cadence(obs: list[Observation], det: Detectors, losses: list[float] | None = None):
    """Feed ``det`` what a Monitor at its default cadence would: each family at its own period, plus the closer
    look the detectors ask for (``CloserLook.heed``: attention at every step while a head is near the malignant
    lines, with every loss sample while a layer is at risk), the mean loss since the last loss sample with each
    (:class:`LossMeans`). Yields (the observation they were given, the alerts it raised)."""
    cadence = resolve_cadence(None, None, SIGNALS)
    closer = CloserLook(cadence)
    means = LossMeans(obs, losses)
    for o in obs:
        if o.loss is None and all(family(k) == "updates" for m in o.layers.values() for k in m):
            if cadence.is_due("updates", o.step):  # the update ratio of a step that sampled updates
                yield o, det.observe(o)
                closer.heed(o.step, det)
            continue
        due = cadence.due(o.step) | closer.adds(o.step)
        if not due:
            continue
        layers = {label: {k: v for k, v in m.items() if family(k) in due} for label, m in o.layers.items()}
        given = means.given(Observation(o.step, o.loss if "loss" in due else None, layers))
        yield given, det.observe(given)
        closer.heed(o.step, det)


def replay_run(run: Run, cfg: AlertConfig, every) -> list:
    """:func:`replay` at ``every``; a run recorded at the default cadence (``every=0``: the design set's Hugging
    Face runs) as recorded."""
    if run.spec.every == 0:
        det, means = Detectors(cfg), LossMeans(run.obs, run.losses)
        return [a for o in run.obs for a in det.observe(means.given(o))]
    return replay(run.obs, cfg, every, run.losses)


def everys(run: Run) -> tuple:
    if run.spec.purpose in HEALTHY or run.spec.every == 0:
        return ("default",)
    # the cadences the recording holds: a run recorded every 2nd step is replayed at 2, 10 and 20, not at 5
    return tuple(e for e in EVERYS if e == "default" or e % run.spec.every == 0)


def first(alerts: list, kind: str, attr: str = "step", scope: str | None = None) -> int | None:
    """The first firing record of ``kind`` (``scope``: of a layer, ``"layer"``, or a head, ``"head"``, only)."""
    steps = [getattr(a, attr) for a in alerts if a.kind == kind and a.status == "firing"
             and (scope is None or ("/" in a.where) == (scope == "head"))]
    return min(steps, default=None)


def records_per_head(alerts: list) -> int:
    """The most records (firing and resolved) of one kind on one head or layer."""
    return max(Counter((a.kind, a.where) for a in alerts if a.where).values(), default=0)


def twin_of(run: Run, runs: dict[str, Run]) -> Run | None:
    """The QK-norm (language models, ViT) or NormSoftmax (Hugging Face language models) twin of a run."""
    from dataclasses import replace

    kind = "normsoftmax" if run.spec.purpose in HEALTHY else "qknorm"
    if run.spec.twin:
        return None
    return runs.get(replace(run.spec, twin=kind, threads=1).name)


def collapse_matches(run: Run, alerts: list) -> dict:
    """The run's collapsed layers and heads against their own records (:mod:`evaluation.matching`), and the false
    records of each."""
    end = run.spec.steps - 1
    layers = match(records_of(alerts, "malignant_collapse", "layer"), onsets(run), COLLAPSE, end)
    heads = match(records_of(alerts, "malignant_collapse", "head"), onsets(run, "head"), COLLAPSE, end)
    onset, first_record = collapse_onset(run), first(alerts, "malignant_collapse", scope="layer")
    return {"onset": onset, "head_onset": collapse_onset(run, "head"), "layers": layers["onsets"],
            "heads": heads["onsets"], "first_record": first_record,
            "caught": onset is not None and all(x["in_time"] for x in layers["onsets"]),
            # a missed layer whose onset came within 50 steps of the run's end: whether its record would have come
            # in time is unknown (counted apart, and as a miss in the plain count)
            "censored": any(x["censored"] for x in layers["onsets"]),
            "false_records": layers["false"], "false_head_records": heads["false"],
            "quiet_record": onset is None and first_record is not None}


ALARMS = ("malignant_collapse", "collapse_damage", "collapse_stall")  # a collapse alert, for the twin test


def judge_collapse(run: Run, cfg: AlertConfig, every, twin: Run | None) -> dict:
    """:func:`collapse_matches` at ``every``, and the twin test: whether a collapse alert (a layer's collapse
    record or a damage record) came before the damage began."""
    alerts = replay_run(run, cfg, every)
    damaged, damage_from = damage(run, twin)
    alarm = min((a.step for a in alerts if a.status == "firing" and a.kind in ALARMS and "/" not in a.where),
                default=None)
    return {"run": run.name, "every": every, "lr": run.spec.lr, "twin": run.spec.twin,
            **collapse_matches(run, alerts),
            "damaged": damaged, "damage_from": damage_from, "alarm": alarm,
            "alarm_before_damage": None if not damaged else alarm is not None and damage_from is not None
            and alarm < damage_from,
            "records": records_per_head(alerts),
            "plateau_alerts": sum(a.kind == "eureka_plateau" and a.status == "firing" for a in alerts),
            "critical": sorted({f"{a.kind}@{a.step}:{a.where}" for a in alerts if a.status == "firing"
                                and a.level == "critical"}),
            "bad": sorted({f"{a.kind}@{a.step}:{a.where}" for a in alerts if a.status == "firing"
                           and a.level != "info"})}


def at_plateau(info: dict, step: int) -> bool:
    seen = [acc for s, _, acc in info["evals"] if s <= step]
    return not seen or seen[-1] <= info["blind"] + PLATEAU_MARGIN


def judge_eureka(run: Run, cfg: AlertConfig, every, twin: Run | None) -> dict:
    alerts = replay_run(run, cfg, every)
    jump = accuracy_jump(run.info)
    plateau, moment = first(alerts, "eureka_plateau"), first(alerts, "eureka_moment", "since")
    moments = [a.since for a in alerts if a.kind == "eureka_moment"]
    interval = max(10 if every == "default" else every, EVAL_EVERY)
    off = None if moment is None or jump is None else (moment - jump) / interval
    # the jump as the span it takes (evaluation.truth.accuracy_rise): how far outside it the moment fell, in
    # intervals (0 inside)
    rise = accuracy_rise(run.info)
    off_rise = None if moment is None or rise is None else \
        (min(moment - rise[0], 0) + max(moment - rise[1], 0)) / interval
    return {"run": run.name, "every": every, "twin": run.spec.twin, "jump": jump, "plateau": plateau,
            "moment": moment, "offset": off, "rise": rise, "offset_rise": off_rise, "settled": settled(run.info),
            "plateau_in_time": plateau is not None and jump is not None and plateau < jump,
            "false_moments": sum(1 for m in moments if jump is None or at_plateau(run.info, m)),
            "records": records_per_head(alerts),
            "bad": sorted({f"{a.kind}@{a.step}" for a in alerts if a.status == "firing" and a.level != "info"
                           and a.kind != "eureka_plateau"})}


def in_state(run: Run, alert) -> bool:
    """Whether the ground truth (the states of the run's logged attention, evaluation.truth.states) has the head or
    layer of an attention-state alert in that state at some time (every head of a record several heads share,
    ``Alert.heads``): the alert is a true one by the ground truth's states."""
    state = {"malignant_collapse": "malignant", "benign_collapse": "benign", "uniform_attention": "uniform",
             "attention_sink": "sink"}.get(alert.kind)
    found = {e.where for e in states(run) if e.state == state}
    return state is not None and all(where in found for where in alert.heads or (alert.where,))


def judge_hf(run: Run, cfg: AlertConfig, every, twin: Run | None) -> dict:
    alerts = replay_run(run, cfg, every)
    firing = [a for a in alerts if a.status == "firing" and a.level != "info" and a.kind != "eureka_plateau"]
    plateaus = [a for a in alerts if a.kind == "eureka_plateau" and a.status == "firing"]
    truth, stuck, context_free = None, False, None
    if plateaus:
        level = plateaus[0].values.get("loss", float("nan"))
        context_free = at_context_free(run, plateaus[0].step)
        if twin is not None:
            truth, stuck = plateau_by_twin(run, twin, level), stuck_with_twin(run, twin, level)
    return {"run": run.name, "every": every, "model": run.spec.model, "schedule": run.spec.schedule,
            "twin": run.spec.twin, "has_twin": twin is not None, "plateau_alerts": len(plateaus),
            "plateau_real": truth, "stuck": stuck,
            "context_free": context_free,
            "records": records_per_head(alerts),
            "bad": sorted({f"{a.kind}@{a.step}:{a.where}" for a in firing}),
            "critical": sorted({f"{a.kind}@{a.step}:{a.where}" for a in firing if a.level == "critical"}),
            "sinks": sum(a.kind == "attention_sink" and a.status == "firing" for a in alerts),
            "bad_in_state": sorted({f"{a.kind}@{a.step}:{a.where}" for a in firing if in_state(run, a)})}


def judge(run: Run, cfg: AlertConfig, every, twin: Run | None) -> dict:
    if run.spec.purpose in HEALTHY:
        return judge_hf(run, cfg, every, twin)
    if run.spec.purpose == "eureka":
        return judge_eureka(run, cfg, every, twin)
    return judge_collapse(run, cfg, every, twin)


def rows_of(runs: list[Run], cfg: AlertConfig, cadences=None) -> list[dict]:
    by_name = {r.name: r for r in runs}
    return [{"kind": "hf" if r.spec.purpose in HEALTHY else r.spec.purpose, "purpose": r.spec.purpose,
             **judge(r, cfg, every, twin_of(r, by_name))}
            for r in runs for every in (cadences or everys(r)) if every in everys(r)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", default="report", choices=sorted(SETS))
    parser.add_argument("--show", help="print the alerts of this run at --every with the defaults")
    parser.add_argument("--every", default="default", help="an integer, or default (the per-family cadence)")
    parser.add_argument("--markdown", action="store_true", help="print the tables (evaluation.tables)")
    parser.add_argument("--json", type=Path, help="write every judged row here")
    args = parser.parse_args()
    if args.show:
        path = args.runs / args.show
        if not (path / "run.json").is_file():
            recorded = sorted(p.parent.name for p in args.runs.glob("*/run.json"))
            parser.error(f"--show {args.show}: {path} holds no recorded run (no run.json); give the name of a run "
                         f"folder under {args.runs}" + (f", one of: {', '.join(recorded)}" if recorded else ""))
        run = load_run(path)
        every = args.every if args.every == "default" else int(args.every)
        for a in replay_run(run, AlertConfig(), every):
            print(f"{a.step:5d} {a.status:8s} {a.level:8s} {a.kind:20s} {a.where:10s} since {a.since}  {a.message}")
        return
    runs = load_runs(args.runs, SETS[args.set])
    rows = rows_of(runs, AlertConfig())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{args.set}: {len(runs)} runs of {len(SETS[args.set])} planned (boundary lr {BOUNDARY_LR:g})")
    if args.markdown:
        from evaluation import tables

        for table in (tables.collapse_table, tables.damage_table, tables.runs_table, tables.eureka_table,
                      tables.eureka_runs_table, tables.healthy_table):
            print("\n".join(table(rows)) + "\n")


if __name__ == "__main__":
    main()
