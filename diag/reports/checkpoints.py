"""A report folder for an :class:`~diag.offline.series.Analysis`: PNG figures and an ``index.html``.

Figures (matplotlib's object API with the Agg canvas: no pyplot, no global
backend switch, no display needed), each metric named and ranged as its catalog entry says
(:mod:`diag.catalog.metrics`):

* ``heatmaps.png``: layer x head heatmaps of sigma_1(Wq_h^T Wk_h) and SEC_s at the last step;
* ``sigma1.png``: sigma_1 per layer (max over heads) over the series' steps;
* ``spectra.png``: the singular spectra of the most concentrated heads (highest SEC) at the last step;
* ``attention.png``: attention entropy and rank per layer and head (with ``--probe`` only);
* ``updates.png``: the update ratio sigma_1(dW_Q)/sigma_1(W_Q) per layer (series only).
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
from diag.reports.html import integer_steps, page, table

__all__ = ["write_report"]


def _heatmaps(analysis: Analysis, step: int, path: Path, panels: tuple[str, ...]) -> None:
    fig = figure(9, 0.35 * len(analysis.layers) + 2)
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
    fig.savefig(path)


def _trajectories(analysis: Analysis, path: Path, metric: str, source: dict, title: str) -> None:
    entry = METRICS[metric]
    ylabel = f"{entry.label}, max over heads" if entry.per == "head" else entry.label
    fig = figure(7, 4)
    ax = fig.subplots()
    steps = sorted(source)
    for la in analysis.layers:
        ax.plot(steps, [float(np.max(source[s][la.label][metric])) for s in steps], marker=".", label=la.label)
    ax.set(title=title, xlabel="step", ylabel=ylabel, yscale="log")
    integer_steps(ax)
    ax.legend(fontsize="small", ncol=max(1, len(analysis.layers) // 8))
    fig.savefig(path)


def _spectra(analysis: Analysis, step: int, path: Path, top: int) -> None:
    heads = []
    for la in analysis.layers:
        metrics = analysis.spectra[step][la.label]
        sv = metrics["qk_spectrum"].reshape(len(metrics["qk_sec"]), -1)
        heads += [(float(sec), f"{la.label}/{head_label(h, len(sv))}", sv[h])
                  for h, sec in enumerate(metrics["qk_sec"])]
    heads.sort(key=lambda t: -t[0] if np.isfinite(t[0]) else np.inf)
    fig = figure(7, 4)
    ax = fig.subplots()
    for sec, name, sv in heads[:top]:
        ax.plot(np.arange(1, len(sv) + 1), sv, marker=".", label=f"{name} (SEC {sec:.2f})")
    ax.set(title=f"singular values of Wq_h^T Wk_h, most concentrated heads, step {step}",
           xlabel="index i", ylabel="s_i", yscale="log")
    ax.legend(fontsize="small")
    fig.savefig(path)


def write_report(analysis: Analysis, folder: str | Path, top: int = 4) -> Path:
    """Write the figures and ``index.html`` into ``folder``; returns the index page's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, str]] = []
    if analysis.spectra:
        last = max(analysis.spectra)
        _heatmaps(analysis, last, folder / "heatmaps.png", ("qk_sigma1", "qk_sec"))
        _trajectories(analysis, folder / "sigma1.png", "qk_sigma1", analysis.spectra,
                      f"{METRICS['qk_sigma1'].title} per layer")
        _spectra(analysis, last, folder / "spectra.png", top)
        figures += [("heatmaps.png", "sigma_1 and SEC per layer and head, last step"),
                    ("sigma1.png", "sigma_1 per layer over the series"),
                    ("spectra.png", "singular spectra of the most concentrated heads")]
    if analysis.spectra and all("attn_entropy" in m for m in analysis.spectra[last].values()):
        _heatmaps(analysis, last, folder / "attention.png", ("attn_entropy", "attn_rank"))
        figures.append(("attention.png", "attention entropy and rank per layer and head (--probe), last step"))
    if analysis.updates:
        _trajectories(analysis, folder / "updates.png", "update_ratio_q", analysis.updates,
                      "update ratio of W_Q, checkpoint to the next")
        figures.append(("updates.png", "update ratio of W_Q per layer, from each checkpoint to the next"))
    index = folder / "index.html"
    index.write_text(_page(analysis, figures), encoding="utf-8")
    return index


def _page(analysis: Analysis, figures: list[tuple[str, str]]) -> str:
    note = analysis.heads.note if analysis.heads else ""
    layers = [[la.label, la.name, la.layout.adapter, la.layout.n_heads, la.layout.kv_heads, la.layout.head_dim]
              for la in analysis.layers]
    alerts = [[a.step, a.level, a.kind, a.where, a.message] for a in analysis.alerts]
    parts = [
        f"<p>{len(analysis.analysed)} checkpoint(s), steps {analysis.steps}. {html.escape(note)}.</p>",
        "".join(f"<p>{html.escape(a)}</p>" for a in analysis.assumptions),  # never silent about what was assumed
        "<h2>Layers</h2>" + table(["layer", "module", "adapter", "heads", "kv heads", "head dim"], layers),
        "".join(f"<h2>{html.escape(t)}</h2><img src='{f}' alt='{html.escape(t)}'>" for f, t in figures),
        f"<h2>Alerts ({len(alerts)})</h2>",
        table(["step", "level", "kind", "where", "message"], alerts, classes=[a[1] for a in alerts])
        if alerts else "<p>No detector fired on the weight-side signals.</p>",
    ]
    if analysis.failures:
        parts.append(f"<h2>Failed checkpoints ({len(analysis.failures)})</h2>"
                     + table(["checkpoint", "error"], [list(f) for f in analysis.failures]))
    return page("attnscope checkpoint report", parts)
