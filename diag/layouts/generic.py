"""Generic adapters for research code: projections found by what their names say, not by a family's class.

A research model keeps its fused projection in ``qkv``/``to_qkv``/``Wqkv`` (or three in ``q``/``W_q``/
``to_q``...), its head count in ``heads``/``num_heads``/``H``/``nhead``, perhaps two module levels down
(``proj.q.weight``, ``to_qkv.0.weight``) or as 3-D per-head parameters (H, E, D). These adapters propose a
layout from that; the proposal is **provisional**: names and shapes cannot tell a fused ``[Q | K | V]`` from
one interleaved per head or per key/value group, nor the query-to-key-head pairing, so the first captured
forward confirms it against the q and k the attention kernel received, or replaces it with the layout read
from them (``hooks.layout.confirm``), and a layer whose proposal nothing confirms is refused, never guessed.
Without a head-count attribute a provisional layout carries a placeholder count that the kernel's shapes
replace.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from diag.layouts.vocab import QKVLayout

__all__ = ["ModuleView", "PROVISIONAL", "is_provisional", "fused_generic", "separate_generic", "generic_o",
           "head_count", "kv_count", "HEAD_COUNT_KEYS", "KV_COUNT_KEYS", "HEAD_DIM_KEYS"]

HEAD_COUNT_KEYS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads", "nhead", "num_head", "H")
KV_COUNT_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_heads", "n_kv_head")
HEAD_DIM_KEYS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size", "d_kv", "d_head", "dim_head")
PROVISIONAL = ("fused-qkv", "separate-named", "computation")  # only a captured forward confirms these

_ROLE_TOKENS = {"q": ("q", "query", "queries", "wq"), "k": ("k", "key", "keys", "wk"),
                "v": ("v", "value", "values", "wv")}
_FUSED_STEMS = ("querykeyvalue", "inproj", "cattn", "wpack")
_O_STEMS = ("out", "proj", "o", "outproj", "toout", "cproj", "wo", "dense", "oproj", "outlin", "projout", "output",
            "attnout", "outlinear", "linearout", "fcout", "projection", "wout", "outputproj")


@dataclass
class ModuleView:
    """What an adapter may look at: a class name, parameter shapes and attributes.

    params: parameter name (relative to the module, e.g. ``c_attn.weight``) -> shape; a live module's
    view holds its own parameters and those up to three module levels down.
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


def head_count(view: ModuleView) -> int | None:
    return view.first(*HEAD_COUNT_KEYS)


def kv_count(view: ModuleView) -> int | None:
    return 1 if view.attrs.get("multi_query") else view.first(*KV_COUNT_KEYS)


def is_provisional(layout: QKVLayout) -> bool:
    """A layout only a captured forward can confirm (a generic adapter's proposal)."""
    return layout.adapter in PROVISIONAL


def _path(name: str) -> tuple[list[str], bool]:
    """Module components of a parameter name (at most three levels) and whether it is a ``.weight``."""
    parts = name.split(".")
    is_weight = len(parts) > 1 and parts[-1] == "weight"
    mods = parts[:-1] if is_weight else parts
    return mods, is_weight


def _stem(mods: list[str]) -> str:
    named = [m for m in mods if not m.isdigit()]
    return re.sub(r"[^a-z0-9]", "", named[-1].lower()) if named else ""


def _tokens(mods: list[str]) -> list[str]:
    named = [m for m in mods if not m.isdigit()]
    if not named:
        return []
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", named[-1])
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


def _near(name: str) -> bool:
    mods, _ = _path(name)
    return 1 <= len(mods) <= 3


