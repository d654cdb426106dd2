"""The judged rows of a replay (:func:`evaluation.detectors.rows_of`) as markdown tables: one function per table.

The collapse runs per cadence and one by one (each collapsed layer's onset against its own layer's record,
:mod:`evaluation.matching`), the false records per run and layer, the twin test, the Eureka runs, the plateau's
signals on them, and the healthy runs.
"""

from __future__ import annotations

from evaluation.spec import EVERYS
from evaluation.truth import Run, accuracy_jump, context_free_loss

__all__ = ["collapse_table", "damage_table", "eureka_runs_table", "eureka_table", "false_records_table",
           "healthy_table", "plateau_signals_table", "runs_table"]


def _header(*columns: str) -> list[str]:
    """A markdown table's header row and the row under it."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _frac(rows: list[dict], key: str) -> str:
    return f"{sum(bool(r[key]) for r in rows)}/{len(rows)}"


def _count(rows: list[dict], key: str) -> str:
    return f"{sum(len(r[key]) for r in rows)} ({sum(bool(r[key]) for r in rows)} runs)"


def collapse_table(rows: list[dict]) -> list[str]:
    """One row per cadence over the collapse runs (twins included; no run counted twice at a cadence): the
    layers' collapses against their own layers' records, and the false records."""
    out = _header("every", "runs", "runs with a layer collapse", "... every collapsed layer recorded in its window",
                  "layers collapsed", "... recorded in their window", "... missed, onset within 50 steps of the end",
                  "runs without a layer collapse", "... with a layer record", "false layer records",
                  "false head records", "most records of one kind on one head")
    for every in EVERYS:
        rs = [r for r in rows if r["kind"] == "collapse" and r["every"] == every]
        est = [r for r in rs if r["onset"] is not None]
        none = [r for r in rs if r["onset"] is None]
        layers = [x for r in est for x in r["layers"]]
        out.append(f"| {every} | {len(rs)} | {len(est)} | {_frac(est, 'caught')} | {len(layers)} | "
                   f"{sum(x['in_time'] for x in layers)} | {sum(x['censored'] for x in layers)} | {len(none)} | "
                   f"{_frac(none, 'quiet_record')} | {_count(rs, 'false_records')} | "
                   f"{_count(rs, 'false_head_records')} | {max((r['records'] for r in rs), default=0)} |")
    return out


def _layers_cell(judged: list[dict]) -> str:
    """``L01 120 -> 118`` per layer: its onset, then its record (``-``: none in the window)."""
    return ", ".join(f"{x['where']} {x['onset']} -> {'-' if x['record'] is None else x['record']}" for x in judged) \
        or "-"


def runs_table(rows: list[dict]) -> list[str]:
    """The collapse runs one by one at the default cadence: each collapsed layer's onset and its record, the false
    records, the damage."""
    out = _header("run", "layers: onset -> record", "false layer records", "damaged (from)", "first collapse alert",
                  "other warning or critical alerts")
    for r in rows:
        if r["kind"] != "collapse" or r["every"] != "default":
            continue
        dmg = "-" if r["damaged"] is None else f"yes ({r['damage_from']})" if r["damaged"] else "no"
        false = ", ".join(f"{x['where']}@{x['step']}" for x in r["false_records"]) or "-"
        other = [a for a in r["bad"] if not a.startswith("malignant_collapse")]
        out.append(f"| {r['run']} | {_layers_cell(r['layers'])} | {false} | {dmg} | "
                   f"{'-' if r['alarm'] is None else r['alarm']} | {', '.join(other) or '-'} |")
    return out


def damage_table(rows: list[dict]) -> list[str]:
    """The twin test at the default cadence: damaged runs and whether a collapse alert came before the damage."""
    out = _header("lr", "runs with a twin", "damaged", "collapse alert before the damage", "alerts on undamaged runs",
                  "alerts on twins")
    rs = [r for r in rows if r["kind"] == "collapse" and r["every"] == "default"]
    for lr in sorted({r["lr"] for r in rs}):
        mine = [r for r in rs if r["lr"] == lr and not r["twin"] and r["damaged"] is not None]
        twins = [r for r in rs if r["lr"] == lr and r["twin"]]
        dmg = [r for r in mine if r["damaged"]]
        quiet = [r for r in mine if not r["damaged"]]
        out.append(f"| {lr:g} | {len(mine)} | {len(dmg)} | {_frac(dmg, 'alarm_before_damage')} | "
                   f"{sum(r['alarm'] is not None for r in quiet)}/{len(quiet)} | "
                   f"{sum(r['alarm'] is not None for r in twins)}/{len(twins)} |")
    return out


def _within(rows: list[dict], n: int) -> str:
    return f"{sum(r['offset'] is not None and abs(r['offset']) <= n for r in rows)}/{len(rows)}"


def eureka_table(rows: list[dict]) -> list[str]:
    """Per cadence; the moments' timing over all runs with a jump, and over those whose accuracy had settled by
    the end (evaluation.truth.settled: a run cut off during its jump has no final accuracy to be halfway to)."""
    out = _header("every", "softmax runs with a jump", "plateaus flagged before the jump", "moments within 2 intervals",
                  "within 4", "... of the runs whose accuracy settled: within 2", "within 4", "false moments",
                  "NormSoftmax runs flagged", "moments within 2 intervals of the jump's rise (25-75%)")
    for every in EVERYS:
        rs = [r for r in rows if r["kind"] == "eureka" and r["every"] == every]
        soft = [r for r in rs if not r["twin"] and r["jump"] is not None]
        done = [r for r in soft if r["settled"]]
        norm = [r for r in rs if r["twin"] == "normsoftmax"]
        out.append(f"| {every} | {len(soft)} | {_frac(soft, 'plateau_in_time')} | {_within(soft, 2)} | "
                   f"{_within(soft, 4)} | {_within(done, 2)} | {_within(done, 4)} | "
                   f"{sum(r['false_moments'] for r in rs if not r['twin'])} | "
                   f"{sum(r['plateau'] is not None for r in norm)}/{len(norm)} | "
                   f"{sum(r['offset_rise'] is not None and r['offset_rise'] <= 2 for r in soft)}/{len(soft)} |")
    return out


def eureka_runs_table(rows: list[dict]) -> list[str]:
    """The Eureka runs one by one at the default cadence: jump, plateau, moment and its offset in intervals."""
    out = _header("run", "accuracy jump", "its rise (25-75%)", "settled by the end", "plateau flagged", "moment",
                  "offset (intervals)")
    for r in rows:
        if r["kind"] != "eureka" or r["every"] != "default":
            continue
        cell = {k: "-" if r[k] is None else r[k] for k in ("jump", "plateau", "moment")}
        off = "-" if r["offset"] is None else f"{r['offset']:+.1f}"
        rise = "-" if r["rise"] is None else f"{r['rise'][0]}-{r['rise'][1]}"
        out.append(f"| {r['run']} | {cell['jump']} | {rise} | {'yes' if r['settled'] else 'no'} | {cell['plateau']} | "
                   f"{cell['moment']} | {off} |")
    return out


def _avg(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


def plateau_signals_table(runs: list[Run]) -> list[str]:
    """The entry tests' signals of ``eureka_plateau`` on the Eureka runs, averaged over steps 200 to the accuracy
    jump (the whole run without one), every 10 steps: the most uniform layer's least uniform head (entropy over
    uniform's) and the least Q/K:V gradient ratio of a layer: what tells a NormSoftmax plateau from a softmax one."""
    from diag.detectors.plateau import _layer_signals

    out = _header("run", "attention", "jump", "most uniform layer: least head's entropy / uniform's",
                  "least Q/K:V gradient ratio of a layer")
    for run in runs:
        if run.spec.task != "vit" or run.spec.steps <= 1000:
            continue
        jump = accuracy_jump(run.info)
        end = jump if jump is not None else run.spec.steps
        obs = [o for o in run.obs if 200 <= o.step < end and o.step % 10 == 0 and o.loss is not None]
        signals = [_layer_signals(o).values() for o in obs]
        u = [max((v[1] for v in s if v[1] == v[1]), default=float("nan")) for s in signals]
        q = [min((v[0] for v in s if v[0] == v[0]), default=float("nan")) for s in signals]
        u, q = [x for x in u if x == x], [x for x in q if x == x]
        out.append(f"| {run.name} | {run.spec.twin or 'softmax'} | {'-' if jump is None else jump} | {_avg(u)} | "
                   f"{_avg(q)} |")
    return out


