"""The catalog of metrics (diag/catalog/metrics.py): what a run writes is in it and within its ranges, an entry
checks itself, and a new metric is one entry: its tags, its TensorBoard chart and its report curve follow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from diag.catalog.metrics import FAMILIES, METRICS, Metric, family_metrics, metrics_with
from diag.catalog.tags import layer_runs, parse_tag
from diag.errors import ConfigError
from diag.outputs.records import build_record
from diag.outputs.sinks import MemorySink
from diag.outputs.tb_layout import build_layout
from diag.reports.run import write_run_report
from hooks.monitor.monitor import Monitor
from tests.support import zoo

DOCS = Path(__file__).resolve().parents[2] / "docs"
NEW = Metric("head_agreement", "attention", "layer", "", (0.0, 1.0), "agreement of the heads")


def _run(case: zoo.Case, steps: int = 3) -> MemorySink:
    import torch

    memory, gen = MemorySink(), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    with Monitor(case.model, every=1, sinks=[memory]) as monitor:
        for step in range(steps):
            loss = case.loss(case.model, case.make_batch(gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            monitor.step(step, loss=loss)
            opt.step()
    return memory


def _within(entry: Metric, values: np.ndarray) -> bool:
    lo, hi = entry.range
    v = values[np.isfinite(values)]
    slack = 1e-9 * np.maximum(1.0, np.abs(v))
    return bool((lo is None or (v >= lo - slack).all()) and (hi is None or (v <= hi + slack).all()))


@pytest.mark.parametrize("build", [zoo.llama, zoo.gpt2], ids=["llama-gqa", "gpt2"])
def test_what_a_run_writes_is_in_the_catalog_and_within_its_ranges(build):
    memory = _run(build("eager"))
    seen: dict[str, list[float]] = {}
    for record in memory.records:
        for tag, value in record.scalars.items():
            parsed = parse_tag(tag)
            if parsed is None or parsed.layer is None:
                continue
            entry = METRICS[parsed.metric]  # every metric of a layer has an entry
            assert (parsed.part is None) == (entry.per == "layer"), tag  # the form its entry's `per` says
            seen.setdefault(parsed.metric, []).append(value)
        for tag, values in record.histograms.items():
            parsed = parse_tag(tag)
            if parsed is not None and parsed.layer is not None and parsed.part is None:
                assert METRICS[parsed.metric].per == "spectrum", tag
                seen.setdefault(parsed.metric, []).extend(np.asarray(values, float).tolist())
    assert set(seen) == set(METRICS), "the Monitor writes every metric of the catalog on a full sample"
    for metric, values in seen.items():
        assert _within(METRICS[metric], np.asarray(values, float)), (metric, min(values), max(values))


def test_entries_check_themselves_and_name_the_fix():
    def make(**changes) -> Metric:
        fields = dict(name="x", family="attention", per="layer", unit="", range=(0.0, 1.0), title="x")
        return Metric(**(fields | changes))

    cases = {
        "family='nope'.*choose one of": dict(family="nope"),
        "per='row'.*choose one of": dict(per="row"),
        "stat=None with per='head'.*max.*min.*mean": dict(per="head"),
        "stat='max' with per='layer'.*stat=None": dict(stat="max"),
        r"range=\(1.0, 0.0\).*low < high": dict(range=(1.0, 0.0)),
        r"views \['plot'\].*choose from": dict(views=("chart", "plot")),
        "name='a/b'.*one tag part": dict(name="a/b"),
    }
    for message, changes in cases.items():
        with pytest.raises(ConfigError, match=r"diag\.catalog\.metrics: the entry .*" + message):
            make(**changes)
    assert make(range=(None, None)).colour_range(-2.0, 3.0) == (-2.0, 3.0)
    assert METRICS["qk_sec"].colour_range(0.96, 0.99) == (0.0, 1.0)  # a fraction keeps its fixed scale
    with pytest.raises(ConfigError, match="unknown view"):
        metrics_with("plots")
    with pytest.raises(ConfigError, match="unknown family"):
        family_metrics("loss")
    assert {m for f in FAMILIES for m in family_metrics(f)} == set(METRICS)


def test_a_new_metric_is_one_entry(monkeypatch, tmp_path):
    """A new metric (a made-up head_agreement), one value per layer in [0, 1], added to the catalog and nowhere
    else: written as one scalar per layer (outside the catalog it would be taken for a per-head metric:
    max/min/mean and a histogram), given a per-layer run and a chart in its family, and a curve in the run report."""
    arrays = {"L00": {"qk_sigma1": np.array([1.0, 2.0]), "head_agreement": np.array([0.25])},
              "L01": {"qk_sigma1": np.array([3.0, 1.0]), "head_agreement": np.array([0.75])}}
    unknown = build_record(0, arrays, per_head=False)
    assert "head_agreement/L00/max" in unknown.scalars and "head_agreement/L00" not in unknown.scalars

    monkeypatch.setitem(METRICS, NEW.name, NEW)
    records = [build_record(step, arrays, per_head=False) for step in (0, 10, 20)]
    scalars = records[0].scalars
    assert scalars["head_agreement/L00"] == 0.25 and scalars["head_agreement/L01"] == 0.75
    assert not any(t.startswith("head_agreement/L00/") for t in [*scalars, *records[0].histograms])
    assert layer_runs(scalars)["L01"]["by_layer/head_agreement"] == 0.75
    layout = build_layout(scalars)
    assert layout["attention"] == {"head_agreement, a line per layer": ["Multiline", [r"^by_layer/head_agreement$"]]}

    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": r.step, "tag": t, "value": v}) for r in records for t, v in r.scalars.items()]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    page = write_run_report(run).read_text()
    assert "head_agreement per layer over the sampled steps" in page
    assert page.index("qk_sigma1 (max over heads) per layer") < page.index("head_agreement per layer")


def test_every_metric_is_documented():
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z0-9_]+)`", text))
    missing = [m for m in METRICS if m not in documented and re.sub(r"_[qkvo]$", "_x", m) not in documented]
    assert missing == [], f"docs/metrics.md has no section for {missing}"
