"""Where W_Q, W_K, W_V live in an attention module, and how they are packed.

A :class:`QKVLayout` is plain data: parameter names relative to the attention
module, the packing, and the head counts. :func:`split_qkv` applies it to any
tensors that share the parameters' shapes (weights, gradients, updates), so the
live monitor and the checkpoint analysis slice heads the same way.

Adapters recognise a module from a :class:`ModuleView` (class name, parameter
shapes, head-count attributes): data that a live module and a state dict plus a
config can both provide. The core never needs a live model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from diag.errors import SpecError

__all__ = ["QKVLayout", "ModuleView", "Adapter", "ADAPTERS", "find_layout", "split_qkv"]

PACKINGS = ("separate", "fused", "fused_per_head")


@dataclass(frozen=True)
class QKVLayout:
    """How one attention module stores its query, key and value projections.

    packing:
      * ``separate``: ``q``, ``k``, ``v`` name three weights of shape (rows, E).
      * ``fused``: ``q`` names one weight whose rows are [all Q | all K | all V].
      * ``fused_per_head``: one weight whose rows are, per head, [Q_h | K_h | V_h]
        (GPT-NeoX). Needs n_kv_heads == n_heads.
    transposed: the weight is stored (E, rows), as GPT-2's Conv1D does.
    n_kv_heads: key/value heads (grouped-query attention); query head h pairs
    with key head h // (n_heads // n_kv_heads).
    """

    n_heads: int
    head_dim: int
    q: str
    k: str | None = None
    v: str | None = None
    packing: str = "separate"
    n_kv_heads: int | None = None
    transposed: bool = False
    adapter: str = "spec"

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise SpecError(f"QKVLayout.packing={self.packing!r}; expected one of {PACKINGS}")
        if self.n_heads < 1 or self.head_dim < 1:
            raise SpecError(
                f"QKVLayout needs n_heads >= 1 and head_dim >= 1, got {self.n_heads}, {self.head_dim}"
            )
        if self.packing == "separate" and (self.k is None or self.v is None):
            raise SpecError("QKVLayout(packing='separate') needs the names q=, k= and v=")
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
        names = (self.q,) if self.packing != "separate" else (self.q, self.k, self.v)
        return tuple(n for n in names if n is not None)


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


@dataclass
class ModuleView:
    """What an adapter may look at: a class name, parameter shapes and attributes.

    params: parameter name (relative to the module, e.g. ``c_attn.weight``) -> shape.
    attrs: head counts and sizes found on the module or its config
    (``num_heads``, ``head_dim``, ``num_key_value_heads``, ``embed_dim``, ...).
    """

    name: str
    cls: str
    params: dict[str, tuple[int, ...]]
    attrs: dict[str, int] = field(default_factory=dict)

    def first(self, *keys: str) -> int | None:
        for key in keys:
            if self.attrs.get(key):
                return int(self.attrs[key])
        return None


@dataclass(frozen=True)
class Adapter:
    """A named recogniser: ``layout(view)`` returns a layout, or None if it does not apply."""

    name: str
    layout: Callable[[ModuleView], QKVLayout | None]
    describes: str


def _heads(view: ModuleView) -> int | None:
    return view.first("num_heads", "num_attention_heads", "n_head", "n_heads")


def _fused(view: ModuleView, param: str, adapter: str) -> QKVLayout | None:
    shape = view.params.get(param)
    heads = _heads(view)
    if shape is None or len(shape) != 2 or heads is None:
        return None
    rows, cols = shape
    if rows == 3 * cols:
        transposed = False
    elif cols == 3 * rows:
        transposed, rows, cols = True, cols, rows
    else:
        return None
    if cols % heads:
        return None
    return QKVLayout(heads, cols // heads, q=param, packing="fused", transposed=transposed, adapter=adapter)


def _gpt2(view: ModuleView) -> QKVLayout | None:
    if view.cls != "GPT2Attention" or "q_attn.weight" in view.params:
        return None
    return _fused(view, "c_attn.weight", "hf-gpt2")


def _nanogpt(view: ModuleView) -> QKVLayout | None:
    return _fused(view, "c_attn.weight", "nanogpt-c_attn")


def _mha(view: ModuleView) -> QKVLayout | None:
    heads = _heads(view)
    if heads is None:
        return None
    if "in_proj_weight" in view.params:
        rows, cols = view.params["in_proj_weight"]
        if rows % 3 or (rows // 3) % heads:
            return None
        return QKVLayout(heads, rows // 3 // heads, q="in_proj_weight", packing="fused", adapter="torch-mha")
    names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    if all(n in view.params for n in names):
        rows = view.params["q_proj_weight"][0]
        return QKVLayout(heads, rows // heads, *names, adapter="torch-mha")
    return None


def _separate(view: ModuleView) -> QKVLayout | None:
    names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    heads = _heads(view)
    if heads is None or not all(n in view.params for n in names):
        return None
    q_rows, k_rows = view.params[names[0]][0], view.params[names[1]][0]
    head_dim = view.first("head_dim") or q_rows // heads
    if q_rows != heads * head_dim or k_rows % head_dim:
        return None
    kv = view.first("num_key_value_heads", "n_kv_heads") or k_rows // head_dim
    if kv * head_dim != k_rows:
        return None
    return QKVLayout(heads, head_dim, *names, n_kv_heads=kv, adapter="separate-q_proj")


ADAPTERS: list[Adapter] = [
    Adapter("hf-gpt2", _gpt2, "Hugging Face GPT2Attention: Conv1D c_attn (E, 3E), transposed"),
    Adapter("torch-mha", _mha, "nn.MultiheadAttention: in_proj_weight (3E, E) or q/k/v_proj_weight"),
    Adapter("separate-q_proj", _separate, "q_proj/k_proj/v_proj Linear layers (LLaMA, Mistral, ...)"),
    Adapter("nanogpt-c_attn", _nanogpt, "nanoGPT CausalSelfAttention: Linear c_attn (3E, E) and n_head"),
]


def find_layout(view: ModuleView) -> QKVLayout | None:
    """The first adapter's layout for this module, or None."""
    for adapter in ADAPTERS:
        layout = adapter.layout(view)
        if layout is not None:
            return layout
    return None
