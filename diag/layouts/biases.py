"""Where the bias of a projection weight lives: the names a bias may have, and the biases a module holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

__all__ = ["bias_names", "biases_of"]


def bias_names(weight: str) -> tuple[str, ...]:
    """Names the bias of a weight may have, most likely first.

    ``q_proj.weight`` -> ``q_proj.bias``; ``in_proj_weight`` -> ``in_proj_bias``; ``qkv`` -> ``qkv_bias``; a raw
    parameter named ``W...`` -> ``b...`` (``W_Q`` -> ``b_Q``, ``attn.Wq`` -> ``attn.bq``).
    """
    if weight.endswith("weight"):
        return (weight.removesuffix("weight") + "bias",)
    path, _, stem = weight.rpartition(".")
    named = (f"{path}.b{stem[1:]}" if path else f"b{stem[1:]}",) if stem[:1] in ("W", "w") and len(stem) > 1 else ()
    return (weight + "_bias", weight + ".bias") + named


def biases_of(params: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """The bias of each weight in ``names`` that ``params`` holds (named as :func:`bias_names` says), by the
    weight's name."""
    out = {}
    for name in names:
        found = next((b for b in bias_names(name) if b in params), None)
        if found is not None:
            out[name] = params[found]
    return out
