"""``python -m diag report LOGDIR``: one self-contained HTML page of a live run.

Read from the run's ``metrics.jsonl`` and ``alerts.jsonl`` only (no TensorBoard, no model):

* the loss, and one chart per signal the catalog puts in the report (:mod:`diag.catalog.metrics`)
  with a line per layer (for a per-head metric, the statistic across heads that moves towards
  trouble), alert episodes shaded in the colour of their level;
* heatmaps over time: every head (rows) at every sampled step (columns) for the catalog's heatmap
  metrics (sigma_1, SEC and the attention entropy);
* the alert timeline (a chart) and every alert with its advice and a link to its docs.

Figures are inline PNGs (matplotlib, Agg canvas), so the page is one file that opens anywhere.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diag.catalog.metrics import METRICS, chart_stat, metrics_with
from diag.catalog.tags import parse_tag, parse_where
from diag.errors import ConfigError
from diag.outputs.figures import figure, grid_figure
from diag.outputs.images import finite_range
from diag.reports.html import LEVEL_COLOURS, docs_link, inline_img, integer_steps, page, table

__all__ = ["ADVICE", "MOMENTS", "Run", "alert_episodes", "read_run", "split_advice", "write_run_report"]

# kind -> what to do, in one line (the long form, with the evidence, is in docs/alerts.md)
ADVICE = {
    "malignant_collapse": "go back to a checkpoint from before it and restart with warmup, a lower learning "
                          "rate, QK-norm or a spectral step bound",
    "benign_collapse": "usually nothing: sparse but full-rank heads train well; watch whether it spreads or "
                       "turns malignant",
    "uniform_attention": "look at the head; low-rank attention across layers is rank collapse",
    "eureka_plateau": "rule out a data or label bug first; then NormSoftmax, or train longer",
    "eureka_moment": "nothing to do: the plateau ended",
    "nonfinite_loss": "check the data of that step, lower the learning rate, clip gradients, check loss scaling",
    "nonfinite_weights": "check the data of that step, lower the learning rate, clip gradients, check loss scaling",
    "nonfinite_gradients": "check the data of that step, lower the learning rate, clip gradients, check loss scaling",
    "gradient_overflow": "nothing if rare; if it repeats at every sample, look for non-finite float32 "
                         "gradients or use bf16",
    "loss_spike": "inspect the batch; clip gradients; if attn_max_logit climbs too, QK-norm or a lower "
                  "learning rate",
}


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


def _mark_alerts(ax, run: Run, layer_of: str | None = None) -> None:
    """Shade each alert episode from its start to its resolved record (an open one to the run's last step) in
    its level's colour; a moment is a thin band at its step; one legend entry per level."""
    spacing, seen = _spacing(run), set()
    end = max((max(v) for v in run.series.values() if v), default=0)
    for level, _, where_text, first, last in alert_episodes(run.alerts, end):
        where = parse_where(where_text)
        if layer_of is not None and where is not None and where[0] != layer_of:
            continue
        colour = LEVEL_COLOURS.get(level, "#888888")
        label = None if level in seen else f"{level} alert"
        seen.add(level)
        ax.axvspan(first - spacing / 4, last + spacing / 4, color=colour, alpha=0.15, lw=0, label=label)


def _curves(run: Run, metric: str, stat: str | None) -> str | None:
    layers = [la for la in run.layers() if (f"{metric}/{la}/{stat}" if stat else f"{metric}/{la}") in run.series]
    if not layers:
        return None
    fig = figure(8, 3.6)
    ax = fig.subplots()
    for la in layers:
        ax.plot(*run.curve(f"{metric}/{la}/{stat}" if stat else f"{metric}/{la}"), marker=".", label=la)
    _mark_alerts(ax, run)
    what = f"{metric} ({stat} over heads)" if stat else metric
    ax.set(title=f"{what}, a line per layer", xlabel="step", ylabel=what)
    if METRICS[metric].log:
        ax.set_yscale("log")
    integer_steps(ax)
    ax.legend(fontsize="small", ncol=max(1, len(layers) // 6), loc="best")
    return inline_img(fig, f"{what} per layer over the sampled steps; shaded: alert episodes")


def _heatmap_over_time(run: Run, metric: str) -> str | None:
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
    fig = grid_figure(grid, title=f"{title}, {'every head' if per_head else 'per layer'} over time", rows=labels,
                      cols=[str(s) for s in steps], xlabel="sampled step", ylabel="layer/head" if per_head else
                      "layer", cbar=title, lo=lo, hi=hi, annotate=False)
    return inline_img(fig, f"{title}: rows are heads, columns sampled steps")


def _timeline(run: Run) -> str | None:
    if not run.alerts:
        return None
    kinds = sorted({a["kind"] for a in run.alerts})
    fig = figure(8, 1.2 + 0.35 * len(kinds))
    ax = fig.subplots()
    for rank, (level, colour) in enumerate(LEVEL_COLOURS.items()):
        chosen = [a for a in run.alerts if a["level"] == level]
        if chosen:  # the most severe on top: a layer's critical record shares its step with its heads' warnings
            ax.scatter([a["step"] for a in chosen], [kinds.index(a["kind"]) for a in chosen], color=colour,
                       label=level, marker="|" if level == "info" else "o", s=60, zorder=3 + len(LEVEL_COLOURS) - rank)
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set(title="alerts over the run", xlabel="step")
    integer_steps(ax)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return inline_img(fig, "each alert at its step, by kind; colour: level")


def split_advice(message: str) -> tuple[str, str | None]:
    """A message's account and its advice (after "What to do:"), or (message, None) when it gives none."""
    what, sep, todo = message.partition(" What to do: ")
    return (what, todo) if sep else (message, None)


def _alert_table(run: Run) -> str:
    """Every record once: what happened, and what to do said once (the message's own advice, else the kind's)."""
    if not run.alerts:
        return "<p>No alert was raised in this run.</p>"
    rows = []
    for a in run.alerts:
        what, todo = split_advice(a["message"])
        advice = todo if todo is not None else ADVICE.get(a["kind"], "see the docs")
        rows.append([a["step"], a["level"], a["kind"], a.get("where") or "model", what,
                     html.escape(advice) + "<br>" + docs_link("alerts.md", "the-kinds", f"docs: {a['kind']}")])
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
    steps = sorted({s for series in run.series.values() for s in series})
    levels = {lv: sum(a["level"] == lv for a in run.alerts) for lv in LEVEL_COLOURS}
    body = [f"<p>Run <b>{html.escape(str(run.folder))}</b>: {len(run.layers())} attention layers, sampled steps "
            f"{steps[0]}..{steps[-1]} ({len(steps)} samples); alerts: "
            + ", ".join(f"<span class='{lv}'>{n} {lv}</span>" for lv, n in levels.items()) + ".</p>",
            "<h2>Alerts</h2>", _timeline(run) or "", _alert_table(run), "<h2>Curves</h2>"]
    if "loss" in run.series:
        fig = figure(8, 3.2)
        ax = fig.subplots()
        ax.plot(*run.curve("loss"), marker=".", color="black", label="loss")
        _mark_alerts(ax, run)
        ax.set(title="training loss", xlabel="step", ylabel="loss")
        integer_steps(ax)
        ax.legend(fontsize="small")
        body.append(inline_img(fig, "training loss at the sampled steps; shaded: alert episodes"))
    body += [c for m in metrics_with("report") if (c := _curves(run, m.name, m.stat))]
    body.append("<h2>Heatmaps over time</h2>")
    body += [h for m in metrics_with("heatmap") if (h := _heatmap_over_time(run, m.name))]
    body.append(_constants(run))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page("attnscope run report", body), encoding="utf-8")
    return out
