"""The custom-scalars layout: one chart per metric with every layer a line of its own colour, by family.

Built from the tags a run really wrote (the first sampled step's record), so it
follows whatever the Monitor logs: a metric that is not written gets no chart, a
new metric gets one without a change here. Format: what
``SummaryWriter.add_custom_scalars`` takes,
``{category: {chart title: ["Multiline", [tag regex, ...]]}}``; TensorBoard's
custom-scalars plugin matches each regex against every run's scalar tags with
``re.match``, so every regex here is anchored at both ends.

TensorBoard colours a chart's lines by run, and names the runs in the chart's
tooltip and in the runs list: so the per-layer charts read the per-layer runs
(``L03/``, tags ``by_layer/...``, see :func:`diag.catalog.tags.layer_runs`), where
every layer is a run of its own. Each chart's category is its metric's family, in the
catalog's order (:mod:`diag.catalog.metrics`; ``other`` for a metric outside it):

* a per-head metric (tags ``<metric>/L03/max|min|mean``): one chart of one
  statistic across heads (the entry's ``stat``, the one that moves towards
  trouble), ``by_layer/<metric>/<stat>``, a line per layer;
* a layer metric (``<metric>/L03``): ``by_layer/<metric>``, a line per layer; the
  constants (``attn_rows``, ``attn_entropy_uniform``) get no chart: they are text;
* a global scalar (``loss``): one chart in the ``training`` category, which comes first;
* alerts: the alerts raised at each sampled step, one run per level
  (``alerts/critical``, ...), zero where none fired, so each alert is a spike at its step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from diag.catalog.metrics import FAMILIES, chart_stat, charted, family
from diag.catalog.tags import layer_run_tag, parse_tag

__all__ = ["ALERT_CATEGORY", "ALERT_LEVELS", "ALERT_EVENT_TAG", "alert_run", "build_layout"]

ALERT_CATEGORY = "alerts"
ALERT_LEVELS = ("critical", "warning", "info")
ALERT_EVENT_TAG = "alerts_raised"


def alert_run(level: str) -> str:
    """The TensorBoard run (a sub-folder of the logdir) of the alert events of one level."""
    return f"alerts/{level}"


def build_layout(tags: Iterable[str], updates: Iterable[str] = ()) -> dict[str, dict[str, list]]:
    """The layout for a run whose scalar ``tags`` are known (a sampled step's record).

    updates: the update metrics the run writes (:func:`diag.catalog.metrics.update_metric_names`; the
    ``o`` ones only when a layer has W_O), which arrive one call after the step they
    describe: charted too.
    """
    per_head: set[str] = set()
    per_layer: set[str] = set(updates)
    global_tags: set[str] = set()
    for tag in tags:
        parsed = parse_tag(tag)
        if parsed is None:
            continue
        if parsed.layer is None:
            global_tags.add(tag)
        elif parsed.part in ("max", "min", "mean"):
            per_head.add(parsed.metric)
        elif parsed.part is None and charted(parsed.metric):
            per_layer.add(parsed.metric)
    charts: dict[str, dict[str, list]] = {}
    for tag in sorted(global_tags):
        charts.setdefault("training", {})[tag] = ["Multiline", [rf"^{re.escape(tag)}$"]]
    order = [*FAMILIES, "other"]
    for metric in sorted(per_head | per_layer, key=lambda m: (order.index(family(m)), m)):
        if metric in per_head:
            stat = chart_stat(metric)
            title, tag = f"{metric} ({stat} over heads), a line per layer", layer_run_tag(metric, stat)
        else:
            title, tag = f"{metric}, a line per layer", layer_run_tag(metric)
        charts.setdefault(family(metric), {})[title] = ["Multiline", [rf"^{re.escape(tag)}$"]]
    charts[ALERT_CATEGORY] = {"alerts raised per sampled step, a line per level":
                              ["Multiline", [rf"^{ALERT_EVENT_TAG}$"]]}
    return charts

