"""What the monitor writes, and how it meets bad input.

* TensorBoard event files, read back with TensorBoard's own reader, hold exactly
  the scalars of ``metrics.jsonl`` (tags, steps, values), in the documented tag
  scheme, plus the across-head histograms.
* ``per_head=False`` drops the per-head tags but keeps the per-layer stats.
* An unwritable logdir, a model without attention and bad arguments fail at
  construction with errors that name the problem.
* An explicit spec measures what discovery measures.
* Non-finite values are logged (null in JSONL) with one warning; a failing sink
  is reported once while the other sinks and the training go on.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator
from torch import nn

from diag.catalog.metrics import LAYER_METRICS, PER_HEAD_METRICS
from diag.errors import ConfigError, SinkError, SpecError
from diag.layouts.adapters import ADAPTERS
from diag.layouts.vocab import QKVLayout
from diag.outputs.sinks import MemorySink, Record
from hooks.monitor.monitor import Monitor
from tests.support import zoo

# ------------------------------------------------------------------ helpers


def run_training(case: zoo.Case, monitor: Monitor, steps: int, lr: float = 1e-2, seed: int = 0) -> list[float]:
    model = case.model
    model.train()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = case.loss(model, case.make_batch(gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        monitor.step(step, loss=loss)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def read_tensorboard(logdir: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(
        str(logdir),
        size_guidance={
            event_accumulator.SCALARS: 0,  # 0: keep everything
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    return acc


def by_tag_step(pairs) -> dict[tuple[str, int], list]:
    out: dict[tuple[str, int], list] = defaultdict(list)
    for tag, step, value in pairs:
        out[(tag, step)].append(value)
    return out


def same_float32(json_value: float | None, tb_value: float) -> bool:
    if json_value is None:  # metrics.jsonl writes non-finite numbers as null
        return not math.isfinite(tb_value)
    if not math.isfinite(tb_value):
        return False
    expected = float(np.float32(json_value))
    return tb_value == expected or math.isclose(tb_value, json_value, rel_tol=2e-7, abs_tol=1e-37)


def is_diag_nonfinite(w: warnings.WarningMessage) -> bool:
    """The monitor's own non-finite warning ("diag: non-finite values at step ...")."""
    return issubclass(w.category, RuntimeWarning) and str(w.message).startswith("diag: non-finite")


HEAD_TAG = re.compile(r"/H\d{2,}$")
TAG_SCHEME = re.compile(
    r"^(?:loss"
    r"|alerts/[a-z_]+"
    r"|(?P<metric>[a-z0-9_]+)/L\d{2,}(?:\.cross)?(?P<rest>/H\d{2,}|/max|/min|/mean)?)$"
)


# ------------------------------------------------------------- TensorBoard


