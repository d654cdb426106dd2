"""The tag scheme shared by the live monitor, the checkpoint analysis and the docs.

Which tags a metric gets follows its catalog entry's ``per`` (:mod:`diag.catalog.metrics`):

* per head:   ``<metric>/L<layer>/H<head>``     e.g. ``qk_sigma1/L03/H07``
* per layer:  ``<metric>/L<layer>/<stat>``      stat in max, min, mean (across heads)
* layer-only: ``<metric>/L<layer>``             e.g. ``update_ratio_q/L03``, ``update_ratio_o/L03``
* histogram:  ``<metric>/L<layer>/heads``        the values of all heads of a layer
* spectrum:   ``<metric>/L<layer>``             a histogram of a layer's values, e.g. ``qk_spectrum/L03``
* global:     ``<metric>``                      e.g. ``loss``
* alerts:     ``alerts/<kind>``                 the number of episodes of a kind started at a step

TensorBoard also gets one run per layer (a sub-folder ``L03/`` of the logdir, see
:func:`layer_runs`) holding ``by_layer/<metric>/<stat>`` and ``by_layer/<metric>``: the same
name in every layer's run, so one chart shows every layer as a line of its own colour, named
in the legend. This module builds the metric tags above and parses them back (:func:`parse_tag`,
:func:`parse_where`); the tags of other outputs (``alerts/``, ``heatmap/``,
``step_size/``, ``attention_map/``, ``step_limit_*``) are written by those outputs, outside this
scheme (docs/tensorboard.md lists them all; the step limit's per-layer ``/mean`` and ``/min`` follow it).

Layers are counted from 0 in module registration order (the order of the state
dict, which is the execution order for every supported family) and zero-padded
to at least two digits; heads likewise. A cross-attention layer carries the
suffix ``.cross`` (``L03.cross``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from diag.catalog.metrics import chart_stat, charted

__all__ = [
    "Tag",
    "parse_tag",
    "parse_where",
    "layer_runs",
    "layer_run_tag",
    "LAYER_RUN_PREFIX",
    "layer_label",
    "layer_labels",
    "head_label",
    "head_tag",
    "stat_tag",
    "layer_tag",
    "histogram_tag",
]

LAYER_RUN_PREFIX = "by_layer"
LAYER = r"L\d+(?:\.cross)?"
_TAG = re.compile(rf"^(?P<metric>[A-Za-z0-9_.]+)/(?P<layer>{LAYER})(?:/(?P<part>H\d+|max|min|mean|heads))?$")
_WHERE = re.compile(rf"^(?P<layer>{LAYER})(?:/H(?P<head>\d+))?$")


@dataclass(frozen=True)
class Tag:
    """A parsed tag: ``metric``; ``layer`` (``L03``, ``L03.cross``) or None for a global tag; ``part``:
    ``H07``, a statistic (``max``, ``min``, ``mean``), ``heads`` (histogram) or None (a layer metric)."""

    metric: str
    layer: str | None = None
    part: str | None = None

    @property
    def head(self) -> int | None:
        return int(self.part[1:]) if self.part and self.part[0] == "H" else None


@lru_cache(maxsize=8192)  # a run's tags recur at every sample; a Tag is frozen, so one object serves every call
def parse_tag(tag: str) -> Tag | None:
    """The parts of a tag of this scheme; a global tag (no ``/``) is ``Tag(tag)``; None for anything else
    (``alerts/<kind>``, the per-matrix ``step_limit_<key>/Lxx/<role>`` and the other tags written outside this
    scheme; the step limit's per-layer ``step_limit_<key>/Lxx/<stat>`` follow it)."""
    if "/" not in tag:
        return Tag(tag)
    match = _TAG.match(tag)
    return None if match is None else Tag(match["metric"], match["layer"], match["part"])


def parse_where(where: str) -> tuple[str, int | None] | None:
    """``"L03/H05"`` -> ``("L03", 5)``, ``"L03"`` -> ``("L03", None)``; None for ``""`` (the model)."""
    match = _WHERE.match(where)
    if match is None:
        return None
    return match["layer"], None if match["head"] is None else int(match["head"])


def layer_run_tag(metric: str, stat: str | None = None) -> str:
    """The tag of a metric in the per-layer runs: ``by_layer/qk_sigma1/max``, ``by_layer/update_ratio_q``."""
    return f"{LAYER_RUN_PREFIX}/{metric}" + (f"/{stat}" if stat else "")


def layer_runs(scalars: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{layer label: {by_layer tag: value}}``: the charted statistic of each per-head metric
    (:func:`~diag.catalog.metrics.chart_stat`) and each charted layer metric (not the constants)."""
    runs: dict[str, dict[str, float]] = {}
    for tag, value in scalars.items():
        parsed = parse_tag(tag)
        if parsed is None or parsed.layer is None:
            continue
        if parsed.part is None and charted(parsed.metric):
            runs.setdefault(parsed.layer, {})[layer_run_tag(parsed.metric)] = value
        elif parsed.part == chart_stat(parsed.metric):
            runs.setdefault(parsed.layer, {})[layer_run_tag(parsed.metric, parsed.part)] = value
    return runs


def _pad(i: int, count: int) -> str:
    return str(i).zfill(max(2, len(str(max(count - 1, 0)))))


def layer_label(index: int, n_layers: int, cross: bool = False) -> str:
    return f"L{_pad(index, n_layers)}" + (".cross" if cross else "")


def head_label(head: int, n_heads: int) -> str:
    return f"H{_pad(head, n_heads)}"


def head_tag(metric: str, layer: str, head: int, n_heads: int) -> str:
    return f"{metric}/{layer}/{head_label(head, n_heads)}"


def stat_tag(metric: str, layer: str, stat: str) -> str:
    return f"{metric}/{layer}/{stat}"


def layer_tag(metric: str, layer: str) -> str:
    return f"{metric}/{layer}"


def histogram_tag(metric: str, layer: str) -> str:
    return f"{metric}/{layer}/heads"


def layer_labels(cross: list[bool]) -> list[str]:
    """Tag labels in registration order: a cross-attention layer shares the index of its block.

    Each self-attention layer opens the next index; a cross-attention layer takes the
    index of the self-attention layer just before it (``L02``, ``L02.cross``), or opens
    the next index itself when there is none or that index already has a cross layer.
    """
    indices, last, taken = [], -1, set()
    for is_cross in cross:
        if not is_cross or last < 0 or last in taken:
            last += 1
        if is_cross:
            taken.add(last)
        indices.append(last)
    count = last + 1
    return [layer_label(i, count, c) for i, c in zip(indices, cross)]