def healthy_table(rows: list[dict]) -> list[str]:
    """The healthy runs one by one: their plateau alerts with the twin's verdict, and their other alerts."""
    out = _header("run", "plateau alerts", "the NormSoftmax twin says",
                  f"the plateau sits at the context-free loss ({context_free_loss():.2f} nats)",
                  "warning or critical alerts", "... of those, the ground truth finds the head or layer in that state")
    for r in rows:
        if r["kind"] == "hf" and not r["twin"]:
            truth = {None: "-", True: "a real attention plateau", False: "no attention plateau"}[r["plateau_real"]]
            if r["stuck"]:
                truth += " (neither it nor the run leaves the plateau's level: stuck, the cause untested)"
            free = {None: "-", True: "yes: stuck, not a healthy run", False: "no"}[r.get("context_free")]
            out.append(f"| {r['run']} | {r['plateau_alerts']} | {truth if r['plateau_alerts'] else '-'} | "
                       f"{free if r['plateau_alerts'] else '-'} | {', '.join(r['bad']) or 'none'} | "
                       f"{(', '.join(r['bad_in_state']) or 'none') if r['bad'] else '-'} |")
    return out


def false_records_table(rows: list[dict]) -> list[str]:
    """Every false layer collapse record, per run and per layer, at each cadence."""
    out = ["| run | every | kind | layer | steps |", "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "collapse":
            continue
        by_layer: dict[str, list[int]] = {}
        for x in r["false_records"]:
            by_layer.setdefault(x["where"], []).append(x["step"])
        out += [f"| {r['run']} | {r['every']} | malignant_collapse | {where} | {', '.join(map(str, steps))} |"
                for where, steps in sorted(by_layer.items())]
    return out
