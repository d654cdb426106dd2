"""The data of the TensorBoard images: layer x head grids, their colour ranges and words, the heads whose
attention maps an alert asks for, the update ratios over time.

Pure numpy: the grids, colour ranges and titles (:func:`layer_head_data`, from the catalog's entries,
:mod:`diag.catalog.metrics`) that :mod:`diag.outputs.figures` draws with axes, tick values and a colour bar
(matplotlib). This module draws nothing and imports nothing of :mod:`diag.outputs.figures`.

Image tags (see docs/tensorboard.md):

* ``heatmap/<metric>``: rows = layers, columns = heads, for each metric the catalog shows as a heatmap;
* ``attention_map/L03/H05``: the attention probabilities of a head an alert
  names, queries down, keys across, on a fixed 0..1 scale;
* ``step_size/update_ratio_q``: rows = layers, columns = sampled steps, the
  update ratio sigma_1(dW)/sigma_1(W) on a log scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from diag.catalog.metrics import METRICS, metrics_with
from diag.catalog.tags import parse_tag, parse_where
from diag.errors import ConfigError
from diag.outputs.sinks import Record

__all__ = [
    "HeatmapData",
    "finite_range",
    "layer_head_grid",
    "entropy_fraction",
    "layer_head_data",
    "heatmap_metrics",
    "ALERT_MAPS_PER_STEP",
    "flagged_heads",
    "UpdateRatioHistory",
]


def finite_range(values: np.ndarray) -> tuple[float, float]:
    """The smallest and the largest finite value (0 and 1 when there is none)."""
    finite = values[np.isfinite(values)]
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)


# ---------------------------------------------------------------- layer x head


def layer_head_grid(arrays: Mapping[str, Mapping[str, np.ndarray]], labels: Sequence[str], metric: str) -> np.ndarray:
    """(layers, most heads) float64: row i is ``arrays[labels[i]][metric]``, NaN where a layer lacks
    the metric (refused, not measured) or has fewer heads."""
    rows = [np.asarray(arrays.get(label, {}).get(metric, ()), dtype=np.float64).reshape(-1) for label in labels]
    width = max((r.size for r in rows), default=0)
    grid = np.full((len(rows), max(width, 1)), np.nan)
    for i, r in enumerate(rows):
        grid[i, : r.size] = r
    return grid


def entropy_fraction(arrays: Mapping[str, Mapping[str, np.ndarray]], labels: Sequence[str]) -> np.ndarray:
    """attn_entropy divided by the entropy of uniform attention over the same keys (per layer)."""
    grid = layer_head_grid(arrays, labels, "attn_entropy")
    uniform = layer_head_grid(arrays, labels, "attn_entropy_uniform")[:, :1]
    with np.errstate(all="ignore"):
        return grid / np.where(uniform > 0, uniform, np.nan)


class HeatmapData(NamedTuple):
    """What a layer x head heatmap shows: the grid, its colour range, its title and the colour bar's label."""

    grid: np.ndarray  # (layers, most heads)
    lo: float
    hi: float
    title: str
    cbar: str  # the colour bar's label


def layer_head_data(arrays: Mapping[str, Mapping[str, np.ndarray]], labels: Sequence[str], metric: str) -> HeatmapData:
    """The heatmap of ``metric`` over layers and heads, in its catalog entry's colour range (ends the
    entry leaves open from the grid: a fixed range keeps colours comparable across steps). The attention
    entropy is shown as a fraction of uniform attention's over the same keys (0 .. 1) where the layers
    carry ``attn_entropy_uniform``."""
    entry = METRICS[metric]
    present = {m for metrics in arrays.values() for m in metrics}
    if metric == "attn_entropy" and "attn_entropy_uniform" in present:
        return HeatmapData(entropy_fraction(arrays, labels), 0.0, 1.0, f"{entry.title} / uniform's",
                           "fraction of uniform (0 = one key)")
    grid = layer_head_grid(arrays, labels, metric)
    lo, hi = entry.colour_range(*finite_range(grid))
    return HeatmapData(grid, lo, hi, entry.title, entry.unit or entry.title)


def heatmap_metrics(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> list[str]:
    """The metrics the catalog shows as layer x head heatmaps that ``arrays`` holds, in catalog order."""
    present = {m for metrics in arrays.values() for m in metrics}
    return [m.name for m in metrics_with("heatmap") if m.name in present]


# ---------------------------------------------------------------- attention maps


# Attention maps written per sampled step at most (alerts can name many heads at once, e.g. every
# head of an encoder turning uniform at initialisation); the most severe alerts first.
ALERT_MAPS_PER_STEP = 8
_LEVEL_ORDER = {"critical": 0, "warning": 1, "info": 2}


def flagged_heads(alerts: Iterable, most: int = ALERT_MAPS_PER_STEP) -> list[tuple[str, str, int]]:
    """``(where, layer label, head)`` for each head an alert names (``where`` = ``L03/H05``), each head
    once, the most severe level first, at most ``most``. Alerts about a layer or the model are skipped."""
    heads: dict[str, tuple[str, str, int]] = {}
    for alert in sorted(alerts, key=lambda a: _LEVEL_ORDER.get(a.level, len(_LEVEL_ORDER))):
        for name in getattr(alert, "heads", ()) or (alert.where,):  # a layer's record names its heads
            where = parse_where(name)
            if where is not None and where[1] is not None and name not in heads and len(heads) < most:
                heads[name] = (name, where[0], where[1])
    return list(heads.values())


# ---------------------------------------------------------------- update ratios over time


class UpdateRatioHistory:
    """A sink that keeps ``update_ratio_<x>/<layer>`` per step, for the update-ratio figures.

    Bounded: past ``2 * most`` steps every other step is dropped (so the figure spans the
    whole run at an even, coarser spacing). Writes nothing anywhere.
    """

    def __init__(self, most: int = 512) -> None:
        if most < 1:
            raise ConfigError(f"UpdateRatioHistory(most={most}): expected an integer >= 1, e.g. most=512")
        self.most = most
        self.series: dict[int, dict[tuple[str, str], float]] = {}  # step -> {(metric, layer): ratio}

    def write(self, record: Record) -> None:
        for tag, value in record.scalars.items():
            parsed = parse_tag(tag)
            if parsed and parsed.layer and parsed.part is None and parsed.metric.startswith("update_ratio_"):
                self.series.setdefault(record.step, {})[(parsed.metric, parsed.layer)] = float(value)
        if len(self.series) > 2 * self.most:
            steps = sorted(self.series)
            for step in steps[-2::-2]:  # every other step, the newest kept
                del self.series[step]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def steps(self) -> list[int]:
        return sorted(self.series)

    def matrix(self, metric: str, labels: Sequence[str]) -> np.ndarray:
        """(layers, steps) float64 of ``metric``; NaN where a step lacks a layer."""
        steps = self.steps()
        out = np.full((len(labels), len(steps)), np.nan)
        for j, step in enumerate(steps):
            values = self.series[step]
            for i, label in enumerate(labels):
                out[i, j] = values.get((metric, label), math.nan)
        return out

    def metrics(self) -> list[str]:
        return sorted({metric for values in self.series.values() for metric, _ in values})
