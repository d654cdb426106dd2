"""Adapters: recognise an attention module's layout from a :class:`ModuleView` (class name, parameter shapes,
head-count attributes), data that a live module and a state dict plus a config can both provide. The core never
needs a live model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from diag.layouts.generic import (
    HEAD_DIM_KEYS,
    PROVISIONAL,
    ModuleView,
    fused_generic,
    generic_o,
    is_provisional,
    separate_generic,
)
from diag.layouts.generic import (
    head_count as _heads,
)
from diag.layouts.generic import (
    kv_count as _kv_heads,
)
from diag.layouts.vocab import QKVLayout

__all__ = [
    "ModuleView",
    "Adapter",
    "ADAPTERS",
    "CROSS_NAMES",
    "HEAD_ATTRS",
    "find_layout",
    "with_sibling_o",
    "resolve",
    "is_cross",
    "PROVISIONAL",
    "is_provisional",
]


@dataclass(frozen=True)
class Adapter:
    """A named recogniser: ``layout(view)`` returns a layout, or None if it does not apply."""

    name: str
    layout: Callable[[ModuleView], QKVLayout | None]
    describes: str


# Dotted name components (or attributes) that mark cross-attention: BART/Marian/Whisper
# `encoder_attn`, GPT-2/BERT `crossattention`, T5 `EncDecAttention`, nn.TransformerDecoderLayer
# `multihead_attn`, and common spellings.
# Head-count attributes that a module or its config may carry (live and offline alike).
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "head_dim",
    "num_key_value_heads",
    "n_kv_heads",
    "embed_dim",
    # research-code spellings (appended: the first four stay the Hugging Face head counts)
    "heads",
    "nhead",
    "num_head",
    "H",
    "num_kv_heads",
    "kv_heads",
    "n_kv_head",
    "d_head",
    "dim_head",
)

CROSS_NAMES = ("encoder_attn", "crossattention", "EncDecAttention", "multihead_attn", "cross_attn",
               "cross_attention", "src_attn")

# Children that normalise q or k after the projection (QK-norm: Qwen3, OLMo2, Gemma3, ...): the
# kernel's per-head norms do not follow x @ Wq_h^T, so the capture checks shapes only.
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")




def is_cross(view: ModuleView) -> bool:
    """Cross-attention by name or attribute (see ``CROSS_NAMES``); checked again at capture."""
    if view.attrs.get("is_cross_attention"):
        return True
    return any(part in CROSS_NAMES for part in view.name.split("."))


def _with_o(view: ModuleView, layout: QKVLayout | None, names: tuple[str, ...]) -> QKVLayout | None:
    """The layout with ``o=`` the first of ``names`` the module holds as a 2-D weight taking H*D inputs."""
    if layout is None:
        return None
    axis = 0 if layout.o_is_transposed else 1
    for name in names:
        shape = view.params.get(name)
        if shape is not None and len(shape) == 2 and shape[axis] == layout.n_heads * layout.head_dim:
            return replace(layout, o=name)
    return layout


# Families that keep W_O beside the attention module, not in it: Hugging Face BERT, RoBERTa, ELECTRA
# (``attention.self`` holds query/key/value; its sibling ``attention.output.dense`` is W_O).
# adapter -> (the module's last name component, W_O relative to the parent).
SIBLING_O = {"hf-bert": ("self", "output.dense.weight")}
PARENT = "../"


def with_sibling_o(name: str, layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> QKVLayout:
    """The layout with ``o="../output.dense.weight"`` where its family keeps W_O beside the module
    (:data:`SIBLING_O`) and ``shapes`` (full parameter names -> shapes) holds it, taking H*D inputs."""
    rule = SIBLING_O.get(layout.adapter)
    parent, _, last = name.rpartition(".")
    if layout.o is not None or rule is None or not parent or last != rule[0]:
        return layout
    shape = shapes.get(f"{parent}.{rule[1]}")
    if shape is None or len(shape) != 2 or shape[1] != layout.n_heads * layout.head_dim:
        return layout
    return replace(layout, o=PARENT + rule[1])


def resolve(module: str, relative: str) -> str:
    """The full name of a weight named relative to ``module``; each leading ``../`` climbs one level."""
    while relative.startswith(PARENT):
        module, relative = module.rpartition(".")[0], relative[len(PARENT):]
    return f"{module}.{relative}" if module else relative


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
    return _with_o(view, _fused(view, "c_attn.weight", "hf-gpt2"), ("c_proj.weight",))


def _gpt2_cross(view: ModuleView) -> QKVLayout | None:
    """GPT-2 cross-attention: Conv1D q_attn (E, E) and c_attn (E, 2E) = [K | V], both transposed."""
    q, kv, heads = view.params.get("q_attn.weight"), view.params.get("c_attn.weight"), _heads(view)
    if view.cls != "GPT2Attention" or q is None or kv is None or heads is None:
        return None
    e = q[1]
    if q != (q[0], e) or kv != (q[0], 2 * e) or e % heads:
        return None
    layout = QKVLayout(heads, e // heads, q="q_attn.weight", k="c_attn.weight", packing="q_kv", transposed=True,
                       cross=True, adapter="hf-gpt2-cross")
    return _with_o(view, layout, ("c_proj.weight",))


def _neox(view: ModuleView) -> QKVLayout | None:
    """GPT-NeoX / Pythia: query_key_value (3E, E), rows per head [Q_h | K_h | V_h]."""
    shape, heads = view.params.get("query_key_value.weight"), _heads(view)
    if view.cls != "GPTNeoXAttention" or shape is None or heads is None or shape[0] % (3 * heads):
        return None
    layout = QKVLayout(heads, shape[0] // 3 // heads, q="query_key_value.weight", packing="fused_per_head",
                       cross=is_cross(view), adapter="hf-gpt-neox")
    return _with_o(view, layout, ("dense.weight",))


# timm's Attention (timm.layers.Attention: ViT, DeiT, ...) holds these children and nothing else. Other timm
# classes named Attention pack qkv per head or add biases and position tables (LeViT, BEiT, SAM): not these.
TIMM_CHILDREN = ("qkv", "q_norm", "k_norm", "norm", "gate", "proj")


def _timm(view: ModuleView) -> QKVLayout | None:
    """timm Attention: Linear qkv (3·H·D, E), rows [all Q | all K | all V], num_heads and head_dim."""
    shape, heads = view.params.get("qkv.weight"), _heads(view)
    if view.cls != "Attention" or shape is None or len(shape) != 2 or heads is None:
        return None
    if any("." not in name or name.split(".")[0] not in TIMM_CHILDREN for name in view.params):
        return None
    head_dim = view.first("head_dim") or shape[1] // heads
    if shape[0] != 3 * heads * head_dim:
        return None
    qk_norm = any(name.split(".")[0] in QK_NORMS for name in view.params)  # LayerNorm per head (qk_norm=True)
    layout = QKVLayout(heads, head_dim, q="qkv.weight", packing="fused", verify=not qk_norm, adapter="timm")
    return _with_o(view, layout, ("proj.weight",))


def _nanogpt(view: ModuleView) -> QKVLayout | None:
    return _with_o(view, _fused(view, "c_attn.weight", "nanogpt-c_attn"), ("c_proj.weight",))


def _mha(view: ModuleView) -> QKVLayout | None:
    heads = _heads(view)
    if heads is None:
        return None
    if "in_proj_weight" in view.params:
        rows, cols = view.params["in_proj_weight"]
        if rows % 3 or (rows // 3) % heads:
            return None
        layout = QKVLayout(heads, rows // 3 // heads, q="in_proj_weight", packing="fused", cross=is_cross(view),
                           adapter="torch-mha")
        return _with_o(view, layout, ("out_proj.weight",))
    names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    if all(n in view.params for n in names):
        rows = view.params["q_proj_weight"][0]
        layout = QKVLayout(heads, rows // heads, *names, cross=is_cross(view), adapter="torch-mha")
        return _with_o(view, layout, ("out_proj.weight",))
    return None


def _separate_named(view: ModuleView, stems: tuple[str, str, str], adapter: str,
                    o_stems: tuple[str, ...] = ()) -> QKVLayout | None:
    """Three Linear children (rows, E); heads are contiguous row blocks; G from k rows / head_dim.
    W_O: the first of ``o_stems`` the module holds with H*D inputs."""
    names = tuple(f"{stem}.weight" for stem in stems)
    heads = _heads(view)
    if heads is None or not all(n in view.params and len(view.params[n]) == 2 for n in names):
        return None
    q_rows, k_rows = view.params[names[0]][0], view.params[names[1]][0]
    head_dim = view.first(*HEAD_DIM_KEYS) or q_rows // heads
    if head_dim < 1 or q_rows != heads * head_dim or k_rows % head_dim:  # < 1: empty (or too few) Q rows
        return None
    kv = _kv_heads(view) or k_rows // head_dim
    if kv < 1 or kv * head_dim != k_rows or heads % kv:
        return None
    qk_norm = any(name.split(".")[0] in QK_NORMS for name in view.params)
    layout = QKVLayout(heads, head_dim, *names, n_kv_heads=kv, cross=is_cross(view), verify=not qk_norm,
                       adapter=adapter)
    return _with_o(view, layout, tuple(f"{stem}.weight" for stem in o_stems))


# Structural discovery: other spellings of three separate projections (LLaMA-original wq/wk/wv,
# diffusers to_q/to_k/to_v, DistilBERT q_lin/k_lin/v_lin), each with its W_O (diffusers' to_out is a
# ModuleList, two levels down: not seen). The head split of separate projections is unambiguous given
# the head count; capture checks it (and the GQA pairing) against the kernel's q/k.
STRUCTURAL_STEMS = ((("wq", "wk", "wv"), ("wo",)), (("to_q", "to_k", "to_v"), ()),
                    (("q_lin", "k_lin", "v_lin"), ("out_lin",)))
# W_O of the named three-projection families: LLaMA/Mistral/ViT o_proj, BART/CLIP out_proj, Phi dense;
# BERT-style modules hold it only in ALBERT (dense; BERT's sits beside the module, see SIBLING_O); T5 o.
O_STEMS = {"separate-q_proj": ("o_proj", "out_proj", "dense"), "hf-bert": ("dense",), "hf-t5": ("o",)}


def _structural(view: ModuleView) -> QKVLayout | None:
    for stems, o_stems in STRUCTURAL_STEMS:
        layout = _separate_named(view, stems, "structural-separate", o_stems)
        if layout is not None:
            return layout if layout.o is not None else generic_o(view, layout)  # diffusers' to_out.0
    return None


ADAPTERS: list[Adapter] = [
    Adapter("hf-gpt2", _gpt2, "Hugging Face GPT2Attention: Conv1D c_attn (E, 3E), transposed"),
    Adapter("hf-gpt2-cross", _gpt2_cross, "GPT2Attention cross-attention: Conv1D q_attn (E, E) + c_attn (E, 2E)"),
    Adapter("hf-gpt-neox", _neox, "GPTNeoXAttention: query_key_value (3E, E), interleaved per head"),
    Adapter("torch-mha", _mha, "nn.MultiheadAttention: in_proj_weight (3E, E) or q/k/v_proj_weight"),
    Adapter("separate-q_proj", lambda v: _separate_named(v, ("q_proj", "k_proj", "v_proj"), "separate-q_proj",
                                                         O_STEMS["separate-q_proj"]),
            "q_proj/k_proj/v_proj Linear layers (LLaMA, Mistral, BART, ViT, ...)"),
    Adapter("hf-bert", lambda v: _separate_named(v, ("query", "key", "value"), "hf-bert", O_STEMS["hf-bert"]),
            "query/key/value Linear layers (BERT, RoBERTa self-attention)"),
    Adapter("hf-t5", lambda v: _separate_named(v, ("q", "k", "v"), "hf-t5", O_STEMS["hf-t5"]),
            "q/k/v Linear layers without bias (T5Attention)"),
    Adapter("timm", _timm, "timm Attention (ViT, DeiT, ...): Linear qkv (3E, E), num_heads, optional q_norm/k_norm"),
    Adapter("nanogpt-c_attn", _nanogpt, "nanoGPT CausalSelfAttention: Linear c_attn (3E, E) and n_head"),
    Adapter("structural-separate", _structural, "three projections wq/wk/wv, to_q/to_k/to_v or q_lin/k_lin/v_lin"),
    Adapter("fused-qkv", fused_generic, "one fused projection named like qkv, to_qkv, Wqkv, qkv_proj, in_proj or "
            "query_key_value (up to two levels down); confirmed or corrected by the first captured forward"),
    Adapter("separate-named", separate_generic, "three projections whose names say q, k, v (q/query/wq/W_q, ...), "
            "2-D or 3-D per head, up to two levels down; confirmed or corrected by the first captured forward"),
]


def find_layout(view: ModuleView, provisional: bool = True) -> QKVLayout | None:
    """The first adapter's layout for this module, or None.

    ``provisional=False`` skips the adapters whose layouts only a captured forward can confirm
    (:data:`PROVISIONAL`): the checkpoint analysis has no forward to confirm them with."""
    for adapter in ADAPTERS:
        if not provisional and adapter.name in PROVISIONAL:
            continue
        layout = adapter.layout(view)
        if layout is not None:
            return layout
    return None
