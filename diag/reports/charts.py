"""The charts of the live-run report (:mod:`diag.reports.run`): small multiples that line up step for step.

* Every chart's step axis spans the whole run (:class:`Frame`: its first to its last step), whatever steps the
  chart's own data or its alerts reach.
* Alert episodes are drawn in a strip above a chart's curves, one lane per level (critical on top), each in its
  level's colour at full strength: episodes of different levels never cover each other, so every shading on the
  page has a colour the legend names (translucent shadings of two levels would blend into a colour it lacks).
* Legends sit outside the axes, right of them, never over a line. Each layer has one colour on every chart: up to
  :data:`MOST_NAMED` layers a colour each, named in the legend; more, a colour scale over depth with a colour bar.

matplotlib's object API on the Agg canvas (:func:`diag.outputs.figures.figure`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from diag.outputs.figures import GREY, figure
from diag.reports.html import LEVEL_COLOURS, integer_steps

__all__ = ["Episode", "Frame", "HEIGHT", "Line", "MOST_NAMED", "WIDTH", "layer_colours", "line_chart", "timeline",
           "steps_heatmap"]

WIDTH, HEIGHT = 7.0, 3.4  # inches of one small multiple (at the reports' 110 dpi about 770 x 375 px)
MOST_NAMED = 10  # layers named one by one in a legend; more get a colour scale over depth
Episode = tuple[str, str, str, int, int]  # (level, kind, where, first step, last step)


@dataclass(frozen=True)
class Frame:
    """What every chart of one run shares: its first and last step, the steps between samples, the alert
    episodes and the colour of each layer."""

    first: int
    last: int
    spacing: int = 1
    episodes: tuple[Episode, ...] = ()
    colours: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def levels(self) -> list[str]:
        """The levels that have an episode, most severe first: the lanes of the strip, top down."""
        present = {e[0] for e in self.episodes}
        return [level for level in LEVEL_COLOURS if level in present]

    @property
    def limits(self) -> tuple[float, float]:
        pad = max(self.spacing, 1) / 2
        return self.first - pad, self.last + pad


@dataclass(frozen=True)
class Line:
    """One curve: a layer's (``label`` is the layer) or the run's own (the loss)."""

    label: str
    steps: np.ndarray
    values: np.ndarray


def layer_colours(layers: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """A colour per layer, the same on every chart: tab10 up to :data:`MOST_NAMED` layers, else viridis by depth."""
    from matplotlib import colormaps

    if len(layers) <= MOST_NAMED:
        return {la: colormaps["tab10"](i) for i, la in enumerate(layers)}
    return {la: colormaps["viridis"](i / (len(layers) - 1)) for i, la in enumerate(layers)}


def _strip(fig, frame: Frame):
    """(strip, axes): the episode lanes above the curves' axes, sharing their steps; (None, axes) without any."""
    lanes = frame.levels
    if not lanes:
        return None, fig.subplots()
    strip, ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.2 * len(lanes), HEIGHT - 1.0])
    for level, _, _, first, last in frame.episodes:
        strip.barh(lanes.index(level), last - first + frame.spacing / 2, left=first - frame.spacing / 4,
                   height=0.8, color=LEVEL_COLOURS[level], linewidth=0)
    strip.set_ylim(len(lanes) - 0.5, -0.5)
    strip.set_yticks(range(len(lanes)), lanes, fontsize="x-small")
    strip.tick_params(axis="both", length=0, labelbottom=False)
    for spine in strip.spines.values():
        spine.set_color("#cccccc")
    return strip, ax


def _episode_handles(frame: Frame) -> list:
    from matplotlib.patches import Patch

    return [Patch(facecolor=LEVEL_COLOURS[lv], label=f"{lv} alert episode") for lv in frame.levels]


