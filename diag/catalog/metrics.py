"""The catalog: one entry per metric the Monitor and the checkpoint analysis write.

Everything that names, charts or draws a metric reads its entry here: the records (one value per head or
per layer, :mod:`diag.outputs.records`), the TensorBoard layout and the per-layer runs (family, charted
statistic, :mod:`diag.outputs.tb_layout`), the figures (title, unit, colour range,
:mod:`diag.outputs.figures`) and both HTML reports (:mod:`diag.reports`). A new metric is one
:class:`Metric` in :data:`METRICS`, beside its math (``diag/math/``) and its section in docs/metrics.md;
the tag scheme (:mod:`diag.catalog.tags`) builds its tags.

The metrics' values come from the tensor math; the entry says how to read and show them. Its ``range``
is what the metric can take (None: unbounded on that side), which is also the colour range of its
heatmaps, None ends taken from the data. ``views`` says where it is shown: ``chart`` (TensorBoard, a
line per layer), ``report`` (a curve in the run report), ``heatmap`` (layer x head in TensorBoard,
heads over time in the run report), ``text`` (a constant of the sample, shown as a table, never
charted: it describes what was measured, not the model).
"""

from __future__ import annotations

from dataclasses import dataclass

from diag.errors import ConfigError

__all__ = ["Metric", "METRICS", "FAMILIES", "PERS", "STATS", "VIEWS", "PER_HEAD_METRICS", "LAYER_METRICS",
           "CHART_STAT", "chart_stat", "charted", "family", "family_metrics", "metrics_with",
           "update_metric_names"]

FAMILIES = ("spectra", "attention", "grads", "updates")  # the signal families, in the order they are shown
PERS = ("head", "layer", "spectrum")
STATS = ("max", "min", "mean")  # the statistics across heads written per layer
VIEWS = ("chart", "report", "heatmap", "text")


@dataclass(frozen=True)
class Metric:
    """One metric: what it is, how it is written, how it is shown.

    name: the tag's first part (``qk_sigma1/L03/H07``).
    family: the signal family that measures it (:data:`FAMILIES`), its TensorBoard category.
    per: ``head``: a value per head (per-head scalars, max/min/mean across heads, a histogram);
        ``layer``: one value per layer (``<metric>/L03``); ``spectrum``: a layer's values as one histogram.
    unit: what a value is measured in; "" for a pure number (a ratio, a norm, a count).
    range: (low, high) the values can take, None where unbounded; the colour range of its heatmaps.
    title: how a chart, a heatmap or a report names it.
    stat: per head only: the statistic across heads charted per layer, the direction that signals trouble.
    views: where it is shown (:data:`VIEWS`).
    log: charted on a log scale (ratios that span decades).
    """

    name: str
    family: str
    per: str
    unit: str
    range: tuple[float | None, float | None]
    title: str
    stat: str | None = None
    views: tuple[str, ...] = ("chart", "report")
    log: bool = False

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> ConfigError:
            return ConfigError(f"diag.catalog.metrics: the entry {self.name!r} has {what}; {fix}")

        if not self.name or "/" in self.name:
            raise bad(f"name={self.name!r}", "a metric's name is one tag part (letters, digits, '_'), e.g. "
                      "'collapse_risk'")
        if self.family not in FAMILIES:
            raise bad(f"family={self.family!r}", f"choose one of {FAMILIES}")
        if self.per not in PERS:
            raise bad(f"per={self.per!r}", f"choose one of {PERS}")
        if (self.stat in STATS) != (self.per == "head"):
            raise bad(f"stat={self.stat!r} with per={self.per!r}",
                      f"a per-head metric charts one of {STATS} across heads; any other has stat=None")
        if unknown := sorted(set(self.views) - set(VIEWS)):
            raise bad(f"views {unknown}", f"choose from {VIEWS}")
        lo, hi = self.range
        if lo is not None and hi is not None and not lo < hi:
            raise bad(f"range={self.range!r}", "pass (low, high) with low < high, None for an open end")

    @property
    def label(self) -> str:
        """The title with its unit, for an axis, a colour bar or a column: ``attention entropy (nats)``."""
        return f"{self.title} ({self.unit})" if self.unit else self.title

    def colour_range(self, lo: float, hi: float) -> tuple[float, float]:
        """The colour range of a heatmap whose finite data span ``lo``..``hi``: the catalog's ends where set."""
        low, high = self.range
        return (lo if low is None else low), (hi if high is None else high)


def _update(kind: str, x: str) -> Metric:
    w = f"W_{x.upper()}"
    if kind == "ratio":
        return Metric(f"update_ratio_{x}", "updates", "layer", "", (0.0, None), f"sigma_1(d{w}) / sigma_1({w})",
                      log=True)
    return Metric(f"update_fro_{x}", "updates", "layer", "", (0.0, None), f"||d{w}||_F / ||{w}||_F",
                  views=("chart",), log=True)