@pytest.mark.parametrize("name", ["nanogpt", "llama-sdpa"])
def test_tensorboard_matches_jsonl(name, tmp_path):
    case = zoo.CASES[name]()
    steps = 4
    with Monitor(case.model, every=1, logdir=tmp_path) as monitor:
        n_layers = len(monitor.layers)
        n_heads = monitor.layers[0].layout.n_heads
        run_training(case, monitor, steps)

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows and all(set(r) == {"step", "tag", "value"} for r in rows)
    jsonl = by_tag_step((r["tag"], r["step"], r["value"]) for r in rows)

    acc = read_tensorboard(tmp_path)
    tb_tags = set(acc.Tags()["scalars"])
    tb = by_tag_step((tag, ev.step, ev.value) for tag in tb_tags for ev in acc.Scalars(tag))

    # every JSONL value is a TensorBoard scalar with the same step and value, and vice versa
    assert tb_tags == {tag for tag, _ in jsonl}
    assert set(tb) == set(jsonl)
    for key, values in jsonl.items():
        tb_values = tb[key]
        assert len(tb_values) == len(values), key
        for jv, tv in zip(values, tb_values):
            assert same_float32(jv, tv), f"{key}: jsonl {jv!r} vs tensorboard {tv!r}"

    # every step was sampled; updates of every optimizer step (the last written at close)
    assert sorted(step for tag, step in jsonl if tag == "loss") == list(range(steps))
    assert sorted(step for tag, step in jsonl if tag == "update_ratio_q/L00") == list(range(steps))

    # the tag scheme
    for tag in tb_tags:
        match = TAG_SCHEME.match(tag)
        assert match, f"tag {tag!r} outside the scheme"
        metric, rest = match.group("metric"), match.group("rest")
        if metric in LAYER_METRICS:
            assert rest is None, f"layer-only metric with a suffix: {tag}"
        elif metric is not None:
            assert metric in PER_HEAD_METRICS, tag
            assert rest is not None, f"per-head metric without head/stat: {tag}"
    for layer in range(n_layers):
        label = f"L{layer:02d}"
        for h in range(n_heads):
            assert f"qk_sigma1/{label}/H{h:02d}" in tb_tags
        assert f"qk_sigma1/{label}/H{n_heads:02d}" not in tb_tags
        for stat in ("max", "min", "mean"):
            assert f"qk_sigma1/{label}/{stat}" in tb_tags
            assert f"attn_entropy/{label}/{stat}" in tb_tags
            assert f"grad_norm_q/{label}/{stat}" in tb_tags
        for metric in ("update_ratio_q", "update_ratio_k", "update_ratio_v", "grad_ratio_qk_v", "attn_rows"):
            assert f"{metric}/{label}" in tb_tags
    assert "loss" in tb_tags

    # per-layer stats agree with the per-head values
    for step in range(steps):
        heads = [jsonl[(f"qk_sigma1/L00/H{h:02d}", step)][0] for h in range(n_heads)]
        assert jsonl[("qk_sigma1/L00/max", step)][0] == pytest.approx(max(heads), rel=1e-12)
        assert jsonl[("qk_sigma1/L00/min", step)][0] == pytest.approx(min(heads), rel=1e-12)
        assert jsonl[("qk_sigma1/L00/mean", step)][0] == pytest.approx(sum(heads) / n_heads, rel=1e-12)

    # histograms of the values across heads
    hist_tags = set(acc.Tags()["histograms"])
    for layer in range(n_layers):
        assert f"qk_sigma1/L{layer:02d}/heads" in hist_tags
        assert f"attn_entropy/L{layer:02d}/heads" in hist_tags
    events = acc.Histograms("qk_sigma1/L00/heads")
    assert [ev.step for ev in events] == list(range(steps))
    h0 = events[0].histogram_value
    assert h0.num == n_heads
    sigma_step0 = [jsonl[(f"qk_sigma1/L00/H{h:02d}", 0)][0] for h in range(n_heads)]
    assert h0.min == pytest.approx(min(sigma_step0), rel=1e-6)
    assert h0.max == pytest.approx(max(sigma_step0), rel=1e-6)
    assert h0.sum == pytest.approx(sum(sigma_step0), rel=1e-6)


