"""The reports' charts as a person reads them, checked on the matplotlib figures themselves (not their pixels):
every step axis spans the whole run, every shading has its colour in the legend (levels never blend), legends
sit beside the axes, a single checkpoint gets words instead of a chart, and the figures fill the page's width."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matplotlib.colors import to_hex

from diag.offline.series import analyze_checkpoints
from diag.reports import checkpoints as checkpoint_report
from diag.reports import run as run_report
from diag.reports.charts import MOST_NAMED, Line, line_chart, timeline
from diag.reports.html import STYLE
from diag.reports.run import Run, frame_of, write_run_report
from tests.support import zoo

LEVELS = ("critical", "warning", "info")


def _run(last: int, layers: int, alerts: list[dict], every: int = 10) -> Run:
    """A run sampled every ``every`` steps up to ``last`` (its last step), with ``alerts``."""
    series: dict[str, dict[int, float | None]] = {"loss": {}}
    for step in range(0, last + 1, every):
        series["loss"][step] = 3.0 - step / (10 * last)
        for i in range(layers):
            series.setdefault(f"qk_sigma1/L{i:02d}/max", {})[step] = 1.0 + i + step / 10
            series.setdefault(f"qk_sigma1/L{i:02d}/H00", {})[step] = 1.0 + i + step / 10
            series.setdefault(f"attn_entropy/L{i:02d}/min", {})[step] = 2.0 - step / (2 * last)
    return Run(Path("."), series, alerts)


def _alert(step: int, kind: str, level: str, where: str = "L00", status: str = "firing", since: int | None = None):
    return {"step": step, "kind": kind, "level": level, "where": where, "status": status,
            "since": step if since is None else since, "message": f"{kind} at {step}", "values": {}}


# an info, a warning and a critical episode over the same steps, the last alert at step 200 of a run to 290
OVERLAPPING = [_alert(0, "large_early_updates", "info", ""),
               _alert(20, "qk_clip", "info"), _alert(120, "qk_clip", "info", status="resolved", since=20),
               _alert(40, "eureka_plateau", "warning"),
               _alert(60, "malignant_collapse", "warning", "L00/H01"),
               _alert(100, "collapse_damage", "critical"), _alert(200, "collapse_damage", "info", status="resolved",
                                                                 since=100)]


def _report_figures(run: Run, tmp_path: Path, monkeypatch) -> list:
    """Every figure the run report draws, as matplotlib Figures."""
    drawn = []
    monkeypatch.setattr(run_report, "read_run", lambda folder: run)
    monkeypatch.setattr(run_report, "inline_img", lambda fig, caption, wide=False: drawn.append(fig) or "<img>")
    write_run_report(tmp_path, tmp_path / "report.html")
    return drawn


def _step_axes(fig) -> list:
    """The axes over steps: all but colour bars."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def test_every_chart_of_the_run_report_spans_the_run_to_its_last_step(tmp_path, monkeypatch):
    """The last alert is at step 200 of a run sampled to 290: the alert timeline, every curve and every heatmap
    reach 290 (and start at 0), so the charts line up."""
    figures = _report_figures(_run(290, 2, OVERLAPPING), tmp_path, monkeypatch)
    assert len(figures) >= 5  # the loss, a signal or two, the timeline, heatmaps
    for fig in figures:
        for ax in _step_axes(fig):
            lo, hi = ax.get_xlim()
            assert lo <= 0 and hi >= 290, (ax.get_title(), (lo, hi))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(last=st.integers(20, 5000), every=st.sampled_from([1, 5, 10, 50]), data=st.data())
def test_the_frame_is_the_whole_run_whatever_the_alerts_reach(last, every, data):
    last = last - last % every
    steps = st.integers(0, last)
    alerts = [_alert(s, "loss_spike", level) for s, level in
              data.draw(st.lists(st.tuples(steps, st.sampled_from(LEVELS)), max_size=6))]
    run = _run(last, 1, alerts, every)
    frame = frame_of(run)
    assert (frame.first, frame.last, frame.spacing) == (0, last, every)
    fig = timeline(frame, sorted({a["kind"] for a in alerts}) or ["loss_spike"])
    lo, hi = fig.axes[0].get_xlim()
    assert lo <= 0 and hi >= last