_ENTRIES = (
    # spectra of Wq_h^T Wk_h per head (diag.math.spectral, docs/metrics.md#spectra)
    Metric("qk_sigma1", "spectra", "head", "", (0.0, None), "sigma_1(Wq_h^T Wk_h)", "max",
           ("chart", "report", "heatmap")),  # the fastest-growing head
    Metric("qk_sec", "spectra", "head", "", (0.0, 1.0), "spectral energy concentration SEC", "max",
           ("chart", "report", "heatmap")),  # the most concentrated spectrum
    Metric("qk_erank", "spectra", "head", "", (1.0, None), "effective rank of Wq_h^T Wk_h", "min"),
    Metric("qk_stable_rank", "spectra", "head", "", (1.0, None), "stable rank of Wq_h^T Wk_h", "min"),
    Metric("qk_spectrum", "spectra", "spectrum", "", (0.0, None), "singular values of Wq_h^T Wk_h", views=()),
    # the attention the model computed, per head (diag.math.attention, docs/metrics.md#attention-statistics)
    Metric("attn_entropy", "attention", "head", "nats", (0.0, None), "attention entropy", "min",
           ("chart", "report", "heatmap")),  # the most collapsed head
    Metric("attn_rank", "attention", "head", "", (1.0, None), "attention effective rank", "min"),
    Metric("attn_max_logit", "attention", "head", "", (None, None), "largest attention logit", "max"),
    Metric("attn_sink", "attention", "head", "", (0.0, 1.0), "largest share of attention on one key position",
           "max"),  # an attention sink: near 1 (docs/metrics.md#attention-sinks)
    Metric("attn_sink_pos", "attention", "head", "", (0.0, None), "key position holding that share", "min",
           ()),  # in the tags and the attention_sink record
    # gradient norms of each head's slice (diag.math.metrics, docs/metrics.md#gradients); the Eureka plateau
    # compares Q/K with V gradients layer-wide: the mean
    *(Metric(f"grad_norm_{x}", "grads", "head", "", (0.0, None), f"||dL/dW_{x.upper()}||_F per head", "mean")
      for x in "qkv"),
    # per layer
    Metric("attn_rows", "attention", "layer", "", (0.0, None), "query rows analysed", views=("text",)),
    Metric("attn_entropy_uniform", "attention", "layer", "nats", (0.0, None), "entropy of uniform attention",
           views=("text",)),
    Metric("grad_ratio_qk_v", "grads", "layer", "", (0.0, None), "Q/K-to-V gradient ratio", log=True),
    *(_update("ratio", x) for x in "qkvo"),  # diag.math.updates, docs/metrics.md#updates
    *(_update("fro", x) for x in "qkvo"),
    # judged by the detectors from the spectra and the attention (diag.detectors.risk, docs/alerts.md#collapse_risk)
    Metric("collapse_risk", "attention", "layer", "probability", (0.0, 1.0),
           "collapse risk: P(malignant collapse of the layer within 50 steps)"),
)
METRICS: dict[str, Metric] = {m.name: m for m in _ENTRIES}
if len(METRICS) != len(_ENTRIES):
    raise ConfigError("diag.catalog.metrics: a metric's name is in the catalog twice; give each entry its own name")

# Views of the entries, for reading; the functions below read METRICS itself when called.
PER_HEAD_METRICS = tuple(m.name for m in _ENTRIES if m.per == "head")
LAYER_METRICS = tuple(m.name for m in _ENTRIES if m.per == "layer")
CHART_STAT = {m.name: m.stat for m in _ENTRIES if m.stat is not None}


def chart_stat(metric: str) -> str:
    """The statistic across heads charted for ``metric``; ``max`` for a metric outside the catalog."""
    entry = METRICS.get(metric)
    return entry.stat if entry is not None and entry.stat is not None else "max"


def charted(metric: str) -> bool:
    """Whether ``metric`` gets a TensorBoard chart (a line per layer): every metric outside the catalog does."""
    entry = METRICS.get(metric)
    return entry is None or "chart" in entry.views


def family(metric: str) -> str:
    """The signal family (TensorBoard category) of ``metric``; ``other`` outside the catalog."""
    entry = METRICS.get(metric)
    return entry.family if entry is not None else "other"


def family_metrics(name: str) -> tuple[str, ...]:
    """The names of the metrics of the signal family ``name`` (one of :data:`FAMILIES`), in catalog order."""
    if name not in FAMILIES:
        raise ConfigError(f"family_metrics({name!r}): unknown family; choose from {FAMILIES}")
    return tuple(m.name for m in METRICS.values() if m.family == name)


def metrics_with(view: str) -> tuple[Metric, ...]:
    """The entries shown in ``view`` (one of :data:`VIEWS`), in catalog order."""
    if view not in VIEWS:
        raise ConfigError(f"metrics_with({view!r}): unknown view; choose from {VIEWS}")
    return tuple(m for m in METRICS.values() if view in m.views)


def update_metric_names(matrices: str = "qkvo") -> tuple[str, ...]:
    """``update_ratio_<x>`` and ``update_fro_<x>`` for each matrix x (``q``, ``k``, ``v``: every layer;
    ``o``: layers whose layout names W_O), in catalog order."""
    return tuple(m.name for m in METRICS.values() if m.family == "updates" and m.name[-1] in matrices)
