"""A report folder for an :class:`~diag.offline.series.Analysis`: PNG figures and an ``index.html``.

Figures (matplotlib's object API with the Agg canvas: no pyplot, no global
backend switch, no display needed), each metric named and ranged as its catalog entry says
(:mod:`diag.catalog.metrics`):

* ``heatmaps.png``: layer x head heatmaps of sigma_1(Wq_h^T Wk_h) and SEC_s at the last step;
* ``sigma1.png``: sigma_1 per layer (max over heads) over the series' steps (two checkpoints or more);
* ``spectra.png``: the singular spectra of the most concentrated heads (highest SEC) at the last step;
* ``attention.png``: attention entropy and rank per layer and head (with ``--probe`` only);
* ``updates.png``: the update ratio sigma_1(dW_Q)/sigma_1(W_Q) per layer (two updates or more).

A chart over steps needs two steps: of one checkpoint (or one update) the page says in words and a table what
it holds instead. ``index.html`` shows the figures in a grid at the page's width, legends beside the axes.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from diag.catalog.metrics import METRICS
from diag.catalog.tags import head_label
from diag.offline.series import Analysis
from diag.outputs.figures import figure
from diag.outputs.images import layer_head_grid
from diag.reports.charts import HEIGHT, MOST_NAMED, WIDTH, layer_colours
from diag.reports.html import file_img, grid, integer_steps, page, save_png, table

__all__ = ["write_report"]


def _heatmaps(analysis: Analysis, step: int, path: Path, panels: tuple[str, ...]) -> None:
    fig = figure(2 * WIDTH, 0.35 * len(analysis.layers) + 2)  # across the grid: two small multiples wide
    for ax, metric in zip(fig.subplots(1, len(panels)), panels):
        grid = layer_head_grid(analysis.spectra[step], [la.label for la in analysis.layers], metric)
        # the catalog's range, ends it leaves open from the data (SEC is a fraction: a fixed 0..1 scale;
        # auto-ranging over 0.96..0.99 made near-equal heads look apart)
        lo, hi = METRICS[metric].range
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=lo, vmax=hi)
        ax.set(title=f"{METRICS[metric].label} at step {step}", xlabel="head", ylabel="layer")
        ax.set_yticks(range(grid.shape[0]), [la.label for la in analysis.layers])
        if grid.shape[1] <= 32:
            ax.set_xticks(range(grid.shape[1]))
        if grid.size <= 64:
            for (i, j), value in np.ndenumerate(grid):  # dark text on viridis' bright end, white on its dark end
                bright = np.isfinite(value) and image.norm(value) > 0.6
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", color="black" if bright else "white",
                        fontsize="small")
        fig.colorbar(image, ax=ax)
    save_png(fig, path)


def _largest(source: dict, step: int, label: str, metric: str) -> float:
    return float(np.max(source[step][label][metric]))


def _trajectories(analysis: Analysis, path: Path, metric: str, source: dict, title: str) -> None:
    """``metric`` per layer (max over heads) over the series' steps, which span the x axis; legend outside."""
    entry = METRICS[metric]
    ylabel = f"{entry.label}, max over heads" if entry.per == "head" else entry.label
    steps = sorted(source)
    colours = layer_colours([la.label for la in analysis.layers])
    fig = figure(WIDTH, HEIGHT)
    ax = fig.subplots()
    for la in analysis.layers:
        ax.plot(steps, [_largest(source, s, la.label, metric) for s in steps], marker=".", label=la.label,
                color=colours[la.label])
    pad = (steps[-1] - steps[0]) / 40
    ax.set(title=title, xlabel="step", ylabel=ylabel, yscale="log", xlim=(steps[0] - pad, steps[-1] + pad))
    if len(steps) <= 12:  # a tick at each checkpoint
        ax.set_xticks(steps)
    else:
        integer_steps(ax)
    if len(analysis.layers) <= MOST_NAMED:
        fig.legend(loc="outside right upper", fontsize="small", frameon=False)
    save_png(fig, path)


def _spectra(analysis: Analysis, step: int, path: Path, top: int) -> None:
    heads = []
    for la in analysis.layers:
        metrics = analysis.spectra[step][la.label]
        sv = metrics["qk_spectrum"].reshape(len(metrics["qk_sec"]), -1)
        heads += [(float(sec), f"{la.label}/{head_label(h, len(sv))}", sv[h])
                  for h, sec in enumerate(metrics["qk_sec"])]
    heads.sort(key=lambda t: -t[0] if np.isfinite(t[0]) else np.inf)
    fig = figure(WIDTH, HEIGHT)
    ax = fig.subplots()
    for sec, name, sv in heads[:top]:
        ax.plot(np.arange(1, len(sv) + 1), sv, marker=".", label=f"{name} (SEC {sec:.2f})")
    ax.set(title=f"singular values of Wq_h^T Wk_h, most concentrated heads, step {step}",
           xlabel="index i", ylabel="s_i", yscale="log")
    ax.title.set_fontsize("medium")
    fig.legend(loc="outside right upper", fontsize="small", frameon=False)
    save_png(fig, path)