def test_per_head_false_writes_no_head_tags(tmp_path):
    case = zoo.nanogpt()
    memory = MemorySink()
    with Monitor(case.model, every=1, logdir=tmp_path, per_head=False, sinks=[memory]) as monitor:
        assert monitor.per_head is False
        run_training(case, monitor, 2)
    tags = {r["tag"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert tags, "nothing written"
    assert [t for t in tags if HEAD_TAG.search(t)] == []
    for label in ("L00", "L01"):
        for metric in ("qk_sigma1", "qk_sec", "attn_entropy", "attn_rank", "grad_norm_q", "grad_norm_v"):
            for stat in ("max", "min", "mean"):
                assert f"{metric}/{label}/{stat}" in tags
        assert f"update_ratio_q/{label}" in tags
    assert "loss" in tags
    assert "qk_sigma1/L00/heads" in memory.records[0].histograms
    assert len(memory.records[0].histograms["qk_sigma1/L00/heads"]) == 4


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_unwritable_logdir_raises_sink_error(where, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    logdir = blocker / "run" if where == "under-a-file" else blocker
    model = zoo.nanogpt().model
    with pytest.raises(SinkError) as info:
        Monitor(model, logdir=logdir)
    assert str(logdir) in str(info.value)


def test_model_without_attention_raises_spec_error():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(SpecError) as info:
        Monitor(model)
    message = str(info.value)
    assert "Tried" in message
    for adapter in ADAPTERS:  # lists what was tried
        assert adapter.name in message
    assert "spec=" in message  # and shows an example spec
    assert "QKVLayout(" in message


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"every": 0}, "every"),
        ({"every": "10"}, "every"),
        ({"signals": ("bogus",)}, "signals"),
    ],
    ids=["every=0", "every='10'", "signals=bogus"],
)
def test_bad_arguments_raise_config_error(kwargs, argument):
    model = zoo.nanogpt().model
    with pytest.raises(ConfigError) as info:
        Monitor(model, **kwargs)
    assert argument in str(info.value)
    if argument == "signals":
        assert "bogus" in str(info.value)
    assert all(not m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------------- explicit spec


def test_explicit_spec_matches_discovery():
    spec = {"h.*.attn": QKVLayout(n_heads=4, head_dim=8, q="c_attn.weight", packing="fused")}
    case = zoo.nanogpt()
    model = case.model
    batch = case.make_batch(torch.Generator().manual_seed(0))

    def first_record(**kwargs) -> tuple[Monitor, Record]:
        memory = MemorySink()
        monitor = Monitor(model, every=1, sinks=[memory], **kwargs)
        torch.manual_seed(5)  # the same dropout masks for both forwards
        model.zero_grad(set_to_none=True)
        loss = case.loss(model, batch)
        loss.backward()
        monitor.step(0, loss=loss)
        monitor.close()
        return monitor, memory.records[0]

    discovered, rec_d = first_record()
    explicit, rec_s = first_record(spec=spec)

    assert [layer.name for layer in explicit.layers] == [layer.name for layer in discovered.layers] == [
        "h.0.attn",
        "h.1.attn",
    ]
    assert [layer.label for layer in explicit.layers] == ["L00", "L01"]
    sigma_tags = sorted(t for t in rec_d.scalars if t.startswith("qk_sigma1/"))
    assert sigma_tags == sorted(t for t in rec_s.scalars if t.startswith("qk_sigma1/"))
    assert len([t for t in sigma_tags if HEAD_TAG.search(t)]) == 8
    for tag in sigma_tags:
        assert rec_s.scalars[tag] == rec_d.scalars[tag], tag
    np.testing.assert_array_equal(rec_s.histograms["qk_spectrum/L01"], rec_d.histograms["qk_spectrum/L01"])
    assert rec_s.scalars.keys() == rec_d.scalars.keys()


# ---------------------------------------------------------------- non-finite


def test_nan_weight_is_logged_as_null_with_one_warning(tmp_path):
    case = zoo.nanogpt()
    model = case.model
    with torch.no_grad():
        model.h[0].attn.c_attn.weight[0, 0] = float("nan")  # a query weight of layer 0, head 0
    steps = 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, every=1, logdir=tmp_path) as monitor:
            losses = run_training(case, monitor, steps)  # must not raise
    assert all(math.isnan(x) for x in losses)

    # a non-finite loss is said once, by the nonfinite_loss alert (no warning besides)
    assert not [w for w in caught if is_diag_nonfinite(w)], [str(w.message) for w in caught]
    alerts = [a for a in read_jsonl(tmp_path / "alerts.jsonl") if a["kind"] == "nonfinite_loss"]
    assert [(a["step"], a["status"]) for a in alerts] == [(0, "firing")]

    values = {(r["tag"], r["step"]): r["value"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    for step in range(steps):
        assert ("loss", step) in values and values[("loss", step)] is None
        assert values[("qk_sigma1/L00/H00", step)] is None
    # at step 0 only head 0 of layer 0 has a NaN weight: the other heads are measured
    assert values[("qk_sigma1/L00/H01", 0)] is not None
    assert values[("qk_sigma1/L01/H00", 0)] is not None
    assert monitor.last  # the last step was recorded


def test_nan_loss_is_logged_as_null_and_said_once(tmp_path):
    case = zoo.nanogpt()
    model = case.model
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, every=1, logdir=tmp_path) as monitor:
            for step in range(steps):
                loss = case.loss(model, case.make_batch(gen))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                monitor.step(step, loss=float("nan"))
                opt.step()
    # a non-finite loss is said once, by the nonfinite_loss alert (no warning besides)
    assert not [w for w in caught if is_diag_nonfinite(w)], [str(w.message) for w in caught]
    alerts = [a for a in read_jsonl(tmp_path / "alerts.jsonl") if a["kind"] == "nonfinite_loss"]
    assert [(a["step"], a["status"]) for a in alerts] == [(0, "firing")]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    loss_rows = [r for r in rows if r["tag"] == "loss"]
    assert [r["step"] for r in loss_rows] == list(range(steps))
    assert all(r["value"] is None for r in loss_rows)
    assert all(r["value"] is not None for r in rows if r["tag"].startswith("qk_sigma1/"))
    acc = read_tensorboard(tmp_path)
    assert all(math.isnan(ev.value) for ev in acc.Scalars("loss"))


# -------------------------------------------------------------- failing sink


class BrokenSink:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, record: Record) -> None:
        self.calls += 1
        raise OSError("disk on fire")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_failing_sink_reported_once_others_go_on(tmp_path):
    case = zoo.nanogpt()
    broken, memory = BrokenSink(), MemorySink()
    steps = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(case.model, every=1, logdir=tmp_path, sinks=[broken, memory]) as monitor:
            losses = run_training(case, monitor, steps)
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)  # training went on

    about_sink = [w for w in caught if "BrokenSink" in str(w.message)]
    assert len(about_sink) == 1, [str(w.message) for w in caught]
    assert issubclass(about_sink[0].category, RuntimeWarning)
    assert "disk on fire" in str(about_sink[0].message)

    # the memory sink received every record that was offered to the broken one
    assert broken.calls == len(memory.records) > 0
    assert [s for s, _ in memory.scalars("loss")] == list(range(steps))
    assert [s for s, _ in memory.scalars("update_ratio_q/L00")] == list(range(steps))
    # and so did the files
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == sum(len(r.scalars) for r in memory.records)


