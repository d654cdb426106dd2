"""The data of the TensorBoard images: layer x head grids, attention maps, update ratios over time.

Pure numpy: the grids, colour ranges and words (:func:`layer_head_data`, from the catalog's entries,
:mod:`diag.catalog.metrics`) that :mod:`diag.outputs.figures` draws with axes, tick values and a colour
bar (matplotlib), and a plain pixel rendering of them. This module draws nothing with matplotlib and
imports nothing of :mod:`diag.outputs.figures`. Every image is a
(height, width, 3) uint8 RGB array for ``SummaryWriter.add_image(..., dataformats="HWC")``. Each value is one block of
``cell x cell`` identical pixels (nearest neighbour, so a browser that scales
the image never blurs two heads together); row 0 is at the top.

Colour: viridis (dark purple = low, yellow = high) from a 17-colour table taken
from matplotlib's viridis and linearly interpolated to 256 entries (within
6/255 of matplotlib's, checked by the tests); matplotlib is not imported here.
Non-finite values (and missing heads or layers) are mid grey, a colour viridis
does not contain.

Image tags (see docs/tensorboard.md):

* ``heatmap/<metric>``: rows = layers, columns = heads, for each metric the catalog shows as a heatmap;
* ``attention_map/L03/H05``: the attention probabilities of a head an alert
  names, queries down, keys across, on a fixed 0..1 scale;
* ``step_size/update_ratio_q``: rows = layers, columns = sampled steps, the
  log10 of sigma_1(dW)/sigma_1(W) on the range of the image.
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
    "VIRIDIS_ANCHORS",
    "MISSING",
    "HeatmapData",
    "colormap",
    "colorize",
    "cell_size",
    "heatmap",
    "finite_range",
    "layer_head_grid",
    "entropy_fraction",
    "layer_head_data",
    "heatmap_metrics",
    "layer_head_heatmaps",
    "attention_map_image",
    "ALERT_MAPS_PER_STEP",
    "flagged_heads",
    "update_ratio_image",
    "UpdateRatioHistory",
]

# matplotlib 3.11 viridis at 0, 1/16, ..., 1 (RGB, 0..255).
VIRIDIS_ANCHORS = np.array(
    [[68, 1, 84], [72, 24, 106], [71, 45, 123], [66, 64, 134], [59, 82, 139], [51, 99, 141], [44, 114, 142],
     [38, 130, 142], [33, 145, 140], [31, 160, 136], [40, 174, 128], [63, 188, 115], [94, 201, 98],
     [132, 212, 75], [173, 220, 48], [216, 226, 25], [253, 231, 37]],
    dtype=np.float64,
)
MISSING = np.array([128, 128, 128], dtype=np.uint8)  # non-finite or absent values


def colormap(n: int = 256) -> np.ndarray:
    """The viridis table: (n, 3) uint8, entry 0 for the low end."""
    x = np.linspace(0.0, 1.0, n)
    anchors = np.linspace(0.0, 1.0, len(VIRIDIS_ANCHORS))
    lut = np.stack([np.interp(x, anchors, VIRIDIS_ANCHORS[:, c]) for c in range(3)], axis=1)
    return np.rint(lut).astype(np.uint8)


_LUT = colormap()


def colorize(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """(R, C) numbers -> (R, C, 3) uint8: ``lo`` (and below) is the first colour, ``hi`` (and above)
    the last, linear in between; non-finite values are :data:`MISSING`."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    span = hi - lo if hi > lo else 1.0
    with np.errstate(invalid="ignore"):
        t = np.clip((np.where(finite, v, lo) - lo) / span, 0.0, 1.0)
    out = _LUT[np.rint(t * (len(_LUT) - 1)).astype(np.intp)]
    out[~finite] = MISSING
    return out


def cell_size(n_rows: int, n_cols: int, target: int = 256, most: int = 16) -> int:
    """Pixels per value so that the longer side is about ``target`` pixels (1 to ``most``)."""
    return max(1, min(most, target // max(n_rows, n_cols, 1)))


def heatmap(values: np.ndarray, lo: float, hi: float, cell: int | tuple[int, int] | None = None) -> np.ndarray:
    """(R, C) numbers -> (R * cell_h, C * cell_w, 3) uint8; ``cell`` defaults to :func:`cell_size`."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.size == 0:
        raise ConfigError(f"heatmap: expected a non-empty 2-D array (rows x columns), got shape {values.shape}; "
                          "pass one value per layer and head")
    if cell is None:
        cell = cell_size(*values.shape)
    cell_h, cell_w = (cell, cell) if isinstance(cell, int) else cell
    rgb = colorize(values, lo, hi)
    return np.repeat(np.repeat(rgb, cell_h, axis=0), cell_w, axis=1)


def finite_range(values: np.ndarray, lo: float | None = None, hi: float | None = None) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if lo is None:
        lo = float(finite.min()) if finite.size else 0.0
    if hi is None:
        hi = float(finite.max()) if finite.size else 1.0
    return lo, hi


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


def layer_head_heatmaps(arrays: Mapping[str, Mapping[str, np.ndarray]], labels: Sequence[str]) -> dict[str, np.ndarray]:
    """``{"heatmap/<metric>": image}`` for each heatmap metric (:func:`heatmap_metrics`) that ``arrays`` holds."""
    images = {}
    for metric in heatmap_metrics(arrays):
        data = layer_head_data(arrays, labels, metric)
        images[f"heatmap/{metric}"] = heatmap(data.grid, data.lo, data.hi)
    return images


# ---------------------------------------------------------------- attention maps


def attention_map_image(probs: np.ndarray) -> np.ndarray:
    """(queries, keys) attention probabilities -> image on the fixed scale 0 .. 1 (a key that takes
    all of a query's mass is yellow; uniform attention over n keys is 1/n, near the dark end)."""
    return heatmap(probs, 0.0, 1.0, cell_size(*np.shape(probs), target=256, most=8))


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


def update_ratio_image(values: np.ndarray) -> np.ndarray:
    """(layers, steps) update ratios -> log10 heatmap on the finite range of the image.

    A ratio of 0 (a layer that did not move) takes the low end; NaN is grey. Columns are
    8 pixels wide up to 64 steps, then narrower down to one pixel per step (beyond 512 steps
    the image is as wide as the number of steps; :class:`UpdateRatioHistory` keeps at most 1024).
    """
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(all="ignore"):
        logv = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.where(v == 0, -np.inf, np.nan))
    lo, hi = finite_range(logv)
    logv = np.where(np.isneginf(logv), lo, logv)
    n_layers, n_steps = v.shape
    cell_w = max(1, min(8, 512 // max(n_steps, 1)))
    cell_h = max(2, min(16, 256 // max(n_layers, 1)))
    return heatmap(logv, lo, hi, (cell_h, cell_w))


class UpdateRatioHistory:
    """A sink that keeps ``update_ratio_<x>/<layer>`` per step, for :func:`update_ratio_image`.

    Bounded: past ``2 * most`` steps every other step is dropped (so the image spans the
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

    def images(self, labels: Sequence[str]) -> dict[str, np.ndarray]:
        """``{"step_size/<metric>": image}`` for each update-ratio metric seen so far (plain pixels)."""
        return {f"step_size/{m}": update_ratio_image(self.matrix(m, labels)) for m in self.metrics()}