def _one_step(analysis: Analysis, source: dict, metrics: tuple[str, ...], said: str) -> str:
    """What a series chart would show at its one step, in words and a table (a chart of one step is two dots)."""
    (step,) = source
    rows = [[la.label, *(f"{_largest(source, step, la.label, m):.4g}" for m in metrics)] for la in analysis.layers]
    names = [f"{METRICS[m].label}, max over heads" if METRICS[m].per == "head" else METRICS[m].label
             for m in metrics]
    return f"<p>{html.escape(said)}</p>" + table(["layer", *names], rows)


def write_report(analysis: Analysis, folder: str | Path, top: int = 4) -> Path:
    """Write the figures and ``index.html`` into ``folder``; returns the index page's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures: list[str] = []
    words: list[str] = []
    if analysis.spectra:
        last = max(analysis.spectra)
        _heatmaps(analysis, last, folder / "heatmaps.png", ("qk_sigma1", "qk_sec"))
        figures.append(file_img("heatmaps.png", "sigma_1 and SEC per layer and head, last step", wide=True))
        if len(analysis.spectra) > 1:
            _trajectories(analysis, folder / "sigma1.png", "qk_sigma1", analysis.spectra,
                          f"{METRICS['qk_sigma1'].title} per layer")
            figures.append(file_img("sigma1.png", "sigma_1 per layer over the series"))
        else:
            words.append(_one_step(analysis, analysis.spectra, ("qk_sigma1", "qk_sec"), (
                f"One checkpoint, step {last}: the weights at one step, so nothing is drawn over steps (sigma_1 "
                "over the series and the update ratios need two or more checkpoints of a run). It holds each "
                "head's sigma_1 and SEC (the heatmaps) and the spectra of its most concentrated heads; per layer:")))
        _spectra(analysis, last, folder / "spectra.png", top)
        figures.append(file_img("spectra.png", "singular spectra of the most concentrated heads"))
    if analysis.spectra and all("attn_entropy" in m for m in analysis.spectra[last].values()):
        _heatmaps(analysis, last, folder / "attention.png", ("attn_entropy", "attn_rank"))
        figures.append(file_img("attention.png", "attention entropy and rank per layer and head (--probe), last step",
                                wide=True))
    if len(analysis.updates) > 1:
        _trajectories(analysis, folder / "updates.png", "update_ratio_q", analysis.updates,
                      "update ratio of W_Q, checkpoint to the next")
        figures.append(file_img("updates.png", "update ratio of W_Q per layer, from each checkpoint to the next"))
    elif analysis.updates:
        (step,) = analysis.updates
        words.append(_one_step(analysis, analysis.updates, ("update_ratio_q",), (
            f"One update, from the checkpoint of step {step} to the next: a single value per layer, so nothing is "
            "drawn over steps:")))
    index = folder / "index.html"
    index.write_text(_page(analysis, figures, words), encoding="utf-8")
    return index


def _page(analysis: Analysis, figures: list[str], words: list[str]) -> str:
    note = analysis.heads.note if analysis.heads else ""
    layers = [[la.label, la.name, la.layout.adapter, la.layout.n_heads, la.layout.kv_heads, la.layout.head_dim]
              for la in analysis.layers]
    alerts = [[a.step, a.level, a.kind, a.where, a.message] for a in analysis.alerts]
    parts = [
        f"<p>{len(analysis.analysed)} checkpoint(s), steps {analysis.steps}. {html.escape(note)}.</p>",
        "".join(f"<p>{html.escape(a)}</p>" for a in analysis.assumptions),  # never silent about what was assumed
        "<h2>Layers</h2>" + table(["layer", "module", "adapter", "heads", "kv heads", "head dim"], layers),
        "<h2>Figures</h2>" if figures or words else "", *words, grid(figures),
        f"<h2>Alerts ({len(alerts)})</h2>",
        table(["step", "level", "kind", "where", "message"], alerts, classes=[a[1] for a in alerts])
        if alerts else "<p>No detector fired on the weight-side signals.</p>",
    ]
    if analysis.failures:
        parts.append(f"<h2>Failed checkpoints ({len(analysis.failures)})</h2>"
                     + table(["checkpoint", "error"], [list(f) for f in analysis.failures]))
    return page("attnscope checkpoint report", parts)