def _shadings(fig) -> list:
    """The filled patches of the figure's axes (episode bars, spans): not legend handles, not the backgrounds."""
    return [p for ax in fig.axes for p in ax.patches]


def _legend_colours(fig) -> set[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    return {to_hex(h.get_facecolor(), keep_alpha=True) for lg in legends for h in lg.legend_handles
            if hasattr(h, "get_facecolor")}


def _overlap(a, b) -> bool:
    ba, bb = a.get_window_extent(), b.get_window_extent()
    return ba.x0 < bb.x1 and bb.x0 < ba.x1 and ba.y0 < bb.y1 and bb.y0 < ba.y1


def test_every_shading_has_its_colour_in_the_legend_and_levels_never_blend(tmp_path, monkeypatch):
    """Info, warning and critical episodes over the same steps: each shading's colour is a legend entry's, and
    where shadings of two colours meet, both are opaque (the one on top is seen, in a colour the legend names),
    never two translucent colours blending into one the legend lacks."""
    figures = _report_figures(_run(290, 2, OVERLAPPING), tmp_path, monkeypatch)
    shaded = [fig for fig in figures if _shadings(fig)]
    assert len(shaded) >= 3, "the loss, the signals and the timeline show the episodes"
    for fig in shaded:
        fig.canvas.draw()
        colours = {to_hex(p.get_facecolor(), keep_alpha=True) for p in _shadings(fig)}
        assert len(colours) == 3, colours  # one per level
        assert colours <= _legend_colours(fig), (colours, _legend_colours(fig))
        for ax in fig.axes:
            for a, b in combinations(ax.patches, 2):
                if to_hex(a.get_facecolor(), keep_alpha=True) != to_hex(b.get_facecolor(), keep_alpha=True):
                    assert not _overlap(a, b) or a.get_facecolor()[3] == b.get_facecolor()[3] == 1.0, (a, b)


def _legends_clear_of_the_axes(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            area = ax.get_window_extent(renderer)
            assert box.x1 <= area.x0 or box.x0 >= area.x1 or box.y1 <= area.y0 or box.y0 >= area.y1, (
                ax.get_title(), [t.get_text() for t in legend.get_texts()])


def test_no_legend_of_the_run_report_covers_its_axes(tmp_path, monkeypatch):
    figures = _report_figures(_run(290, 4, OVERLAPPING), tmp_path, monkeypatch)
    assert sum(bool(fig.legends or any(ax.get_legend() for ax in fig.axes)) for fig in figures) >= 3
    for fig in figures:
        _legends_clear_of_the_axes(fig)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([1, 3, MOST_NAMED, MOST_NAMED + 2, 24]), alerts=st.booleans())
def test_legends_sit_beside_the_axes_never_over_a_line(layers, alerts):
    run = _run(100, layers, OVERLAPPING[:4] if alerts else [])
    frame = frame_of(run)
    lines = [Line(la, *run.curve(f"qk_sigma1/{la}/max")) for la in run.layers()]
    for fig, shown in ((line_chart(frame, lines, title="t", ylabel="y"), lines),
                       (line_chart(frame, [Line("loss", *run.curve("loss"))], title="loss", ylabel="loss"), [])):
        _legends_clear_of_the_axes(fig)
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        named = {t.get_text() for lg in legends for t in lg.get_texts()}
        if shown and layers <= MOST_NAMED:
            assert set(run.layers()) <= named  # each layer named beside the chart
        elif shown:
            assert any(ax.get_ylabel() == "layer" for ax in fig.axes)  # a colour bar over depth instead


def _save(tmp_path: Path, steps: list[int]) -> list[Path]:
    case = zoo.nanogpt()
    paths = []
    for step in steps:
        with torch.no_grad():
            for p in case.model.parameters():
                if p.dim() == 2:
                    p.mul_(1.1)
        paths.append(tmp_path / f"step_{step}.pt")
        torch.save({k: v.detach().clone() for k, v in case.model.state_dict().items()}, paths[-1])
    return paths


def test_a_single_checkpoint_gets_words_not_a_series_chart(tmp_path, monkeypatch):
    """One checkpoint is one step: no sigma_1-over-the-series chart (two dots on an axis around one step); the
    page says what the checkpoint holds, with each layer's values."""
    (path,) = _save(tmp_path, [5])
    analysis = analyze_checkpoints([str(path)], heads=4)
    index = checkpoint_report.write_report(analysis, tmp_path / "one")
    page = index.read_text()
    assert not (tmp_path / "one" / "sigma1.png").exists() and "sigma1.png" not in page
    assert not (tmp_path / "one" / "updates.png").exists()
    assert "One checkpoint, step 5" in page and "two or more checkpoints" in page
    sigma = [float(np.max(analysis.spectra[5][la.label]["qk_sigma1"])) for la in analysis.layers]
    assert all(f"<td>{value:.4g}</td>" in page for value in sigma)
    assert "heatmaps.png" in page and "spectra.png" in page


def test_a_series_chart_spans_its_checkpoints_with_the_legend_outside(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(checkpoint_report, "save_png", lambda fig, path: saved.append((path.name, fig)))
    paths = _save(tmp_path, [10, 20, 40])
    checkpoint_report.write_report(analyze_checkpoints([str(p) for p in paths], heads=4), tmp_path / "three")
    figures = dict(saved)
    assert {"sigma1.png", "updates.png"} <= set(figures)
    for name, steps in (("sigma1.png", (10, 40)), ("updates.png", (10, 20))):
        fig = figures[name]
        fig.canvas.draw()
        (ax,) = fig.axes
        lo, hi = ax.get_xlim()
        assert lo <= steps[0] and hi >= steps[1] and hi - lo < 1.2 * (steps[1] - steps[0]), (name, lo, hi)
        (legend,) = fig.legends
        assert not legend.get_window_extent().overlaps(ax.get_window_extent())
    page = (tmp_path / "three" / "index.html").read_text()
    assert "One update" not in page and "One checkpoint" not in page
    two = analyze_checkpoints([str(p) for p in paths[:2]], heads=4)
    page = checkpoint_report.write_report(two, tmp_path / "two").read_text()
    assert "sigma1.png" in page and "updates.png" not in page and "One update, from the checkpoint of step 10" in page


class _Images(HTMLParser):
    """Each <img> with the classes of the elements around it."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.images: list[list[str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(list(self.open))
        else:
            self.open.append(dict(attrs).get("class") or "")

    def handle_endtag(self, tag):
        if tag != "img" and self.open:
            self.open.pop()


def _rules(css: str) -> dict[str, str]:
    return {sel.strip(): body for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)}


def test_the_figures_fill_the_page_width_in_a_grid(tmp_path):
    """Both reports: the page is as wide as the window (no fixed maximum), every figure stands in a grid whose
    columns share the page's width, and each image fills its cell."""
    rules = _rules(STYLE)
    assert "max-width" not in rules["body"]
    assert "display:grid" in rules[".grid"] and "grid-template-columns:repeat(auto-fit" in rules[".grid"]
    assert "width:100%" in rules[".grid img"]
    folder = tmp_path / "run"
    folder.mkdir()
    run = _run(290, 2, OVERLAPPING)
    rows = [{"step": s, "tag": t, "value": v} for t, series in run.series.items() for s, v in series.items()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "alerts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in OVERLAPPING))
    pages = [write_run_report(folder).read_text()]
    paths = _save(tmp_path, [1, 2, 3])
    pages.append(checkpoint_report.write_report(analyze_checkpoints([str(p) for p in paths], heads=4),
                                                tmp_path / "ckpt").read_text())
    for page in pages:
        parser = _Images()
        parser.feed(page)
        assert len(parser.images) >= 4
        assert all("grid" in classes for classes in parser.images), parser.images


@pytest.mark.parametrize("levels", [("info",), ("warning", "info"), LEVELS])
def test_the_strip_has_a_lane_per_level_most_severe_on_top(levels):
    alerts = [_alert(10 * i, "loss_spike", level, f"L00/H{i:02d}") for i, level in enumerate(levels)]
    run = _run(100, 1, alerts)
    frame = frame_of(run)
    assert frame.levels == [lv for lv in LEVELS if lv in levels]
    fig = line_chart(frame, [Line("loss", *run.curve("loss"))], title="loss", ylabel="loss")
    strip = fig.axes[0]
    assert [t.get_text() for t in strip.get_yticklabels()] == frame.levels
    assert strip.get_ylim()[0] > strip.get_ylim()[1]  # the first lane at the top