def _attr_geometry(view: ModuleView, e: int) -> tuple[int | None, int | None]:
    heads = head_count(view)
    d = view.first(*HEAD_DIM_KEYS) or (e // heads if heads and e % heads == 0 else None)
    return heads, d


def fused_generic(view: ModuleView) -> QKVLayout | None:
    """One 2-D ``.weight`` named like a fused projection: proposed as ``[all Q | all K | all V]``."""
    names = [n for n, s in view.params.items() if len(s) == 2 and _near(n) and _path(n)[1]
             and ("qkv" in _stem(_path(n)[0]) or _stem(_path(n)[0]) in _FUSED_STEMS)]
    if len(names) != 1:
        return None
    name = names[0]
    rows, cols = view.params[name]
    e = view.first("embed_dim")
    transposed = cols > rows if e is None else (cols != e and rows == e)
    rows, e = (cols, rows) if transposed else (rows, cols)
    heads, d = _attr_geometry(view, e)
    if heads is None:  # placeholder: the kernel's shapes give the count at the first captured forward
        if rows != 3 * e:
            return None
        heads, d = 1, e
    if d is None or rows % d or (rows // d - heads) % 2 or rows // d <= heads:
        return None
    g = (rows // d - heads) // 2  # the attributes may disagree (Falcon: multi_query with num_kv_heads)
    if heads % g:
        return None
    layout = QKVLayout(heads, d, q=name, packing="fused", n_kv_heads=g, transposed=transposed, adapter="fused-qkv")
    return generic_o(view, layout)


def _role(name: str) -> str | None:
    tokens = _tokens(_path(name)[0])
    roles = [r for r, words in _ROLE_TOKENS.items() if any(t in words for t in tokens)]
    return roles[0] if len(roles) == 1 else None


def _plainest(names: list[str]) -> str | None:
    """The one name with the fewest words, or None when there is none or a tie."""
    ranked = sorted((len(_tokens(_path(n)[0])), n) for n in names)
    if not ranked or (len(ranked) > 1 and ranked[0][0] == ranked[1][0]):
        return None
    return ranked[0][1]


def separate_generic(view: ModuleView) -> QKVLayout | None:
    """Three projections whose names say q, k and v (``W_q``, ``to_q``, ``query``, ``proj.q``, ...)."""
    found: dict[str, list[str]] = {"q": [], "k": [], "v": []}
    for name, shape in view.params.items():
        role = _role(name) if _near(name) and len(shape) in (2, 3) else None
        if role is not None:
            found[role].append(name)
    picked = [_plainest(found[r]) for r in "qkv"]  # "query_proj" over "pos_query_proj" (DeBERTa)
    if picked[0] is not None and picked[1] is None and picked[2] is None:
        layout = _q_kv(view, picked[0])
        return None if layout is None else generic_o(view, layout)
    if any(p is None for p in picked):
        return None
    q, k, v = picked
    shapes = [view.params[n] for n in (q, k, v)]
    if len({len(s) for s in shapes}) != 1:
        return None
    layout = _heads_3d(view, q, k, v, shapes) if len(shapes[0]) == 3 else _separate_2d(view, q, k, v, shapes)
    return None if layout is None else generic_o(view, layout)


def _q_kv(view: ModuleView, q: str) -> QKVLayout | None:
    """A query weight beside one fused key/value weight (``to_q`` + ``to_kv``): rows [all K | all V]."""
    kvs = [n for n, s in view.params.items() if len(s) == 2 and _near(n) and _path(n)[1] and n != q
           and "kv" in _tokens(_path(n)[0])]
    if len(kvs) != 1 or len(view.params[q]) != 2 or view.params[kvs[0]][1] != view.params[q][1]:
        return None
    (q_rows, e), kv_rows = view.params[q], view.params[kvs[0]][0]
    heads, d = _attr_geometry(view, e)
    if heads is None or d is None:
        d = view.first(*HEAD_DIM_KEYS) or math.gcd(q_rows, kv_rows // 2)
        heads = q_rows // d
    if heads * d != q_rows or kv_rows % (2 * d) or heads % (kv_rows // (2 * d)):
        return None
    return QKVLayout(heads, d, q, kvs[0], packing="q_kv", n_kv_heads=kv_rows // (2 * d), adapter="separate-named")


def _heads_3d(view: ModuleView, q: str, k: str, v: str, shapes: list) -> QKVLayout | None:
    (hq, a, b), (g, ka, kb) = shapes[0], shapes[1]
    transposed = a >= b  # (H, E, D): the model computes einsum("bte,hed->bhtd", x, w)
    d, e = (b, a) if transposed else (a, b)
    if (ka, kb) != ((e, d) if transposed else (d, e)) or hq % g:
        return None
    return QKVLayout(hq, d, q, k, v, packing="heads_3d", n_kv_heads=g, transposed=transposed,
                     adapter="separate-named")


def _separate_2d(view: ModuleView, q: str, k: str, v: str, shapes: list) -> QKVLayout | None:
    sq, sk, sv = shapes
    weights = all(_path(n)[1] for n in (q, k, v))  # nn.Linear-style (rows, E); raw 2-D: x @ W, (E, rows)
    if sq[1] == sk[1] == sv[1] and (weights or sq[0] != sk[0] or sq[0] != sq[1]):
        transposed = False
    elif sq[0] == sk[0] == sv[0]:
        transposed = True
    else:
        return None
    (q_rows, e), k_rows = (sq[::-1], sk[1]) if transposed else (sq, sk[0])
    heads, d = _attr_geometry(view, e)
    if heads is None or d is None:
        d = view.first(*HEAD_DIM_KEYS) or math.gcd(q_rows, k_rows)
        heads = q_rows // d
    if heads * d != q_rows or k_rows % d:
        return None
    g = kv_count(view) or k_rows // d
    if g * d != k_rows or heads % g:
        return None
    return QKVLayout(heads, d, q, k, v, n_kv_heads=g, transposed=transposed, adapter="separate-named")


def generic_o(view: ModuleView, layout: QKVLayout) -> QKVLayout:
    """The layout with ``o=`` the first weight named like an output projection (``out``, ``proj``, ``o``,
    ``out_proj``, ``to_out.0``, ``c_proj``, ``wo``, ``dense``, ...) that takes H*D inputs."""
    hd = layout.n_heads * layout.head_dim
    for name, shape in view.params.items():
        mods, is_weight = _path(name)
        if name in layout.param_names or len(shape) != 2 or not _near(name) or _stem(mods) not in _O_STEMS:
            continue
        if is_weight and shape[1] == hd:
            return replace(layout, o=name, o_transposed=None if not layout.transposed else False)
        if not is_weight and shape[0] == hd:
            return replace(layout, o=name, o_transposed=True)
    return layout