def _depth_bar(fig, ax, frame: Frame) -> None:
    """A colour bar over the layers' depth (first layer to last), for charts with more layers than a legend
    names."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    layers = list(frame.colours)
    bar = fig.colorbar(ScalarMappable(Normalize(-0.5, len(layers) - 0.5),
                                      ListedColormap([frame.colours[la] for la in layers])), ax=ax, label="layer")
    stride = max(1, -(-len(layers) // 8))
    bar.set_ticks(range(0, len(layers), stride), labels=layers[::stride])


def line_chart(frame: Frame, lines: Sequence[Line], *, title: str, ylabel: str, log: bool = False):
    """Curves over the whole run under the episode strip; a layer's line in its colour, the run's own in black."""
    fig = figure(WIDTH, HEIGHT)
    _, ax = _strip(fig, frame)
    fig.suptitle(title, fontsize="medium")  # above the strip (a title on the strip itself upsets the layout)
    for line in lines:
        ax.plot(line.steps, line.values, marker=".", markersize=4, label=line.label,
                color=frame.colours.get(line.label, "black"))
    ax.set(xlabel="step", ylabel=ylabel, xlim=frame.limits)
    if log:
        ax.set_yscale("log")
    integer_steps(ax)
    layers = [line for line in lines if line.label in frame.colours]
    handles = _episode_handles(frame)
    if layers and len(frame.colours) > MOST_NAMED:
        _depth_bar(fig, ax, frame)
    elif layers:
        handles = list(ax.get_lines()) + handles
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize="small", frameon=False)
    return fig


def timeline(frame: Frame, kinds: Sequence[str]):
    """Each alert kind's episodes as bars in its row over the whole run, in the colour of their level; where a
    head's warning and its layer's critical record share steps, the critical bar is drawn on top."""
    fig = figure(2 * WIDTH, 1.3 + 0.3 * len(kinds))
    ax = fig.subplots()
    severity = list(LEVEL_COLOURS)
    for level, kind, _, first, last in frame.episodes:
        ax.barh(kinds.index(kind), last - first + frame.spacing / 2, left=first - frame.spacing / 4, height=0.6,
                color=LEVEL_COLOURS[level], linewidth=0, zorder=3 + len(severity) - severity.index(level),
                label=level)
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set(xlabel="step", xlim=frame.limits, ylim=(len(kinds) - 0.5, -0.5))
    ax.grid(axis="x", color="#eeeeee", zorder=0)
    integer_steps(ax)
    ax.set_title("alert episodes over the run, by kind", fontsize="medium")
    if frame.levels:
        fig.legend(handles=_episode_handles(frame), loc="outside right upper", fontsize="small", frameon=False)
    return fig


def _edges(steps: Sequence[int], frame: Frame) -> np.ndarray:
    """Cell edges on the step axis: halfway between sampled steps, half a gap beyond the first and the last."""
    s = np.asarray(steps, dtype=np.float64)
    if s.size == 1:
        return np.array([s[0] - frame.spacing / 2, s[0] + frame.spacing / 2])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def steps_heatmap(frame: Frame, grid: np.ndarray, steps: Sequence[int], rows: Sequence[str], *, title: str,
                  ylabel: str, cbar: str, lo: float, hi: float):
    """``grid`` (rows x sampled steps) as cells centred on their steps over the whole run; missing values grey."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    fig = figure(WIDTH, min(1.6 + 0.22 * len(rows), 7.0))
    ax = fig.subplots()
    norm = Normalize(lo, hi if hi > lo else lo + 1.0)
    mesh = ax.pcolormesh(_edges(steps, frame), np.arange(len(rows) + 1) - 0.5, np.ma.masked_invalid(grid),
                         cmap=colormaps["viridis"].with_extremes(bad=GREY), norm=norm)
    ax.set(xlabel="step", ylabel=ylabel, xlim=frame.limits, ylim=(len(rows) - 0.5, -0.5))
    stride = max(1, -(-len(rows) // 24))
    ax.set_yticks(range(0, len(rows), stride), list(rows)[::stride], fontsize="small")
    integer_steps(ax)
    ax.set_title(title, fontsize="medium")
    fig.colorbar(mesh, ax=ax, label=cbar)
    return fig
