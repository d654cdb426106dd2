"""From per-layer metric tensors to a :class:`~diag.outputs.sinks.Record` and detector arrays.

One function turns what was measured at one step into tags (see :mod:`diag.catalog.tags`),
so the live Monitor and the checkpoint analysis write the same tags for the same
numbers, each as its catalog entry's ``per`` says (:data:`diag.catalog.metrics.METRICS`):

* ``spectrum`` (``qk_spectrum``): a histogram ``qk_spectrum/L03`` of the layer's singular values;
* ``layer``: one scalar ``<metric>/L03``;
* ``head`` (and a metric outside the catalog): per-head scalars (when ``per_head``), max/min/mean
  across heads and a histogram across heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from diag.catalog.metrics import METRICS, STATS
from diag.catalog.tags import head_tag, histogram_tag, layer_tag, stat_tag
from diag.math.attention import AttentionStats
from diag.outputs.sinks import Record

__all__ = ["PER_HEAD_LIMIT", "per_head_default", "attention_metrics", "host_arrays", "add_metric", "build_record"]

# Above this many heads in the whole model, per-head scalars are off by default
# (per-layer max/min/mean and the across-head histograms are always written).
PER_HEAD_LIMIT = 256

LayerArrays = dict[str, dict[str, np.ndarray]]


def per_head_default(total_heads: int) -> bool:
    return total_heads <= PER_HEAD_LIMIT


def attention_metrics(stats: AttentionStats) -> dict[str, Tensor]:
    """The attention signals of one layer under their metric names."""
    return {
        "attn_entropy": stats.entropy,
        "attn_rank": stats.rank,
        "attn_max_logit": stats.max_logit,
        "attn_sink": stats.sink,
        "attn_sink_pos": stats.sink_pos,
        "attn_rows": stats.rows,
        "attn_entropy_uniform": stats.uniform_entropy.mean().reshape(1),
    }


def host_arrays(per_layer: Sequence[tuple[str, dict[str, Tensor]]]) -> LayerArrays:
    """``{label: {metric: float64 array}}`` with one host sync for all layers.

    per_layer: (layer label, {metric: tensor}) in layer order.
    """
    names, tensors = [], []
    for label, values in per_layer:
        for metric, t in values.items():
            names.append((label, metric))
            tensors.append(t.reshape(-1).double())
    # tensors on several devices (a loss tensor on the CPU beside a model on the GPU, a model split over two
    # GPUs) meet on the first accelerator's: still one transfer to the host
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    flat = torch.cat(tensors).cpu().numpy() if tensors else np.zeros(0)  # one host sync
    arrays: LayerArrays = {}
    offset = 0
    for (label, metric), t in zip(names, tensors):
        arrays.setdefault(label, {})[metric] = flat[offset : offset + t.numel()]
        offset += t.numel()
    return arrays


def add_metric(record: Record, label: str, metric: str, values: np.ndarray, per_head: bool) -> None:
    """Add one metric of one layer to ``record`` under the shared tag scheme."""
    entry = METRICS.get(metric)
    per = entry.per if entry is not None else "head"
    if per == "spectrum":
        record.histograms[layer_tag(metric, label)] = values
        return
    if per == "layer":
        record.scalars[layer_tag(metric, label)] = float(values[0])
        return
    if per_head:
        for h, v in enumerate(values):
            record.scalars[head_tag(metric, label, h, values.size)] = float(v)
    with np.errstate(all="ignore"):
        for stat, fn in zip(STATS, (np.max, np.min, np.mean)):
            record.scalars[stat_tag(metric, label, stat)] = float(fn(values))
    record.histograms[histogram_tag(metric, label)] = values


def build_record(step: int, arrays: LayerArrays, per_head: bool) -> Record:
    """A Record of every metric of every layer, in layer then metric order."""
    record = Record(step)
    for label, metrics in arrays.items():
        for metric, values in metrics.items():
            add_metric(record, label, metric, values, per_head)
    return record
