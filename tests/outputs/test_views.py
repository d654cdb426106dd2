"""The tag scheme built and parsed in one place, the figures TensorBoard shows, and the live-run report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex

from diag.catalog.metrics import CHART_STAT
from diag.catalog.tags import (
    Tag,
    head_tag,
    histogram_tag,
    layer_label,
    layer_runs,
    layer_tag,
    parse_tag,
    parse_where,
    stat_tag,
)
from diag.cli.main import main
from diag.errors import ConfigError
from diag.outputs.figures import attention_map_figure, layer_head_figures, update_ratio_figure
from diag.outputs.tb_views import alert_events, constants_table, image_options
from diag.reports.html import LEVEL_COLOURS
from diag.reports.run import alert_episodes, read_run, split_advice, write_run_report


def test_every_built_tag_parses_back():
    for layer in (layer_label(3, 12), layer_label(3, 12, cross=True), layer_label(7, 120)):
        assert parse_tag(head_tag("qk_sigma1", layer, 5, 16)) == Tag("qk_sigma1", layer, "H05")
        assert parse_tag(head_tag("qk_sigma1", layer, 5, 16)).head == 5
        assert parse_tag(stat_tag("attn_entropy", layer, "min")) == Tag("attn_entropy", layer, "min")
        assert parse_tag(layer_tag("update_ratio_q", layer)) == Tag("update_ratio_q", layer)
        assert parse_tag(histogram_tag("attn_rank", layer)) == Tag("attn_rank", layer, "heads")
    assert parse_tag("loss") == Tag("loss")
    assert parse_tag("alerts/malignant_collapse") is None and parse_tag("limit/scale") is None
    assert parse_where("L03/H05") == ("L03", 5) and parse_where("L02.cross") == ("L02.cross", None)
    assert parse_where("") is None


def test_layer_runs_hold_the_charted_statistic_and_no_constants():
    scalars = {stat_tag(m, "L01", s): 1.0 for m in CHART_STAT for s in ("max", "min", "mean")}
    scalars |= {"attn_rows/L01": 128.0, "attn_entropy_uniform/L01": 4.0, "update_ratio_q/L01": 0.01, "loss": 2.0}
    (run,) = layer_runs(scalars).values()
    assert set(run) == {f"by_layer/{m}/{s}" for m, s in CHART_STAT.items()} | {"by_layer/update_ratio_q"}


def test_alert_events_count_every_level_zero_included():
    class A:
        def __init__(self, level):
            self.level = level

    events = alert_events([A("warning"), A("warning"), A("critical")])
    assert events == {"alerts/critical": {"alerts_raised": 1.0}, "alerts/warning": {"alerts_raised": 2.0},
                      "alerts/info": {"alerts_raised": 0.0}}
    table = constants_table({"L00": {"attn_rows": np.array([128.0]), "attn_entropy_uniform": np.array([4.16])}})
    assert "| L00 | 128 | 4.16 |" in table
    assert constants_table({"L00": {"qk_sigma1": np.ones(2)}}) is None


def _is_figure(image: np.ndarray) -> bool:
    white = (image > 245).all(-1).mean()
    dark = (image < 60).all(-1).mean()
    return image.ndim == 3 and image.shape[2] == 3 and white > 0.15 and dark > 0.002


def test_figures_have_axes_and_a_colour_bar():
    arrays = {"L00": {"qk_sigma1": np.array([1.0, 4.0]), "qk_sec": np.array([0.2, 0.9]),
                      "attn_entropy": np.array([0.1, 2.0]), "attn_entropy_uniform": np.array([2.0])},
              "L01": {"qk_sigma1": np.array([2.0, np.nan]), "qk_sec": np.array([0.5, 0.5]),
                      "attn_entropy": np.array([1.0, 1.0]), "attn_entropy_uniform": np.array([2.0])}}
    images = layer_head_figures(arrays, ["L00", "L01"], step=40)
    assert set(images) == {"heatmap/qk_sigma1", "heatmap/qk_sec", "heatmap/attn_entropy"}
    assert all(_is_figure(image) for image in images.values())
    grey = (np.abs(images["heatmap/qk_sigma1"].astype(int) - 128) <= 2).all(-1).sum()
    assert grey > 100, "the missing head is drawn grey"
    strip = update_ratio_figure(np.array([[1e-3, 1e-2, 0.0], [1e-4, np.nan, 1e-2]]), [0, 10, 20], ["L00", "L01"],
                                "update_ratio_q")
    assert _is_figure(strip)
    assert _is_figure(attention_map_figure(np.tril(np.ones((8, 8))) / np.arange(1, 9)[:, None], "L00/H01", 10))


def test_importing_the_library_does_not_import_matplotlib():
    code = "import sys, hooks, diag, diag.outputs.tb_views; assert 'matplotlib' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _write_run(folder, alerts=True):
    folder.mkdir(parents=True)
    rows = []
    for step in range(0, 60, 10):
        rows += [{"step": step, "tag": "loss", "value": 3.0 - step / 100},
                 {"step": step, "tag": "attn_rows/L00", "value": 16.0}]
        for layer in ("L00", "L01"):
            for head in range(2):
                rows.append({"step": step, "tag": f"qk_sigma1/{layer}/H{head:02d}", "value": 1.0 + step / 10 + head})
            rows.append({"step": step, "tag": f"qk_sigma1/{layer}/max", "value": 2.0 + step / 10})
            rows.append({"step": step, "tag": f"attn_entropy/{layer}/min", "value": None if step == 20 else 1.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if alerts:
        found = [{"step": s, "kind": "malignant_collapse", "level": "critical", "where": "L00/H01",
                  "message": f"collapse at {s}", "values": {}} for s in (30, 40)]
        found.append({"step": 10, "kind": "malignant_collapse", "level": "warning", "where": "L01/H00",
                      "message": "warning <b>. What to do: lower the learning rate now", "values": {}})
        (folder / "alerts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in found))


def test_run_report_is_one_page_with_curves_heatmaps_and_alerts(tmp_path, capsys):
    _write_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'run' / 'report.html'}"
    assert page.count("<img src='data:image/png;base64,") >= 5  # alerts, loss, sigma_1, entropy, heatmap
    assert "collapse at 30" in page and "warning &lt;b&gt;" in page  # messages escaped
    assert "what to do" in page and "restart from a checkpoint before the episode" in page  # the catalog's
    assert page.count("lower the learning rate now") == 1  # the message's own advice, said once
    assert "rows are heads, each sample a cell at its step" in page
    run = read_run(tmp_path / "run")
    assert run.layers() == ["L00", "L01"] and np.isnan(run.curve("attn_entropy/L00/min")[1][2])


def test_an_episode_is_shaded_from_its_start_to_its_resolved_record_or_the_end_of_the_run():
    """The episode is shaded, not a thin band at each of its records' steps."""
    alerts = [{"step": 40, "since": 30, "kind": "malignant_collapse", "level": "critical", "where": "L00"},
              {"step": 90, "since": 30, "kind": "malignant_collapse", "level": "info", "where": "L00",
               "status": "resolved"},
              {"step": 60, "since": 55, "kind": "malignant_collapse", "level": "warning", "where": "L01"},
              {"step": 70, "since": 70, "kind": "eureka_moment", "level": "info", "where": ""}]
    assert alert_episodes(alerts, end=200) == [(("critical", "malignant_collapse", "L00", 30, 90)),
                                               ("warning", "malignant_collapse", "L01", 55, 200),
                                               ("info", "eureka_moment", "", 70, 70)]
    assert alert_episodes([], end=10) == []


