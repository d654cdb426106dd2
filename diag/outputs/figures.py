"""Figures with axes, tick values, labels and a colour bar, drawn to RGB arrays for TensorBoard.

matplotlib's object API on the Agg canvas (no pyplot, no global backend, no display),
imported inside the functions: a training process imports it only when a sampled step
writes images, never when ``hooks`` or ``diag`` is imported. Each function returns a
(height, width, 3) uint8 array for ``SummaryWriter.add_image(..., dataformats="HWC")``.
The data behind a figure comes from :mod:`diag.outputs.images` (same grids, same colour
ranges, the words of the catalog's entries); missing values (a refused layer, a head a layer
lacks, NaN) are grey.

Conventions: rows are layers (``L00`` at the top), columns heads or sampled steps; the
title says what is shown and at which step; the colour bar says the units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from diag.catalog.metrics import METRICS
from diag.outputs.images import UpdateRatioHistory, heatmap_metrics, layer_head_data

__all__ = ["figure", "to_rgb", "grid_figure", "layer_head_figures", "update_ratio_figure", "update_ratio_figures",
           "attention_map_figure"]

DPI = 80
GREY = "#808080"


def figure(width: float, height: float):
    """A matplotlib Figure on its own Agg canvas (constrained layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_rgb(fig) -> np.ndarray:
    """The drawn figure as (height, width, 3) uint8."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _ticks(ax, axis: str, labels: Sequence[str], most: int = 24) -> None:
    stride = max(1, -(-len(labels) // most))
    positions = list(range(0, len(labels), stride))
    getattr(ax, f"set_{axis}ticks")(positions, [labels[i] for i in positions])


def grid_figure(grid: np.ndarray, *, title: str, rows: Sequence[str], cols: Sequence[str], xlabel: str,
                ylabel: str, cbar: str, lo: float, hi: float, log: bool = False, annotate: bool = True):
    """A heatmap of ``grid`` (rows x cols) with labelled ticks and a colour bar; returns the Figure."""
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize

    cmap = colormaps["viridis"].with_extremes(bad=GREY)
    hi = hi if hi > lo else lo + 1.0
    norm = LogNorm(lo, hi) if log else Normalize(lo, hi)
    fig = figure(min(4.6 + 0.4 * len(cols), 9.5), min(2.4 + 0.35 * len(rows), 7.0))
    ax = fig.subplots()
    shown = np.ma.masked_invalid(grid)
    image = ax.imshow(shown, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.title.set_fontsize("medium")
    _ticks(ax, "x", cols)
    _ticks(ax, "y", rows)
    if annotate and grid.size <= 64:
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):  # dark text on the bright end of viridis, white on the dark end
                light = norm(value) > 0.6
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize="small",
                        color="black" if light else "white")
    fig.colorbar(image, ax=ax, label=cbar)
    return fig


def layer_head_figures(arrays: Mapping[str, Mapping[str, np.ndarray]], labels: Sequence[str],
                       step: int) -> dict[str, np.ndarray]:
    """``{"heatmap/<metric>": RGB}``: the layer x head heatmaps (:func:`diag.outputs.images.heatmap_metrics`)."""
    out = {}
    for metric in heatmap_metrics(arrays):
        data = layer_head_data(arrays, labels, metric)
        heads = [f"H{h}" for h in range(data.grid.shape[1])]
        fig = grid_figure(data.grid, title=f"{data.title}, step {step}", rows=list(labels), cols=heads,
                          xlabel="head", ylabel="layer", cbar=data.cbar, lo=data.lo, hi=data.hi)
        out[f"heatmap/{metric}"] = to_rgb(fig)
    return out


def update_ratio_figure(values: np.ndarray, steps: Sequence[int], labels: Sequence[str], metric: str) -> np.ndarray:
    """(layers, steps) update ratios as a strip over the sampled steps, log colour scale."""
    v = np.asarray(values, dtype=np.float64)
    positive = v[np.isfinite(v) & (v > 0)]
    lo, hi = (float(positive.min()), float(positive.max())) if positive.size else (1e-6, 1.0)
    if hi <= lo:
        lo, hi = lo / 10, hi * 10
    shown = np.where(v > 0, v, np.where(v == 0, lo, np.nan))  # a layer that did not move: the low end
    fig = grid_figure(shown, title=f"{metric}: {METRICS[metric].title} per layer, "
                      f"steps {steps[0]}..{steps[-1]}" if steps else metric,
                      rows=list(labels), cols=[str(s) for s in steps], xlabel="sampled step", ylabel="layer",
                      cbar="update ratio (log scale)", lo=lo, hi=hi, log=True, annotate=False)
    return to_rgb(fig)


def update_ratio_figures(history: UpdateRatioHistory, labels: Sequence[str]) -> dict[str, np.ndarray]:
    """``{"step_size/<metric>": RGB}``: each update-ratio metric ``history`` has seen, over its steps."""
    steps = history.steps()
    return {f"step_size/{m}": update_ratio_figure(history.matrix(m, labels), steps, labels, m)
            for m in history.metrics()}


def attention_map_figure(probs: np.ndarray, where: str, step: int) -> np.ndarray:
    """(queries, keys) attention probabilities of one head on the fixed scale 0..1."""
    n_q, n_k = np.shape(probs)
    fig = figure(5.5, 4.6)
    ax = fig.subplots()
    image = ax.imshow(probs, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set(title=f"attention of {where} at step {step} (first sequence)", xlabel=f"key position (0..{n_k - 1})",
           ylabel=f"query position (0..{n_q - 1})")
    ax.title.set_fontsize("medium")
    fig.colorbar(image, ax=ax, label="attention probability")
    return to_rgb(fig)
