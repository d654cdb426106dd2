"""The layout vocabulary: where W_Q, W_K, W_V (and the output projection W_O) live in an attention module,
and how they are packed.

A :class:`QKVLayout` is plain data: parameter names relative to the attention
module, the packing, and the head counts. :func:`split_qkv` applies it to any
tensors that share the parameters' shapes (weights, gradients, updates), so the
live monitor and the checkpoint analysis slice heads the same way; :func:`split_o`
gives W_O, whose update ratio is measured with those of Q, K and V.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from diag.errors import SpecError

__all__ = [
    "PACKINGS",
    "QKVLayout",
    "split_qkv",
    "qkv_views",
    "split_o",
    "split_projections",
    "split_qkv_bias",
    "bias_names",
    "biases_of",
    "qk_heads",
    "shape_problem",
]

PACKINGS = ("separate", "fused", "fused_per_head", "fused_per_group", "q_kv", "heads_3d")


@dataclass(frozen=True)
class QKVLayout:
    """How one attention module stores its query, key and value projections.

    packing:
      * ``separate``: ``q``, ``k``, ``v`` name three weights of shape (rows, E).
      * ``fused``: ``q`` names one weight whose rows are [all Q | all K | all V].
      * ``fused_per_head``: one weight whose rows are, per head, [Q_h | K_h | V_h]
        (GPT-NeoX). Needs n_kv_heads == n_heads.
      * ``fused_per_group``: one weight whose rows are, per key/value group g,
        [Q_{g*r} .. Q_{g*r+r-1} | K_g | V_g] with r = n_heads / n_kv_heads (Falcon's
        new decoder architecture); with n_kv_heads == n_heads it is ``fused_per_head``.
        ``groups`` and ``order`` make it general: the rows are ``groups`` equal groups,
        each holding n_heads / groups query heads and n_kv_heads / groups key and value
        heads, as three blocks in ``order`` (CodeGen: groups=4, order="qvk", i.e. per
        group [Q | V | K]); heads are numbered group by group.
      * ``q_kv``: ``q`` names the query weight, ``k`` one weight whose rows are
        [all K | all V] (GPT-2 cross-attention: ``q_attn`` and ``c_attn``).
      * ``heads_3d``: ``q``, ``k``, ``v`` name three 3-D per-head parameters
        (H, D, E), (G, D, E), (G, D, E); ``transposed=True`` for (H, E, D) storage
        (``einsum("bte,hed->bhtd", x, w)``).
    Names are paths relative to the module: ``"attn.inner.q_proj.weight"`` reaches a
    projection nested any number of levels below it.
    transposed: the weights are stored (E, rows), as GPT-2's Conv1D does.
    o: the output projection's weight (E_out, H*D), when the module holds it (GPT-2
    ``c_proj.weight``, LLaMA ``o_proj.weight``); only its update ratio is measured.
    o_transposed: W_O is stored (H*D, E_out); None: as ``transposed`` (Conv1D models
    store every projection that way).
    n_kv_heads: key/value heads (grouped-query attention); query head h pairs
    with key head h // (n_heads // n_kv_heads), unless ``kv_map`` says otherwise.
    kv_map: an explicit pairing, one entry per query head: query head h pairs with
    key/value head ``kv_map[h]`` (e.g. ``h % n_kv_heads``); None: the default above.
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
    kv_map: tuple[int, ...] | None = None
    groups: int | None = None  # fused_per_group: row groups (None: n_kv_heads, one key/value head per group)
    order: str = "qkv"  # fused_per_group: the order of the Q, K and V blocks inside a group

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
                f"QKVLayout: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}; every key/value "
                "head serves the same number of query heads: check both counts against the model's config"
            )
        if self.packing == "fused_per_head" and self.kv_heads != self.n_heads:
            raise SpecError("QKVLayout(packing='fused_per_head') needs n_kv_heads == n_heads; for grouped "
                            "heads packed [Q_1..Q_r | K | V] per group use packing='fused_per_group'")
        if self.packing == "heads_3d" and (self.k is None or self.v is None):
            raise SpecError("QKVLayout(packing='heads_3d') needs the names q=, k= and v= of three 3-D weights")
        if self.kv_map is not None:
            self._check_kv_map()
        if self.groups is not None or self.order != "qkv":
            self._check_groups()

    def _check_groups(self) -> None:
        if self.packing != "fused_per_group":
            raise SpecError(f"QKVLayout(groups={self.groups!r}, order={self.order!r}) describes the rows of "
                            f"packing='fused_per_group', not packing={self.packing!r}; pass packing='fused_per_group'")
        if not isinstance(self.order, str) or sorted(self.order) != ["k", "q", "v"]:
            raise SpecError(f"QKVLayout.order={self.order!r}: expected the letters q, k and v once each, in the "
                            "order of their blocks inside a group, e.g. 'qkv' or 'qvk'")
        groups = self.groups
        if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
            groups = int(groups)
            object.__setattr__(self, "groups", groups)  # a numpy integer from a config: stored as int
        if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool) or groups < 1
                                   or self.n_heads % groups or self.kv_heads % groups):
            raise SpecError(f"QKVLayout.groups={groups!r}: expected a whole number >= 1 that divides n_heads="
                            f"{self.n_heads} and n_kv_heads={self.kv_heads} (every group holds whole heads)")

    def _check_kv_map(self) -> None:
        kv_map = self.kv_map
        if not isinstance(kv_map, tuple) or len(kv_map) != self.n_heads or not all(
            isinstance(g, int) and not isinstance(g, bool) and 0 <= g < self.kv_heads for g in kv_map
        ):
            raise SpecError(
                f"QKVLayout.kv_map={kv_map!r}: expected a tuple of {self.n_heads} integers in "
                f"[0, {self.kv_heads}) (query head h pairs with key/value head kv_map[h]), e.g. "
                f"{tuple(h % self.kv_heads for h in range(self.n_heads))} for h % n_kv_heads"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_index(self) -> tuple[int, ...]:
        """The key/value head of each query head: ``kv_map``, or the default h // (H / G)."""
        if self.kv_map is not None:
            return self.kv_map
        r = self.n_heads // self.kv_heads
        return tuple(h // r for h in range(self.n_heads))

    @property
    def default_pairing(self) -> bool:
        """True when query head h pairs with key head h // (H / G) (what the spectra assume unpaired)."""
        return self.kv_map is None or self.kv_map == QKVLayout(self.n_heads, self.head_dim, "q", "k", "v",
                                                                 n_kv_heads=self.n_kv_heads).kv_index

    @property
    def param_names(self) -> tuple[str, ...]:
        three = (self.q, self.k, self.v)
        names = {"separate": three, "heads_3d": three, "q_kv": (self.q, self.k)}.get(self.packing, (self.q,))
        return tuple(n for n in names if n is not None)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready data (``kv_map`` as a list); :meth:`from_dict` reads it back. ``groups``
        and ``order`` only where they are not the defaults, so that a version before them reads the rest."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.kv_map is not None:
            out["kv_map"] = list(self.kv_map)
        if self.groups is None:
            del out["groups"]
        if self.order == "qkv":
            del out["order"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QKVLayout:
        """The layout :meth:`to_dict` wrote (missing optional fields take their defaults)."""
        if not isinstance(data, Mapping):
            raise SpecError(f"QKVLayout.from_dict needs a mapping (a JSON object), got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"QKVLayout.from_dict: unknown field(s) {unknown}; known fields: {sorted(known)}")
        missing = [n for n in ("n_heads", "head_dim", "q") if n not in data]
        if missing:
            raise SpecError(f"QKVLayout.from_dict: missing field(s) {missing} (n_heads, head_dim and q are needed)")
        values = dict(data)
        if values.get("kv_map") is not None:
            values["kv_map"] = tuple(values["kv_map"])
        return cls(**values)

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
        if self.kv_map is not None:
            args.append(f"kv_map={self.kv_map!r}")
        if self.groups is not None:
            args.append(f"groups={self.groups}")
        if self.order != "qkv":
            args.append(f"order={self.order!r}")
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


def _heads_3d(w: Tensor, transposed: bool) -> Tensor:
    return w.transpose(1, 2) if transposed else w  # (heads, D, E)


def _fused_rows(fused: Tensor, layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Q (H, D, E), K (G, D, E), V (G, Dv, E) of one fused weight given as rows (R, E)."""
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    e = fused.shape[-1]
    if layout.packing == "fused":
        q, k, v = fused.split([h * d, g * d, fused.shape[0] - (h + g) * d], dim=0)
        return q.reshape(h, d, e), k.reshape(g, d, e), v.reshape(g, -1, e)
    q, k, v = _groups(fused, layout)
    return q.reshape(h, d, e), k.reshape(g, d, e), v.reshape(g, d, e)


def _groups(fused: Tensor, layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor]:
    """fused_per_head and fused_per_group: Q, K, V as views (groups, heads per group, D, E) of the rows (R, E)."""
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    groups = layout.groups or g
    size = {"q": h // groups, "k": g // groups, "v": g // groups}
    grouped = fused.reshape(groups, h // groups + 2 * (g // groups), d, fused.shape[-1])
    parts, start = {}, 0
    for role in layout.order:
        parts[role] = grouped[:, start:start + size[role]]
        start += size[role]
    return parts["q"], parts["k"], parts["v"]


def split_qkv(
    tensors: Mapping[str, Tensor], layout: QKVLayout, paired: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head views (H, D, E), (G, D, E), (G, D, E) of Q, K and V.

    ``tensors`` maps the layout's parameter names to weights, or to tensors of the
    same shapes (gradients, updates). Views share storage (nothing is copied), except
    a role of ``fused_per_group`` whose rows are no single strided block (several
    groups of several heads: Falcon's Q, CodeGen's Q, K and V): a copy. To write a
    slice back, use :func:`qkv_views`.
    ``paired=True``: where the layout has a ``kv_map`` other than the default
    h // (H / G), K and V come as (H, D, E), row h holding the key/value head of query
    head h (a gathered copy), so that code pairing heads by position (the spectra)
    pairs them as the model does; norms of K and V must be taken unpaired.
    """
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    if layout.packing in ("separate", "heads_3d"):
        cut = _heads_3d if layout.packing == "heads_3d" else _rows
        parts = [cut(tensors[name], layout.transposed) for name in (layout.q, layout.k, layout.v)]
        q, k, v = (p.reshape(n, -1, p.shape[-1]) for p, n in zip(parts, (h, g, g)))
    elif layout.packing == "q_kv":
        kv = _rows(tensors[layout.k], layout.transposed)
        q, k, v = _rows(tensors[layout.q], layout.transposed), *kv.split([g * d, kv.shape[0] - g * d], dim=0)
        q, k, v = q.reshape(h, d, q.shape[-1]), k.reshape(g, d, k.shape[-1]), v.reshape(g, -1, v.shape[-1])
    else:
        q, k, v = _fused_rows(_rows(tensors[layout.q], layout.transposed), layout)
    if paired and not layout.default_pairing:
        index = list(layout.kv_index)
        k, v = k[index], v[index]
    return q, k, v


def qkv_views(tensors: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K and V as views of ``tensors`` that share their storage, for code that writes a slice back (the step
    limit). The shapes of :func:`split_qkv` (unpaired), except where a role's rows are not one strided block
    (``fused_per_group`` with several groups of several heads, e.g. Falcon's r query heads per group): those
    stay (groups, heads per group, D, E) (``split_qkv`` gives the (H, D, E) copy). Read any of them as a
    matrix with ``.reshape(-1, E)``."""
    if layout.packing in ("fused_per_head", "fused_per_group"):
        return tuple(_flat_view(p) for p in _groups(_rows(tensors[layout.q], layout.transposed), layout))
    return split_qkv(tensors, layout)


def _flat_view(part: Tensor) -> Tensor:
    """(groups, n, D, E) as (groups * n, D, E) where that is a view, else as it is."""
    try:
        return part.view(-1, *part.shape[2:])
    except RuntimeError:
        return part


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


def _need_rows(layout: QKVLayout) -> dict[str, int]:
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    return {
        "separate": {layout.q: h * d, layout.k: g * d},
        "heads_3d": {},
        "fused": {layout.q: (h + 2 * g) * d},
        "fused_per_head": {layout.q: 3 * h * d},
        "fused_per_group": {layout.q: (h + 2 * g) * d},
        "q_kv": {layout.q: h * d, layout.k: 2 * g * d},
    }[layout.packing]


def _heads_3d_problem(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    for name, heads in zip((layout.q, layout.k, layout.v), (layout.n_heads, layout.kv_heads, layout.kv_heads)):
        shape = tuple(shapes[name])
        d = shape[2] if layout.transposed else (shape[1] if len(shape) == 3 else None)
        if len(shape) != 3 or shape[0] != heads or (name != layout.v and d != layout.head_dim):
            want = "(heads, E, D)" if layout.transposed else "(heads, D, E)"
            return (f"{name!r} has shape {shape}, but {layout.describe()} needs a 3-D per-head weight {want} "
                    f"with heads={heads}, D={layout.head_dim}")
    return None


def shape_problem(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why the named weights cannot hold this layout's heads, or None when their shapes fit."""
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    need = _need_rows(layout)
    if layout.packing == "heads_3d":
        problem = _heads_3d_problem(layout, shapes)
        if problem:
            return problem
    for name in layout.param_names if layout.packing != "heads_3d" else ():
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
    if layout.packing in ("separate", "q_kv", "heads_3d"):
        bq, bk = biases.get(layout.q), biases.get(layout.k)
        bq = None if bq is None else bq.reshape(h, d)
        bk = None if bk is None else bk.reshape(-1)[: g * d].reshape(g, d)
        return bq, bk
    fused = biases.get(layout.q)
    if fused is None:
        return None, None
    q, k, _ = _fused_rows(fused[:, None], layout)
    return q[..., 0], k[..., 0]


def biases_of(params: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """The bias of each weight in ``names`` that ``params`` holds (named as :func:`bias_names` says), by the
    weight's name."""
    out = {}
    for name in names:
        found = next((b for b in bias_names(name) if b in params), None)
        if found is not None:
            out[name] = params[found]
    return out


def qk_heads(params: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Per-head query and key weights (H, D, E), (G, D, E) (unpaired) and their biases (H, D), (G, D) or None,
    from a module's parameters by name (weights and biases alike)."""
    wq, wk, _ = split_qkv(params, layout)
    bq, bk = split_qkv_bias(biases_of(params, layout.param_names), layout)
    return wq, wk, bq, bk
