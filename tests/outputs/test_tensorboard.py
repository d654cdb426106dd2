"""The TensorBoard side, read back by a real TensorBoard server over its HTTP data interface.

One server for the module (``python -m tensorboard.main`` on 127.0.0.1, legacy loader,
loading once before it serves) reads one monitored training run. The tests compare:
the runs and plugins it lists; every scalar series with ``metrics.jsonl`` and the
Monitor's own records; the custom-scalars layout with what the Monitor wrote, and
every chart's regex, resolved by the server itself, with the written tags; the images
(PNG, decoded) pixel for pixel with the arrays the Monitor drew; the histograms and
alert texts. Unit tests pin the data behind the images (grids, colour ranges, the heads
an alert names) and the layout rules; the Monitor's image options and fault isolation are
checked without a server.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image
from test_outputs import run_training

from diag.catalog.metrics import CHART_STAT, LAYER_METRICS, PER_HEAD_METRICS, family, update_metric_names
from diag.catalog.tags import layer_runs
from diag.detectors import Alert, AlertConfig, DetectorWrapper, TrainingHalted
from diag.errors import ConfigError
from diag.outputs.images import ALERT_MAPS_PER_STEP, UpdateRatioHistory, flagged_heads, layer_head_data
from diag.outputs.sinks import MemorySink, Record
from diag.outputs.tb_layout import build_layout
from evaluation.screenshots import tensorboard
from hooks.monitor.monitor import Monitor
from tests.support import zoo

VIRIDIS = np.rint(np.array(matplotlib.colormaps["viridis"].colors) * 255).astype(int)  # (256, 3)
STEPS = 5
RUN = "run1"

# ------------------------------------------------------------------ the run


def train(case: zoo.Case, monitor: Monitor, steps: int = STEPS) -> list[float]:
    return run_training(case, monitor, steps)


# Every head "sparse" (entropy below 100 nats): each head's state changes at the first sample,
# so alerts name all 8 heads of the 2 x 4 nanoGPT at step 0.
EVERY_HEAD_ALERTS = AlertConfig(sparse_entropy=100.0, collapse_persist=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    case, memory = zoo.nanogpt(), MemorySink()
    with Monitor(case.model, logdir=root / RUN, every=1, image_every=2, sinks=[memory],
                 alerts=EVERY_HEAD_ALERTS) as monitor:
        train(case, monitor)
    rows = [json.loads(line) for line in (root / RUN / "metrics.jsonl").read_text().splitlines()]
    return {"root": root, "monitor": monitor, "memory": memory, "jsonl": rows}


def _get(base: str, path: str, **params: str) -> bytes:
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _json(base: str, path: str, **params: str):
    return json.loads(_get(base, path, **params))


@pytest.fixture(scope="module")
def server(run):
    """A real TensorBoard server on the run (the one the screenshots use: it reads the logdir once, then serves)."""
    with tensorboard(run["root"], timeout=120) as base:
        yield base


def _memory_scalars(memory: MemorySink) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for record in memory.records:
        for tag, value in record.scalars.items():
            out.setdefault(tag, {})[record.step] = value
    return out


def chart_regexes(layout: dict[str, dict[str, list]]) -> dict[tuple[str, str], list[str]]:
    """``{(category, chart title): [regex, ...]}`` of a custom-scalars layout."""
    return {(cat, title): list(spec[1]) for cat, charts in layout.items() for title, spec in charts.items()}


def _same_float32(expected: float, got: float) -> bool:
    if not math.isfinite(expected):
        return not math.isfinite(got)
    return got == float(np.float32(expected))


# ------------------------------------------------------------- the server


# Besides the run itself (every tag), one run per layer (its
# charted statistics under one name, so a chart draws the layers in distinct colours and names them) and
# one per alert level (the alerts raised at each sampled step, zero when none).
LAYER_RUNS = [f"{RUN}/L00", f"{RUN}/L01"]
ALERT_RUNS = [f"{RUN}/alerts/{level}" for level in ("critical", "warning", "info")]


def test_server_lists_the_run_and_its_plugins(server):
    assert sorted(_json(server, "/data/runs")) == sorted([RUN, *LAYER_RUNS, *ALERT_RUNS])
    listing = _json(server, "/data/plugins_listing")
    for plugin in ("scalars", "histograms", "images", "text", "custom_scalars"):
        assert listing[plugin]["enabled"], (plugin, listing[plugin])


def test_every_scalar_series_matches_jsonl_and_the_monitor(server, run):
    tags = _json(server, "/data/plugin/scalars/tags")[RUN]
    jsonl: dict[str, dict[int, float | None]] = {}
    for row in run["jsonl"]:
        jsonl.setdefault(row["tag"], {})[row["step"]] = row["value"]
    memory = _memory_scalars(run["memory"])
    assert set(tags) == set(jsonl) == set(memory)
    for family_tag in ("loss", "qk_sigma1/L01/max", "attn_entropy/L00/H03", "update_ratio_q/L01",
                       "grad_ratio_qk_v/L00", "alerts/benign_collapse"):
        assert family_tag in tags, family_tag
    for tag in sorted(tags):
        series = _json(server, "/data/plugin/scalars/scalars", run=RUN, tag=tag)  # [[wall_time, step, value]]
        got = {step: value for _, step, value in series}
        assert set(got) == set(jsonl[tag]) == set(memory[tag]), tag
        for step, value in got.items():
            assert _same_float32(memory[tag][step], value), (tag, step, memory[tag][step], value)
            json_value = jsonl[tag][step]
            assert _same_float32(math.nan if json_value is None else json_value, value), (tag, step)
    assert [step for _, step, _ in _json(server, "/data/plugin/scalars/scalars", run=RUN, tag="loss")] == \
        list(range(STEPS))


def test_layout_is_what_the_monitor_wrote_and_every_chart_matches_written_tags(server, run):
    written = run["memory"].layouts
    assert len(written) == 1, "the layout is written once per Monitor"
    served = _json(server, "/data/plugin/custom_scalars/layout")
    as_dict = {cat["title"]: {chart["title"]: ["Multiline", chart["multiline"]["tag"]] for chart in cat["chart"]}
               for cat in served["category"]}
    assert as_dict == written[0]
    assert list(as_dict) == ["training", "spectra", "attention", "grads", "updates", "alerts"]
    assert {"update_ratio_o, a line per layer", "update_fro_o, a line per layer"} <= set(as_dict["updates"])

    tags = set(_json(server, "/data/plugin/scalars/tags")[RUN])
    all_tags = _json(server, "/data/plugin/scalars/tags")
    for (category, title), regexes in chart_regexes(written[0]).items():
        runs = [RUN] if category == "training" else ALERT_RUNS if category == "alerts" else LAYER_RUNS
        for regex in regexes:
            # the server resolves the chart's regex itself (re.match over each run's scalar tags): one
            # series per run, so TensorBoard gives each layer (each alert level) a colour and its name
            for name in runs:
                answer = _json(server, "/data/plugin/custom_scalars/scalars", run=name, tag=regex)
                assert answer["regex_valid"], regex
                matched = set(answer["tag_to_events"])
                assert len(matched) == 1, f"chart {category}/{title}: {regex} in {name}: {matched}"
                assert matched == {t for t in all_tags[name] if re.match(regex, t)}
                ((tag, events),) = answer["tag_to_events"].items()
                if name in LAYER_RUNS:  # the same values as the run's per-layer tag
                    metric, stat = (tag.split("/")[1:] + [None])[:2]
                    source = f"{metric}/{name.split('/')[-1]}" + (f"/{stat}" if stat else "")
                    main = _json(server, "/data/plugin/scalars/scalars", run=RUN, tag=source)
                    assert [e[1:] for e in events] == [e[1:] for e in main], (name, tag)
                if name in ALERT_RUNS:  # an event at every sampled step (see the next test)
                    assert [e[1] for e in events] == list(range(STEPS)), (name, events)
    # each written per-head metric and layer metric (but the constants) has its chart
    metrics = {t.split("/")[0] for t in tags if "/L" in t} - {"attn_rows", "attn_entropy_uniform"}
    charted = {r.lstrip("^").rstrip("$").split("/")[1] for rs in chart_regexes(written[0]).values() for r in rs
               if r.startswith("^by_layer/")}
    assert metrics <= charted, metrics - charted


def test_alert_events_are_spikes_at_the_steps_that_raised_them(server, run):
    history = run["monitor"].alert_sink.history
    for level in ("critical", "warning", "info"):
        events = _json(server, "/data/plugin/scalars/scalars", run=f"{RUN}/alerts/{level}", tag="alerts_raised")
        expected = [sum(1 for a in history if a.step == step and a.level == level) for step in range(STEPS)]
        assert [(e[1], e[2]) for e in events] == list(enumerate(map(float, expected))), level
    assert any(a.level == "info" for a in history)  # benign collapse at step 0: a spike, then zeros


def _png(server: str, tag: str) -> list[tuple[int, np.ndarray]]:
    samples = _json(server, "/data/plugin/images/images", run=RUN, tag=tag, sample="0")
    out = []
    for sample in samples:
        data = _get(server, "/data/plugin/images/individualImage?" + sample["query"])
        out.append((sample["step"], np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))))
    return out


def test_images_are_served_pixel_for_pixel(server, run):
    tags = _json(server, "/data/plugin/images/tags")[RUN]
    drawn: dict[str, dict[int, np.ndarray]] = {}
    for record in run["memory"].records:
        for tag, image in record.images.items():
            drawn.setdefault(tag, {})[record.step] = image
    heatmaps = {"heatmap/qk_sigma1", "heatmap/qk_sec", "heatmap/attn_entropy"}
    steps = {f"step_size/update_ratio_{x}" for x in "qkvo"}
    maps = {f"attention_map/L{i:02d}/H{h:02d}" for i in range(2) for h in range(4)}
    assert set(tags) == set(drawn) == heatmaps | steps | maps
    for tag in heatmaps:
        assert sorted(drawn[tag]) == [0, 2, 4]  # image_every=2
    for tag in steps:
        assert sorted(drawn[tag]) == [2, 4]  # the updates of steps 0..1, then 0..3
    for tag in maps:
        assert sorted(drawn[tag]) == [0]  # the alerts fired at step 0 only
    for tag in sorted(set(drawn)):
        served = dict(_png(server, tag))
        assert sorted(served) == sorted(drawn[tag]), tag
        for step, pixels in served.items():
            np.testing.assert_array_equal(pixels, drawn[tag][step], err_msg=f"{tag} at step {step}")
    # every image is a figure with axes, tick values, labels and a colour bar, not bare cells
    for tag in drawn:
        for step, image in drawn[tag].items():
            assert looks_like_a_figure(image), (tag, step)


def looks_like_a_figure(image: np.ndarray) -> bool:
    """A matplotlib figure: a white background around the plot, dark text/axes, and viridis colours."""
    rgb = image.astype(int)
    white = (rgb > 245).all(axis=-1).mean()
    dark = (rgb < 60).all(axis=-1).mean()
    dist = np.abs(rgb[:, :, None, :] - VIRIDIS[None, None, ::8, :]).sum(-1).min(-1)
    viridis = (dist < 30).mean()
    return image.shape[0] >= 200 and image.shape[1] >= 250 and white > 0.15 and dark > 0.002 and viridis > 0.05


def test_histograms_and_alert_texts_are_served(server, run):
    tags = set(_json(server, "/data/plugin/histograms/tags")[RUN])
    written = {tag for r in run["memory"].records for tag, v in r.histograms.items() if np.isfinite(v).any()}
    assert tags == written
    assert {"qk_spectrum/L00", "qk_spectrum/L01", "qk_sigma1/L00/heads", "attn_entropy/L01/heads"} <= tags
    # the spectrum histogram holds every singular value of every head: n_heads * d_head per layer
    layer = run["monitor"].layers[0]
    n_heads, d_head = layer.layout.n_heads, layer.layout.head_dim
    first = [r for r in run["memory"].records if "qk_spectrum/L00" in r.histograms][0]
    assert first.histograms["qk_spectrum/L00"].size == n_heads * d_head
    series = _json(server, "/data/plugin/histograms/histograms", run=RUN, tag="qk_spectrum/L00")
    wall, step, buckets = series[0]
    assert step == first.step
    assert sum(count for _, _, count in buckets) == pytest.approx(n_heads * d_head)
    assert buckets[0][0] == pytest.approx(first.histograms["qk_spectrum/L00"].min(), rel=1e-6)
    # SummaryWriter.add_text appends "/text_summary" to the tag
    assert sorted(_json(server, "/data/plugin/text/tags")[RUN]) == ["alerts/benign_collapse/text_summary",
                                                                    "run/attention_sample/text_summary"]
    # the constants of the attention sample are a table, not charts
    (table,) = _json(server, "/data/plugin/text/text", run=RUN, tag="run/attention_sample/text_summary")
    assert table["step"] == 0 and "attn_rows" in table["text"] and "L01" in table["text"]
    (entry,) = _json(server, "/data/plugin/text/text", run=RUN, tag="alerts/benign_collapse/text_summary")
    assert entry["step"] == 0
    assert all(f"L{i:02d}/H{h:02d}" in entry["text"] for i in range(2) for h in range(4))


# ------------------------------------------------------------- the data behind the images


def test_layer_head_data_grids_and_colour_ranges():
    arrays = {
        "L00": {"qk_sigma1": np.array([1.0, 4.0]), "qk_sec": np.array([0.0, 1.0]),
                "attn_entropy": np.array([0.0, 2.0]), "attn_entropy_uniform": np.array([2.0])},
        # L01 refused (no metrics); L02 has one head fewer
        "L02": {"qk_sigma1": np.array([2.0]), "qk_sec": np.array([0.5]),
                "attn_entropy": np.array([0.5]), "attn_entropy_uniform": np.array([1.0])},
    }
    labels = ["L00", "L01", "L02"]
    sigma = layer_head_data(arrays, labels, "qk_sigma1")  # on 0 .. the largest value of the grid
    np.testing.assert_array_equal(sigma.grid, [[1.0, 4.0], [np.nan, np.nan], [2.0, np.nan]])
    assert (sigma.lo, sigma.hi) == (0.0, 4.0)
    sec = layer_head_data(arrays, labels, "qk_sec")  # SEC on the fixed 0 .. 1
    assert (sec.lo, sec.hi) == (0.0, 1.0)
    entropy = layer_head_data(arrays, labels, "attn_entropy")  # a fraction of uniform attention's: 0/2, 2/2, 0.5/1
    np.testing.assert_array_equal(entropy.grid, [[0.0, 1.0], [np.nan, np.nan], [0.5, np.nan]])
    assert (entropy.lo, entropy.hi) == (0.0, 1.0) and "uniform" in entropy.cbar


def test_update_ratio_history_keeps_steps_and_stays_bounded():
    history = UpdateRatioHistory(most=4)
    for step in range(20):
        history.write(Record(step, {"update_ratio_q/L00": float(step), "update_fro_q/L00": 9.0, "loss": 1.0}))
        assert len(history.series) <= 8
    steps = history.steps()
    assert steps[-1] == 19 and steps == sorted(steps) and len(steps) >= 4
    np.testing.assert_array_equal(history.matrix("update_ratio_q", ["L00", "L01"]),
                                  [[float(s) for s in steps], [np.nan] * len(steps)])
    assert history.metrics() == ["update_ratio_q"]


def test_flagged_heads_most_severe_first_each_once_and_capped():
    def alert(where: str, level: str) -> Alert:
        return Alert(3, "x", level, where, "m")

    alerts = [alert("L00/H01", "info"), alert("L01", "warning"), alert("", "critical"),
              alert("L02/H00", "critical"), alert("L00/H01", "warning"), alert("L00.cross/H11", "info")]
    assert flagged_heads(alerts) == [("L02/H00", "L02", 0), ("L00/H01", "L00", 1), ("L00.cross/H11", "L00.cross", 11)]
    many = [alert(f"L00/H{h:02d}", "info") for h in range(20)]
    assert len(flagged_heads(many)) == ALERT_MAPS_PER_STEP


# ------------------------------------------------------------------ layout rules


def test_layout_rules_follow_the_tag_scheme():
    assert set(CHART_STAT) <= set(PER_HEAD_METRICS), "a chart rule for a metric that is not written"
    assert all(family(m) != "other" for m in PER_HEAD_METRICS + LAYER_METRICS)
    tags = ["loss", "qk_sigma1/L00/max", "qk_sigma1/L00/min", "qk_sigma1/L00/mean", "qk_sigma1/L00/H00",
            "attn_rows/L00", "new_metric/L03/max", "alerts/loss_spike", "limit/scale"]
    layout = build_layout(tags)
    assert layout == {  # the per-layer charts read the per-layer runs; constants get no chart
        "training": {"loss": ["Multiline", ["^loss$"]]},
        "spectra": {"qk_sigma1 (max over heads), a line per layer": ["Multiline", [r"^by_layer/qk_sigma1/max$"]]},
        "other": {"new_metric (max over heads), a line per layer": ["Multiline", [r"^by_layer/new_metric/max$"]]},
        "alerts": {"alerts raised per sampled step, a line per level": ["Multiline", [r"^alerts_raised$"]]},
    }
    assert layer_runs({t: 1.0 for t in tags}) == {"L00": {"by_layer/qk_sigma1/max": 1.0}, "L03": {
        "by_layer/new_metric/max": 1.0}}
    with_updates = build_layout(tags, updates=update_metric_names())["updates"]
    assert sorted(with_updates) == sorted(f"{m}, a line per layer" for m in LAYER_METRICS if m.startswith("update_"))
    assert with_updates["update_ratio_o, a line per layer"] == ["Multiline", [r"^by_layer/update_ratio_o$"]]
    without_o = build_layout(tags, updates=update_metric_names("qkv"))["updates"]  # no layer has W_O
    assert sorted(without_o) == [f"update_{m}_{x}, a line per layer" for m in ("fro", "ratio") for x in "kqv"]


# --------------------------------------------------------------- Monitor options


def test_image_options_are_checked():
    case = zoo.nanogpt()
    with pytest.raises(ConfigError, match=r"image_every=15.*multiple of every=10.*image_every=100"):
        Monitor(case.model, every=10, image_every=15)
    with pytest.raises(ConfigError, match="image_every=0"):
        Monitor(case.model, image_every=0)
    with pytest.raises(ConfigError, match="images='yes'"):
        Monitor(case.model, images="yes")


def test_images_need_pillow(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    case = zoo.nanogpt()
    with pytest.raises(ConfigError, match="needs Pillow.*pip install pillow"):
        Monitor(case.model, logdir=tmp_path / "a", images=True)
    with Monitor(case.model, logdir=tmp_path / "b") as monitor:  # the default: no images, nothing fails
        assert monitor.images is False


def test_images_default_off_without_logdir_and_layout_still_written():
    case, memory = zoo.nanogpt(), MemorySink()
    with Monitor(case.model, every=1, sinks=[memory], alerts=EVERY_HEAD_ALERTS) as monitor:
        train(case, monitor, steps=2)
    assert not any(r.images for r in memory.records)
    assert len(memory.layouts) == 1 and "spectra" in memory.layouts[0]


def test_per_head_off_and_fewer_signals_give_a_matching_layout():
    case, memory = zoo.nanogpt(), MemorySink()
    with Monitor(case.model, every=1, sinks=[memory], per_head=False, signals=("spectra", "grads")) as monitor:
        train(case, monitor, steps=2)
    (layout,) = memory.layouts
    assert list(layout) == ["training", "spectra", "grads", "alerts"]
    tags = {t for r in memory.records for t in r.scalars}
    tags |= {t for r in memory.records for run in layer_runs(r.scalars).values() for t in run}
    tags |= {t for r in memory.views for run in r.runs.values() for t in run}  # the alert events
    for regexes in chart_regexes(layout).values():  # every chart, the alert events included (zero when none)
        assert all(any(re.match(rx, t) for t in tags) for rx in regexes), regexes


def test_image_faults_never_reach_training(monkeypatch):
    import diag.outputs.figures as figures

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(figures, "layer_head_figures", broken)
    case, memory = zoo.nanogpt(), MemorySink()
    seen: list[Alert] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(case.model, every=1, images=True, image_every=1, sinks=[memory],
                     alerts=EVERY_HEAD_ALERTS, on_alert=seen.append) as monitor:
            losses = train(case, monitor, steps=3)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    messages = [str(w.message) for w in caught if str(w.message).startswith("diag:")]
    assert len(messages) == 1 and "tensorboard failed" in messages[0] and "drawing failed" in messages[0], messages
    # the alerts still went out: heads of a layer that start together are one record, and a layer whose
    # heads are in the state has a record of its own beside its heads'
    firing = [a for a in seen if a.status == "firing"]
    assert sum(len(a.heads) or 1 for a in firing if "/H" in a.where) == 8
    assert sorted(a.where for a in firing if "/H" not in a.where) == ["L00", "L01"]
    assert [s for s, _ in memory.scalars("loss")] == [0, 1, 2]


class _HaltAtFirstSample(DetectorWrapper):
    """The Monitor's detectors, with a critical record added to the first sample's."""

    def observe(self, obs):
        out = self.inner.observe(obs)
        return out + [Alert(obs.step, "collapse_damage", "critical", "L00", "stop")] if obs.step == 0 else out


def test_attention_maps_are_written_before_a_critical_alert_stops_training():
    # sparse (entropy < 100 nats) and low-rank (rank <= 50 x rows): every head malignant at once (records that name
    # heads, info as the model's baseline), and a critical record at the same sample
    cfg = AlertConfig(sparse_entropy=100.0, low_rank_frac=50.0, collapse_persist=1)
    case, memory = zoo.nanogpt(), MemorySink()
    monitor = Monitor(case.model, every=1, images=True, sinks=[memory], alerts=cfg, stop_on_critical=True)
    monitor.detectors = _HaltAtFirstSample(monitor.detectors)
    with pytest.raises(TrainingHalted):
        train(case, monitor, steps=2)
    monitor.close()
    maps = {tag for r in memory.records if r.step == 0 for tag in r.images if tag.startswith("attention_map/")}
    assert len(maps) == ALERT_MAPS_PER_STEP == 8


def test_resumed_run_writes_the_layout_again_and_tensorboard_keeps_the_newest(tmp_path):
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.data import provider
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.custom_scalar import metadata as cs_metadata

    case = zoo.nanogpt()
    logdir = tmp_path / RUN
    with Monitor(case.model, logdir=logdir, every=1, signals=("spectra",)) as monitor:
        train(case, monitor, steps=3)
    time.sleep(1.1)  # a new event file name (its timestamp has a resolution of one second)
    with Monitor(case.model, logdir=logdir, every=1, purge_step=2) as monitor:
        gen = torch.Generator().manual_seed(1)
        for step in (2, 3):
            loss = case.loss(case.model, case.make_batch(gen))
            loss.backward()
            monitor.step(step, loss=loss)
            case.model.zero_grad()
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2
    # what TensorBoard's layout route reads (the legacy loader, as the server above)
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    dp = data_provider.MultiplexerDataProvider(mux, str(tmp_path))
    data = dp.read_tensors(context.RequestContext(), experiment_id="", plugin_name=cs_metadata.PLUGIN_NAME,
                           run_tag_filter=provider.RunTagFilter(tags=[cs_metadata.CONFIG_SUMMARY_TAG]), downsample=1)
    layout = layout_pb2.Layout()
    layout.ParseFromString(data[RUN][cs_metadata.CONFIG_SUMMARY_TAG][0].numpy.item())
    assert [c.title for c in layout.category] == ["training", "spectra", "attention", "grads", "updates", "alerts"]