def test_the_alert_table_says_what_to_do_once():
    """The message's own "What to do" goes in its own column, not repeated beside it."""
    what, todo = split_advice("collapse risk 0.8: likely. What to do: add warmup")
    assert (what, todo) == ("collapse risk 0.8: likely.", "add warmup")
    assert split_advice("no advice here") == ("no advice here", None)


def test_run_report_errors_name_the_folder_and_the_fix(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'nothere'} does not exist") and "python -m diag report" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl, line 1: not JSON"):
        read_run(tmp_path / "bad")
    _write_run(tmp_path / "quiet", alerts=False)
    assert "No alert was raised" in write_run_report(tmp_path / "quiet").read_text()


def test_a_critical_alert_is_drawn_over_the_warnings_at_its_step():
    """A layer's critical record shares its steps (and its row) with its heads' warnings: in the timeline the
    critical episode is drawn on top, where it stays visible."""
    from diag.reports import run as run_report
    from diag.reports.charts import timeline

    alerts = [{"step": 40, "kind": "malignant_collapse", "level": level, "where": where}
              for level, where in (("critical", "L00"), ("warning", "L00/H01"))]
    alerts.append({"step": 0, "kind": "large_early_updates", "level": "info"})
    run = run_report.Run(Path("."), {"loss": {0: 1.0, 50: 1.0}}, alerts)
    fig = timeline(run_report.frame_of(run), ["large_early_updates", "malignant_collapse"])
    order = {to_hex(p.get_facecolor()): p.get_zorder() for p in fig.axes[0].patches}
    colours = {level: to_hex(colour) for level, colour in LEVEL_COLOURS.items()}
    assert order[colours["critical"]] > order[colours["warning"]] > order[colours["info"]]


def test_image_options_default_to_the_logdir_and_ten_full_periods_and_name_the_fix():
    periods = {"loss": 10, "grads": 10, "spectra": 20, "attention": 50, "updates": 100}
    assert image_options(None, None, full=100, periods=periods, every=None, logdir=True) == (True, 1000)
    assert image_options(None, 200, full=100, periods=periods, every=None, logdir=False) == (False, 200)
    assert image_options(False, None, full=100, periods=periods, every=None, logdir=True) == (False, 1000)
    with pytest.raises(ConfigError, match=r"image_every=150.*multiple of 100 \(the steps that sample every family"):
        image_options(None, 150, full=100, periods=periods, every=None, logdir=True)
    with pytest.raises(ConfigError, match=r"image_every=15.*multiple of every=10.*image_every=100"):
        image_options(None, 15, full=10, periods=dict.fromkeys(periods, 10), every=10, logdir=True)
    with pytest.raises(ConfigError, match="image_every=True"):
        image_options(None, True, full=1, periods={"loss": 1}, every=1, logdir=True)
    with pytest.raises(ConfigError, match="images='yes'.*True, False or None"):
        image_options("yes", None, full=100, periods=periods, every=None, logdir=True)
