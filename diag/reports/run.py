"""``python -m diag report LOGDIR``: one self-contained HTML page of a live run.

Read from the run's ``metrics.jsonl`` and ``alerts.jsonl`` only (no TensorBoard, no model):

* the loss, and one chart per signal the catalog puts in the report (:mod:`diag.catalog.metrics`)
  with a line per layer (for a per-head metric, the statistic across heads that moves towards
  trouble), the alert episodes in a strip above each, a lane per level;
* the alert timeline (each kind's episodes) and every alert with its advice (the message's own, else the
  catalog's, :mod:`diag.catalog.alerts`) and a link to its kind's docs section;
* heatmaps over time: every head (rows) at every sampled step for the catalog's heatmap
  metrics (sigma_1, SEC and the attention entropy).

Every chart spans the whole run (:func:`frame_of`) and the charts stand in a grid at the page's width
(:mod:`diag.reports.charts`). Figures are inline PNGs (matplotlib, Agg canvas), so the page is one file that
opens anywhere.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diag.catalog.alerts import ALERTS, advice
from diag.catalog.metrics import METRICS, chart_stat, metrics_with
from diag.catalog.tags import parse_tag
from diag.errors import ConfigError
from diag.outputs.images import finite_range
from diag.reports.charts import Frame, Line, layer_colours, line_chart, steps_heatmap, timeline
from diag.reports.html import LEVEL_COLOURS, docs_link, grid, inline_img, page, table

__all__ = ["MOMENTS", "Run", "alert_episodes", "frame_of", "read_run", "split_advice", "write_run_report"]

@dataclass
class Run:
    """What a run folder holds: ``series[tag] = {step: value}`` (None for a non-finite value) and the alerts."""

    folder: Path
    series: dict[str, dict[int, float | None]] = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)

    def layers(self) -> list[str]:
        found = {p.layer for p in map(parse_tag, self.series) if p is not None and p.layer}
        return sorted(found)

    def curve(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        points = sorted(self.series.get(tag, {}).items())
        steps = np.array([s for s, _ in points], dtype=np.int64)
        return steps, np.array([math.nan if v is None else v for _, v in points], dtype=np.float64)


def _jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}, line {number}: not JSON ({err.msg}); the file is not one a Monitor "
                              "wrote, or it was edited: pass the run folder a Monitor wrote") from None
    return rows


def read_run(folder: str | Path) -> Run:
    """Read ``metrics.jsonl`` (needed) and ``alerts.jsonl`` (when present) of a run folder."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not folder.exists() else "holds no metrics.jsonl"
        raise ConfigError(f"{folder} {what}; pass the logdir of a Monitor run (the folder with metrics.jsonl "
                          "and alerts.jsonl), e.g. python -m diag report runs/demo")
    run = Run(folder)
    for row in _jsonl(metrics):
        run.series.setdefault(str(row["tag"]), {})[int(row["step"])] = row["value"]
    if not run.series:
        raise ConfigError(f"{metrics} is empty: the run has not reached its first sampled step yet")
    alerts = folder / "alerts.jsonl"
    if alerts.is_file():
        run.alerts = sorted(_jsonl(alerts), key=lambda a: a["step"])
    return run


MOMENTS = ("eureka_moment", "large_early_updates", "gradient_overflow")  # alerts with no episode: one step


def alert_episodes(alerts: Sequence[dict], end: int) -> list[tuple[str, str, str, int, int]]:
    """(level, kind, where, first step, last step) of every episode: from a firing record's ``since`` (or its
    step) to the step of its ``resolved`` record of the same kind and place, or to ``end`` (the run's last
    step) while unresolved. A moment (:data:`MOMENTS`) is its own step."""
    open_: dict[tuple[str, str], dict] = {}
    out = []
    for a in sorted(alerts, key=lambda a: a["step"]):
        key = (a["kind"], a.get("where", ""))
        start = a.get("since") if a.get("since") is not None else a["step"]
        if a["kind"] in MOMENTS:
            out.append((a["level"], a["kind"], key[1], int(a["step"]), int(a["step"])))
        elif a.get("status") == "resolved":
            first = open_.pop(key, None)
            if first is not None:
                out.append((first["level"], a["kind"], key[1], int(first["start"]), int(a["step"])))
        elif key not in open_:
            open_[key] = {"level": a["level"], "start": start}
    out += [(v["level"], kind, where, int(v["start"]), int(end)) for (kind, where), v in open_.items()]
    return sorted(out, key=lambda e: (e[3], e[1], e[2]))


def _spacing(run: Run) -> int:
    steps = sorted(run.series.get("loss") or next(iter(run.series.values())))
    return int(np.median(np.diff(steps))) if len(steps) > 1 else 1


def frame_of(run: Run) -> Frame:
    """The whole run, for every chart: its first and last step (of ``metrics.jsonl``, or a later alert's), its
    alert episodes and a colour per layer."""
    steps = [s for series in run.series.values() for s in series] + [int(a["step"]) for a in run.alerts]
    last = max(steps)
    return Frame(min(steps), last, _spacing(run), tuple(alert_episodes(run.alerts, last)),
                 layer_colours(run.layers()))