# ---------------------------------------------------------------- alerts.jsonl


def test_alerts_jsonl_is_there_from_the_start_and_empty_when_nothing_fired(tmp_path, monkeypatch):
    """A user who looks can tell "no alert" (an empty file) from "not written" (no file): the file exists from
    construction, is appended to (never truncated) on resume, replaced with overwrite, and rank != 0 writes none."""
    case = zoo.nanogpt()
    monitor = Monitor(case.model, every=1, logdir=tmp_path / "run", signals=("spectra",))
    assert (tmp_path / "run" / "alerts.jsonl").read_bytes() == b""  # before the first step
    monitor.step(0)
    monitor.close()
    assert monitor.alert_sink.history == [] and (tmp_path / "run" / "alerts.jsonl").read_bytes() == b""
    earlier = b'{"step": 0, "kind": "nonfinite_loss"}\n'  # a crashed run's line: a resume appends after it
    (tmp_path / "run" / "alerts.jsonl").write_bytes(earlier)
    Monitor(case.model, every=1, logdir=tmp_path / "run", purge_step=1).close()
    assert (tmp_path / "run" / "alerts.jsonl").read_bytes() == earlier
    Monitor(case.model, every=1, logdir=tmp_path / "run", overwrite=True).close()
    assert (tmp_path / "run" / "alerts.jsonl").read_bytes() == b""
    import hooks.monitor.monitor as monitor_module

    monkeypatch.setattr(monitor_module, "rank", lambda: 1)
    Monitor(case.model, every=1, logdir=tmp_path / "other").close()
    assert not (tmp_path / "other").exists()  # another rank writes nothing


def test_jsonl_lines_are_json_dumps_to_the_byte():
    from diag.outputs.sinks import json_value, jsonl_line

    values = [0.0, -0.0, 1.5, 2.0, 1e-30, 1e300, 1 / 3, float("nan"), float("inf"), -float("inf"), np.float32(0.1),
              np.float64(3.3), 7]
    for step in (0, 10, 123456):
        for tag in ("loss", "qk_sigma1/L00/H00", 'a"b\\c', "é/ü", "tab\there"):
            for value in values:
                want = json.dumps({"step": step, "tag": tag, "value": json_value(float(value))})
                assert jsonl_line(json.dumps(step), tag, value) == want
