"""The goals judged per run, and the headline table: pooled over the runs, each run counted once, with 95%
Wilson intervals.

A run's verdict on a goal reads its judged rows (:func:`evaluation.detectors.rows_of`, one per cadence it is
replayed at): True (met), False (not met) or None (the goal does not apply to it). A headline counts each run
once, whatever its cadences: a goal "at every cadence" is one verdict over all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GOALS", "Goal", "headline_table", "tally", "verdicts", "wilson"]

Rows = dict  # a run's judged rows by cadence ("default", 2, 5, 10, 20)


def _collapse(rows: Rows, test: Callable[[dict], bool | None]) -> bool | None:
    d = rows.get("default")
    if d is None or d["kind"] != "collapse":
        return None
    return test(d)


def _eureka(rows: Rows, test: Callable[[dict], bool | None], twin: str = "") -> bool | None:
    d = rows.get("default")
    if d is None or d["kind"] != "eureka" or d["twin"] != twin:
        return None
    return test(d)


def _healthy(rows: Rows, test: Callable[[dict], bool], purpose: str = "healthy") -> bool | None:
    """A healthy run from scratch (``purpose="healthy"``) or a fine-tune of a model with sinks (``"sinks"``)."""
    d = rows.get("default")
    return None if d is None or d["kind"] != "hf" or d["twin"] or d.get("purpose", "healthy") != purpose \
        else test(d)


def _with_jump(rows: Rows, test: Callable[[dict], bool]) -> bool | None:
    return _eureka(rows, lambda d: None if d["jump"] is None else test(d))


@dataclass(frozen=True)
class Goal:
    key: str
    text: str
    verdict: Callable[[Rows], bool | None]


GOALS = (
    Goal("collapse_recorded", "runs with a layer collapse: every collapsed layer gets its own layer's collapse "
         "record from 10 steps before to 50 after its onset",
         lambda rs: _collapse(rs, lambda d: d["caught"] if d["onset"] is not None else None)),
    Goal("no_record_without_collapse", "runs without a layer collapse: no layer collapse record",
         lambda rs: _collapse(rs, lambda d: not d["quiet_record"] if d["onset"] is None else None)),
    Goal("no_false_record", "collapse runs: no false layer record (on a layer without a collapse, or outside its "
         "window)", lambda rs: _collapse(rs, lambda d: not d["false_records"])),
    Goal("heads_recorded", "runs with a head collapse: every collapsed head gets its own head's record within the "
         "same window", lambda rs: _collapse(rs, lambda d: all(x["in_time"] for x in d["heads"]) if d["heads"]
                                             else None)),
    Goal("alert_before_damage", "runs the twin test calls damaged: a collapse alert before the damage begins",
         lambda rs: _collapse(rs, lambda d: d["alarm_before_damage"] if d["damaged"] else None)),
    Goal("no_critical_without_damage", "collapse runs the twin test does not call damaged (twins included): no "
         "critical record", lambda rs: _collapse(rs, lambda d: not d["critical"] if not d["damaged"] else None)),
    Goal("plateau_before_jump", "Eureka runs with a jump: the plateau flagged before it",
         lambda rs: _with_jump(rs, lambda d: d["plateau_in_time"])),
    Goal("plateau_every_cadence", "... at every cadence",
         lambda rs: _with_jump(rs, lambda d: all(r["plateau_in_time"] for r in rs.values()))),
    Goal("moment_within_2", "Eureka runs with a jump: the moment within 2 sampling intervals of it",
         lambda rs: _with_jump(rs, lambda d: d["offset"] is not None and abs(d["offset"]) <= 2)),
    Goal("no_false_moment", "Eureka runs: no moment on the plateau, at any cadence",
         lambda rs: _eureka(rs, lambda d: all(r["false_moments"] == 0 for r in rs.values()))),
    Goal("normsoftmax_flagged", "NormSoftmax Eureka twins with a jump: the plateau flagged before it",
         lambda rs: _eureka(rs, lambda d: None if d["jump"] is None else d["plateau_in_time"], twin="normsoftmax")),
    Goal("finetune_quiet", "fine-tunes of models with attention sinks: no warning or critical record",
         lambda rs: _healthy(rs, lambda d: not d["bad"], "sinks")),
    Goal("finetune_sinks_info", "... their sinks reported at info level (attention_sink)",
         lambda rs: _healthy(rs, lambda d: d["sinks"] > 0, "sinks")),
    Goal("finetune_no_plateau", "fine-tunes of models with attention sinks: no plateau alert",
         lambda rs: _healthy(rs, lambda d: not d["plateau_alerts"], "sinks")),
    Goal("healthy_no_critical", "healthy runs from scratch: no critical record",
         lambda rs: _healthy(rs, lambda d: not d["critical"])),
    Goal("healthy_no_warning", "healthy runs from scratch: no warning or critical alert",
         lambda rs: _healthy(rs, lambda d: not d["bad"])),
    Goal("healthy_no_plateau", "healthy runs from scratch: no plateau alert",
         lambda rs: _healthy(rs, lambda d: not d["plateau_alerts"])),
    Goal("healthy_plateau_by_twin", "healthy runs from scratch with a NormSoftmax twin: no plateau alert that the "
         "twin does not confirm (the twin leaves the plateau's level no sooner)",
         lambda rs: _healthy(rs, lambda d: None if not d.get("has_twin") else
                             not (d["plateau_alerts"] and d["plateau_real"] is False))),
    Goal("records_per_head", "every run: at most 3 records of one kind on one head or layer, at every cadence",
         lambda rs: all(r["records"] <= 3 for r in rs.values())),
)


def verdicts(rows: Rows) -> dict[str, bool]:
    """A run's verdict on every goal that applies to it."""
    out = {g.key: g.verdict(rows) for g in GOALS}
    return {k: bool(v) for k, v in out.items() if v is not None}


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion k / n."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def tally(judged: dict[str, dict[str, bool]], key: str) -> tuple[int, int]:
    """``judged``: run -> its verdicts. (The runs the goal ``key`` applies to, how many of them meet it.)"""
    mine = [v[key] for v in judged.values() if key in v]
    return len(mine), sum(mine)


def headline_table(judged: dict[str, dict[str, bool]]) -> list[str]:
    """``judged``: run -> its verdicts. One line per goal: the runs it applies to, how many meet it, the share
    and its 95% Wilson interval, and the runs that do not."""
    out = ["| goal | runs | met | share | 95% interval | not met |", "|---|---|---|---|---|---|"]
    for g in GOALS:
        mine = {run: v[g.key] for run, v in judged.items() if g.key in v}
        n, k = tally(judged, g.key)
        lo, hi = wilson(k, n)
        share = f"{k / n:.1%}" if n else "-"
        interval = f"{lo:.1%}-{hi:.1%}" if n else "-"
        missed = ", ".join(sorted(run for run, ok in mine.items() if not ok)) or "-"
        out.append(f"| {g.text} | {n} | {k} | {share} | {interval} | {missed} |")
    return out
