"""The layout vocabulary: where W_Q, W_K, W_V (and the output projection W_O) live in an attention module,
and how they are packed.

A :class:`QKVLayout` is plain data: parameter names relative to the attention
module, the packing, and the head counts. :func:`split_qkv` applies it to any
tensors that share the parameters' shapes (weights, gradients, updates), so the
live monitor and the checkpoint analysis slice heads the same way; :func:`split_o`
gives W_O, whose update ratio is measured with those of Q, K and V.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from diag.errors import SpecError

__all__ = [
    "PACKINGS",
    "QKVLayout",
    "split_qkv",
    "split_o",
    "split_projections",
    "split_qkv_bias",
    "bias_names",
    "shape_problem",
]

PACKINGS = ("separate", "fused", "fused_per_head", "q_kv")


@dataclass(frozen=True)
class QKVLayout:
    """How one attention module stores its query, key and value projections.

    packing:
      * ``separate``: ``q``, ``k``, ``v`` name three weights of shape (rows, E).
      * ``fused``: ``q`` names one weight whose rows are [all Q | all K | all V].
      * ``fused_per_head``: one weight whose rows are, per head, [Q_h | K_h | V_h]
        (GPT-NeoX). Needs n_kv_heads == n_heads.
      * ``q_kv``: ``q`` names the query weight, ``k`` one weight whose rows are
        [all K | all V] (GPT-2 cross-attention: ``q_attn`` and ``c_attn``).
    transposed: the weights are stored (E, rows), as GPT-2's Conv1D does.
    o: the output projection's weight (E_out, H*D), when the module holds it (GPT-2
    ``c_proj.weight``, LLaMA ``o_proj.weight``); only its update ratio is measured.
    o_transposed: W_O is stored (H*D, E_out); None: as ``transposed`` (Conv1D models
    store every projection that way).
    n_kv_heads: key/value heads (grouped-query attention); query head h pairs
    with key head h // (n_heads // n_kv_heads).
    cross: queries and keys come from different sequences (encoder-decoder
    cross-attention); the layer's tag label gets the suffix ``.cross``.
    verify: at the first captured forward, check the per-head norms of the q (and
    k) the attention kernel receives against the module input projected with this
    layout; set False only for a module that transforms its input before the
    projection (its packing then is your responsibility).
    """

    n_heads: int
    head_dim: int
    q: str
    k: str | None = None
    v: str | None = None
    packing: str = "separate"
    n_kv_heads: int | None = None
    transposed: bool = False
    cross: bool = False
    verify: bool = True
    adapter: str = "spec"
    o: str | None = None
    o_transposed: bool | None = None

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise SpecError(f"QKVLayout.packing={self.packing!r}; expected one of {PACKINGS}")
        if self.n_heads < 1 or self.head_dim < 1:
            raise SpecError(
                f"QKVLayout needs n_heads >= 1 and head_dim >= 1, got {self.n_heads}, {self.head_dim}"
            )
        if self.packing == "separate" and (self.k is None or self.v is None):
            raise SpecError("QKVLayout(packing='separate') needs the names q=, k= and v=")
        if self.packing == "q_kv" and self.k is None:
            raise SpecError("QKVLayout(packing='q_kv') needs q= (queries) and k= (the fused [K | V] weight)")
        if self.n_heads % self.kv_heads:
            raise SpecError(
                f"QKVLayout: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}"
            )
        if self.packing == "fused_per_head" and self.kv_heads != self.n_heads:
            raise SpecError("QKVLayout(packing='fused_per_head') needs n_kv_heads == n_heads")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def param_names(self) -> tuple[str, ...]:
        names = {"separate": (self.q, self.k, self.v), "q_kv": (self.q, self.k)}.get(self.packing, (self.q,))
        return tuple(n for n in names if n is not None)

    @property
    def weight_names(self) -> tuple[str, ...]:
        """Every weight the layout names: :attr:`param_names` (Q, K, V), then W_O if set."""
        return self.param_names + ((self.o,) if self.o is not None else ())

    @property
    def o_is_transposed(self) -> bool:
        return self.transposed if self.o_transposed is None else self.o_transposed

    def describe(self) -> str:
        """The layout as the ``QKVLayout(...)`` call that builds it (for messages)."""
        args = [f"n_heads={self.n_heads}", f"head_dim={self.head_dim}", f"q={self.q!r}"]
        args += [f"{n}={getattr(self, n)!r}" for n in ("k", "v") if getattr(self, n) is not None]
        if self.packing != "separate":
            args.append(f"packing={self.packing!r}")
        if self.n_kv_heads not in (None, self.n_heads):
            args.append(f"n_kv_heads={self.n_kv_heads}")
        args += [f"{n}=True" for n in ("transposed", "cross") if getattr(self, n)]
        if self.o is not None:
            args.append(f"o={self.o!r}")
        if self.o_transposed is not None and self.o_transposed != self.transposed:
            args.append(f"o_transposed={self.o_transposed}")
        if not self.verify:
            args.append("verify=False")
        return f"QKVLayout({', '.join(args)})"


def _rows(w: Tensor, transposed: bool) -> Tensor:
    return w.T if transposed else w


def split_qkv(tensors: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head views (H, D, E), (G, D, E), (G, D, E) of Q, K and V.

    ``tensors`` maps the layout's parameter names to weights, or to tensors of the
    same shapes (gradients, updates). Views share storage: nothing is copied.
    """
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    if layout.packing == "separate":
        parts = [_rows(tensors[name], layout.transposed) for name in (layout.q, layout.k, layout.v)]
    elif layout.packing == "q_kv":
        kv = _rows(tensors[layout.k], layout.transposed)
        parts = [_rows(tensors[layout.q], layout.transposed), *kv.split([g * d, kv.shape[0] - g * d], dim=0)]
    else:
        fused = _rows(tensors[layout.q], layout.transposed)
        if layout.packing == "fused":
            parts = list(fused.split([h * d, g * d, g * d], dim=0))
        else:
            per_head = fused.reshape(h, 3, d, fused.shape[-1])
            return per_head[:, 0], per_head[:, 1], per_head[:, 2]
    q, k, v = parts
    return (
        q.reshape(h, d, q.shape[-1]),
        k.reshape(g, d, k.shape[-1]),
        v.reshape(g, v.shape[0] // g, v.shape[-1]),
    )


def split_o(tensors: Mapping[str, Tensor], layout: QKVLayout) -> Tensor | None:
    """W_O as (E_out, H*D), the nn.Linear orientation (a view), or None when the layout names none."""
    if layout.o is None:
        return None
    return _rows(tensors[layout.o], layout.o_is_transposed)


def split_projections(tensors: Mapping[str, Tensor], layout: QKVLayout) -> dict[str, Tensor]:
    """``{"q": (H, D, E), "k": (G, D, E), "v": (G, D, E)}`` and ``"o": (E_out, H*D)`` where the layout has W_O:
    the matrices whose update ratios are measured (:class:`diag.math.updates.UpdateTracker`)."""
    out = dict(zip("qkv", split_qkv(tensors, layout)))
    wo = split_o(tensors, layout)
    if wo is not None:
        out["o"] = wo
    return out


def shape_problem(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why the named weights cannot hold this layout's heads, or None when their shapes fit."""
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    need = {
        "separate": {layout.q: h * d, layout.k: g * d},
        "fused": {layout.q: (h + 2 * g) * d},
        "fused_per_head": {layout.q: 3 * h * d},
        "q_kv": {layout.q: h * d, layout.k: 2 * g * d},
    }[layout.packing]
    for name in layout.param_names:
        shape = tuple(shapes[name])
        if len(shape) != 2:
            return f"{name!r} has shape {shape}; a projection weight is 2-D"
        rows = shape[1] if layout.transposed else shape[0]
        if name in need and rows != need[name]:
            axis = "columns (transposed)" if layout.transposed else "rows"
            return (f"{name!r} has shape {shape}: {rows} {axis}, but {layout.describe()} needs {need[name]} "
                    f"(n_heads={h}, n_kv_heads={g}, head_dim={d})")
    if layout.o is not None:
        shape = tuple(shapes[layout.o])
        axis = "rows (o_transposed)" if layout.o_is_transposed else "columns"
        if len(shape) != 2 or shape[0 if layout.o_is_transposed else 1] != h * d:
            return (f"the output projection {layout.o!r} has shape {shape}, but {layout.describe()} needs "
                    f"{h * d} {axis} (n_heads * head_dim: W_O maps the concatenated heads back)")
    return None


def bias_names(weight: str) -> tuple[str, ...]:
    """Names the bias of a weight may have, most likely first.

    ``q_proj.weight`` -> ``q_proj.bias``; ``in_proj_weight`` -> ``in_proj_bias``; ``qkv`` -> ``qkv_bias``.
    """
    if weight.endswith("weight"):
        return (weight.removesuffix("weight") + "bias",)
    return (weight + "_bias", weight + ".bias")


def split_qkv_bias(biases: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor | None, Tensor | None]:
    """Per-head query and key biases (H, D), (G, D), sliced like :func:`split_qkv`; None where absent.

    ``biases`` maps the layout's weight names to their biases (or omits them).
    """
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    if layout.packing in ("separate", "q_kv"):
        bq, bk = biases.get(layout.q), biases.get(layout.k)
        bq = None if bq is None else bq.reshape(h, d)
        bk = None if bk is None else bk[: g * d].reshape(g, d)
        return bq, bk
    fused = biases.get(layout.q)
    if fused is None:
        return None, None
    if layout.packing == "fused":
        return fused[: h * d].reshape(h, d), fused[h * d : h * d + g * d].reshape(g, d)
    per_head = fused.reshape(h, 3, d)
    return per_head[:, 0], per_head[:, 1]