def _curves(run: Run, frame: Frame, metric: str, stat: str | None) -> str | None:
    tags = {la: f"{metric}/{la}/{stat}" if stat else f"{metric}/{la}" for la in run.layers()}
    lines = [Line(la, *run.curve(tag)) for la, tag in tags.items() if tag in run.series]
    if not lines:
        return None
    what = f"{metric} ({stat} over heads)" if stat else metric
    unit = METRICS[metric].unit
    fig = line_chart(frame, lines, title=f"{what}, a line per layer", ylabel=f"{metric} ({unit})" if unit else metric,
                     log=METRICS[metric].log)
    return inline_img(fig, f"{what} per layer over the sampled steps; above: alert episodes by level")


def _heatmap_over_time(run: Run, frame: Frame, metric: str) -> str | None:
    rows = sorted({t for t in run.series if (p := parse_tag(t)) and p.metric == metric and p.head is not None},
                  key=lambda t: (parse_tag(t).layer, parse_tag(t).head))
    per_head = bool(rows)
    if not rows:
        stat = chart_stat(metric)
        rows = [f"{metric}/{la}/{stat}" for la in run.layers() if f"{metric}/{la}/{stat}" in run.series]
    if not rows:
        return None
    steps = sorted({s for t in rows for s in run.series[t]})
    grid = np.array([[np.nan if run.series[t].get(s) is None else run.series[t][s] for s in steps] for t in rows])
    parsed = [parse_tag(t) for t in rows]
    labels = [f"{p.layer}/{p.part}" if per_head else p.layer for p in parsed]
    title = METRICS[metric].label
    lo, hi = METRICS[metric].colour_range(*finite_range(grid))
    fig = steps_heatmap(frame, grid, steps, labels, title=f"{title}, {'every head' if per_head else 'per layer'}"
                        " over the run", ylabel="layer/head" if per_head else "layer", cbar=title, lo=lo, hi=hi)
    return inline_img(fig, f"{title}: rows are heads, each sample a cell at its step")


def _timeline(run: Run, frame: Frame) -> str | None:
    if not run.alerts:
        return None
    kinds = sorted({a["kind"] for a in run.alerts})
    return inline_img(timeline(frame, kinds), "each alert episode from its start to its end, by kind; colour: level",
                      wide=True)


def _loss(run: Run, frame: Frame) -> str | None:
    if "loss" not in run.series:
        return None
    fig = line_chart(frame, [Line("loss", *run.curve("loss"))], title="training loss", ylabel="loss")
    return inline_img(fig, "training loss at the sampled steps; above: alert episodes by level")


def split_advice(message: str) -> tuple[str, str | None]:
    """A message's account and its advice (after "What to do:"), or (message, None) when it gives none."""
    what, sep, todo = message.partition(" What to do: ")
    return (what, todo) if sep else (message, None)


def _advice(a: dict) -> str:
    """What to do about one record, said once: the message's own advice, else the catalog's (a resolved record:
    nothing, its episode ended)."""
    todo = split_advice(a["message"])[1]
    if todo is not None:
        return todo
    if a.get("status") == "resolved":
        return "nothing: the episode ended"
    return advice(a["kind"], a.get("since")) or "see the docs"


def _alert_table(run: Run) -> str:
    """Every record once: what happened, what to do (:func:`_advice`) and a link to the kind's docs section."""
    if not run.alerts:
        return "<p>No alert was raised in this run.</p>"
    rows = []
    for a in run.alerts:
        entry = ALERTS.get(a["kind"])
        anchor = (entry.anchor or entry.name) if entry is not None else "the-kinds"
        rows.append([a["step"], a["level"], a["kind"], a.get("where") or "model", split_advice(a["message"])[0],
                     html.escape(_advice(a)) + "<br>" + docs_link("alerts.md", anchor, f"docs: {a['kind']}")])
    return table(["step", "level", "kind", "where", "message", "what to do"], rows, raw=(5,),
                 classes=[a["level"] for a in run.alerts])


def _constants(run: Run) -> str:
    rows = []
    for la in run.layers():
        cells = [run.curve(f"{m.name}/{la}")[1] for m in metrics_with("text")]
        if any(c.size for c in cells):
            rows.append([la, *(f"{np.nanmean(c):.4g}" if c.size else "-" for c in cells)])
    if not rows:
        return ""
    return "<h2>The attention sample</h2>" + table(["layer", *(m.label for m in metrics_with("text"))], rows)


def write_run_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the run in ``folder`` to ``out`` (default ``folder/report.html``)."""
    run = read_run(folder)
    out = Path(out) if out is not None else run.folder / "report.html"
    frame = frame_of(run)
    steps = sorted({s for series in run.series.values() for s in series})
    levels = {lv: sum(a["level"] == lv for a in run.alerts) for lv in LEVEL_COLOURS}
    body = [f"<p>Run <b>{html.escape(str(run.folder))}</b>: {len(run.layers())} attention layers, sampled steps "
            f"{steps[0]}..{steps[-1]} ({len(steps)} samples); alerts: "
            + ", ".join(f"<span class='{lv}'>{n} {lv}</span>" for lv, n in levels.items()) + ".</p>",
            "<h2>Curves</h2>",
            grid([_loss(run, frame), *(_curves(run, frame, m.name, m.stat) for m in metrics_with("report"))]),
            "<h2>Alerts</h2>", grid([_timeline(run, frame)]), _alert_table(run),
            "<h2>Heatmaps over time</h2>",
            grid(_heatmap_over_time(run, frame, m.name) for m in metrics_with("heatmap")),
            _constants(run)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page("attnscope run report", body), encoding="utf-8")
    return out
