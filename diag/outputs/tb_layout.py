"""The custom-scalars layout: one chart per metric with every layer, by family, and the alerts.

Built from the tags a run really wrote (the first sampled step's record), so it
follows whatever the Monitor logs: a metric that is not written gets no chart, a
new metric gets one without a change here. Format: what
``SummaryWriter.add_custom_scalars`` takes,
``{category: {chart title: ["Multiline", [tag regex, ...]]}}``; TensorBoard's
custom-scalars plugin matches each regex against the run's scalar tags with
``re.match``, so every regex here is anchored at both ends.

* a per-head metric (tags ``<metric>/L03/max|min|mean``): one chart of one
  statistic across heads, every layer a line; the statistic is the one that
  moves towards trouble (:data:`CHART_STAT`, ``max`` for a metric not listed);
* a layer metric (``<metric>/L03``): one chart, every layer a line;
* a global scalar (``loss``): one chart in the ``training`` category, which comes first;
* ``alerts/<kind>``: one chart with every alert kind (empty until an alert fires).

Categories follow the Monitor's signals by metric-name prefix (:data:`FAMILIES`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["FAMILIES", "CHART_STAT", "ALERT_CATEGORY", "build_layout", "chart_regexes", "family"]

# metric-name prefix -> category (the Monitor's signal that writes it)
FAMILIES = {"qk_": "spectra", "attn_": "attention", "grad_": "grads", "update_": "updates"}
ALERT_CATEGORY = "alerts"
# The statistic across heads charted per metric: the direction that signals trouble.
CHART_STAT = {
    "qk_sigma1": "max",  # the fastest-growing head
    "qk_sec": "max",  # the most concentrated spectrum
    "qk_erank": "min",
    "qk_stable_rank": "min",
    "attn_entropy": "min",  # the most collapsed head
    "attn_rank": "min",
    "attn_max_logit": "max",
    "grad_norm_q": "mean",  # the Eureka plateau compares Q/K with V gradients layer-wide
    "grad_norm_k": "mean",
    "grad_norm_v": "mean",
}

_TAG = re.compile(r"^(?P<metric>[a-z0-9_]+)/(?P<layer>L\d+(?:\.cross)?)(?:/(?P<rest>H\d+|max|min|mean|heads))?$")
_LAYER = r"L\d+(?:\.cross)?"


def family(metric: str) -> str:
    """The category of a metric: its signal family, or ``other``."""
    return next((cat for prefix, cat in FAMILIES.items() if metric.startswith(prefix)), "other")


def build_layout(tags: Iterable[str], updates: Iterable[str] = ()) -> dict[str, dict[str, list]]:
    """The layout for a run whose scalar ``tags`` are known (a sampled step's record).

    updates: the update metrics the run writes (:func:`diag.outputs.tags.update_metric_names`; the
    ``o`` ones only when a layer has W_O), which arrive one call after the step they
    describe: charted too.
    """
    per_head: set[str] = set()
    per_layer: set[str] = set(updates)
    global_tags: set[str] = set()
    for tag in tags:
        match = _TAG.match(tag)
        if match is None:
            if "/" not in tag:
                global_tags.add(tag)
            continue
        rest = match["rest"]
        if rest in ("max", "min", "mean"):
            per_head.add(match["metric"])
        elif rest is None:
            per_layer.add(match["metric"])
    charts: dict[str, dict[str, list]] = {}
    for tag in sorted(global_tags):
        charts.setdefault("training", {})[tag] = ["Multiline", [rf"^{re.escape(tag)}$"]]
    order = [*FAMILIES.values(), "other"]
    for metric in sorted(per_head | per_layer, key=lambda m: (order.index(family(m)), m)):
        if metric in per_head:
            stat = CHART_STAT.get(metric, "max")
            title, regex = f"{metric} ({stat} over heads), all layers", rf"^{metric}/{_LAYER}/{stat}$"
        else:
            title, regex = f"{metric}, all layers", rf"^{metric}/{_LAYER}$"
        charts.setdefault(family(metric), {})[title] = ["Multiline", [regex]]
    charts[ALERT_CATEGORY] = {"alerts per step, by kind": ["Multiline", [r"^alerts/.+$"]]}
    return charts


def chart_regexes(layout: dict[str, dict[str, list]]) -> dict[tuple[str, str], list[str]]:
    """``{(category, chart title): [regex, ...]}`` of a layout in the format above."""
    return {(cat, title): list(spec[1]) for cat, charts in layout.items() for title, spec in charts.items()}
