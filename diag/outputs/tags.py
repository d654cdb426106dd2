"""The tag scheme shared by the live monitor, the checkpoint analysis and the docs.

* per head:   ``<metric>/L<layer>/H<head>``     e.g. ``qk_sigma1/L03/H07``
* per layer:  ``<metric>/L<layer>/<stat>``      stat in max, min, mean (across heads)
* layer-only: ``<metric>/L<layer>``             e.g. ``update_ratio_q/L03``, ``update_ratio_o/L03``
* histogram:  ``<metric>/L<layer>/heads``        the values of all heads of a layer
* global:     ``<metric>``                      e.g. ``loss``

Layers are counted from 0 in module registration order (the order of the state
dict, which is the execution order for every supported family) and zero-padded
to at least two digits; heads likewise. A cross-attention layer carries the
suffix ``.cross`` (``L03.cross``).
"""

from __future__ import annotations

__all__ = [
    "PER_HEAD_METRICS",
    "LAYER_METRICS",
    "update_metric_names",
    "STATS",
    "layer_label",
    "layer_labels",
    "head_label",
    "head_tag",
    "stat_tag",
    "layer_tag",
    "histogram_tag",
]

PER_HEAD_METRICS = (
    "qk_sigma1",
    "qk_sec",
    "qk_erank",
    "qk_stable_rank",
    "attn_entropy",
    "attn_rank",
    "attn_max_logit",
    "grad_norm_q",
    "grad_norm_k",
    "grad_norm_v",
)
LAYER_METRICS = (
    "attn_rows",
    "attn_entropy_uniform",
    "grad_ratio_qk_v",
    "update_ratio_q",
    "update_ratio_k",
    "update_ratio_v",
    "update_ratio_o",
    "update_fro_q",
    "update_fro_k",
    "update_fro_v",
    "update_fro_o",
)
STATS = ("max", "min", "mean")


def _pad(i: int, count: int) -> str:
    return str(i).zfill(max(2, len(str(max(count - 1, 0)))))


def update_metric_names(matrices: str = "qkvo") -> tuple[str, ...]:
    """``update_ratio_<x>`` and ``update_fro_<x>`` for each matrix x (``q``, ``k``, ``v``: every layer;
    ``o``: layers whose layout names W_O), in :data:`LAYER_METRICS` order."""
    return tuple(m for m in LAYER_METRICS if m.startswith("update_") and m[-1] in matrices)


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
