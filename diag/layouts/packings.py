"""Packings: the ways an attention module stores its query, key and value projections, one class each.

A :class:`~diag.layouts.vocab.QKVLayout` names its packing (``packing="fused"``); the registered
:class:`Packing` of that name knows everything that depends on it: which parameters the layout names
(:meth:`~Packing.names`), what makes a layout of it well formed (:meth:`~Packing.check`), how many rows each
weight has (:meth:`~Packing.rows`, :meth:`~Packing.shape_problem`), how weights and biases split into heads
(:meth:`~Packing.split`, :meth:`~Packing.bias`), which roles each parameter holds and their writable views
(:meth:`~Packing.roles`, :meth:`~Packing.role_views`: the step limit), which weight is the key projection's
own (:meth:`~Packing.key_weight`: the capture), what the weights alone cannot tell (:meth:`~Packing.assumed`:
the checkpoint analysis) and which layouts a module's weight shapes allow (:meth:`~Packing.implied`: the
refusal when no attention layer is recognised), and what tensor parallelism asks: whether contiguous row blocks
are whole heads (:attr:`~Packing.row_blocks_are_heads`) and which dim of a weight stacks its heads
(:meth:`~Packing.heads_dim`). The vocabulary, the step limit, the offline layers, the suspects and the
tensor-parallel code dispatch here; none of them branches on a packing's name.

A packing reads a layout through :class:`Layout` (what :class:`~diag.layouts.vocab.QKVLayout` holds) and
answers :meth:`~Packing.implied` with the layouts' arguments, so this module needs nothing of the vocabulary.

A new packing is one subclass registered with :func:`register_packing` (and a zoo model that stores its
weights that way, with exactness tests): ``PACKINGS`` keeps the registration order, the one
``QKVLayout(packing=...)`` accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from torch import Tensor

from diag.errors import SpecError
from diag.layouts.biases import bias_names

__all__ = ["Layout", "Packing", "PACKINGS", "register_packing", "packing_of", "rows_of", "FUSED_ORDER"]

Views = tuple[Tensor, Tensor, Tensor]
Arguments = dict[str, Any]  # the keyword arguments of one QKVLayout
FUSED_ORDER = ("the fused weight's rows are [all Q | all K | all V], heads in contiguous blocks of {d} rows (not "
               "interleaved per head)")


class Layout(Protocol):
    """What a packing reads of a layout (:class:`diag.layouts.vocab.QKVLayout` has it)."""

    n_heads: int
    head_dim: int
    q: str
    k: str | None
    v: str | None
    packing: str
    transposed: bool
    groups: int | None
    order: str

    @property
    def kv_heads(self) -> int: ...

    @property
    def param_names(self) -> tuple[str, ...]: ...

    def describe(self) -> str: ...


def rows_of(w: Tensor, transposed: bool) -> Tensor:
    """A stored weight as rows (R, E): transposed storage (E, R), as GPT-2's Conv1D keeps it, read as a view."""
    return w.T if transposed else w


def _heads_3d(w: Tensor, transposed: bool) -> Tensor:
    return w.transpose(1, 2) if transposed else w  # (heads, D, E)


class Packing:
    """One packing of Q, K and V (subclasses set ``name`` and override what differs from three 2-D weights
    ``q``, ``k``, ``v`` of rows H*D, G*D, G*D)."""

    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""  # one line: what the rows hold (messages, docs)
    # whether each contiguous block of a weight's rows (along :meth:`heads_dim`) holds whole heads (with grouped
    # heads, whole key/value groups): what tensor parallelism's ColwiseParallel needs to give each rank whole heads
    row_blocks_are_heads: ClassVar[bool] = False

    def names(self, layout: Layout) -> tuple[str | None, ...]:
        """The parameters the layout names, in role order (None where the layout leaves one unnamed)."""
        return (layout.q,)

    def check(self, layout: Layout) -> str | None:
        """Why the layout is not well formed for this packing, or None."""
        if layout.groups is not None or layout.order != "qkv":
            return (f"QKVLayout(groups={layout.groups!r}, order={layout.order!r}) describes the rows of "
                    f"packing='fused_per_group', not packing={self.name!r}; pass packing='fused_per_group'")
        return None

    def rows(self, layout: Layout) -> dict[str, int]:
        """Rows each named 2-D weight must have (in its rows orientation)."""
        return {}

    def shape_problem(self, layout: Layout, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """Why the named weights cannot hold the layout's heads, or None (W_O is checked by the vocabulary)."""
        need = self.rows(layout)
        for name in layout.param_names:
            shape = tuple(shapes[name])
            if len(shape) != 2:
                return f"{name!r} has shape {shape}; a projection weight is 2-D"
            rows = shape[1] if layout.transposed else shape[0]
            if name in need and rows != need[name]:
                axis = "columns (transposed)" if layout.transposed else "rows"
                return (f"{name!r} has shape {shape}: {rows} {axis}, but {layout.describe()} needs {need[name]} "
                        f"(n_heads={layout.n_heads}, n_kv_heads={layout.kv_heads}, head_dim={layout.head_dim})")
        return None

    def split(self, tensors: Mapping[str, Tensor], layout: Layout) -> Views:
        """Q (H, D, E), K (G, D, E), V (G, Dv, E), unpaired, as views where the rows allow."""
        raise NotImplementedError

    def views(self, tensors: Mapping[str, Tensor], layout: Layout) -> Views:
        """Q, K, V as views sharing the tensors' storage (what :func:`diag.layouts.vocab.qkv_views` returns)."""
        return self.split(tensors, layout)

    def bias(self, biases: Mapping[str, Tensor], layout: Layout) -> tuple[Tensor | None, Tensor | None]:
        """Per-head query and key biases (H, D), (G, D) from the biases by their weight's name; None where absent."""
        raise NotImplementedError

    def roles(self, layout: Layout) -> dict[str, tuple[str, ...]]:
        """Which of "q", "k", "v" each named parameter holds, in row order."""
        return {layout.q: ("q", "k", "v")}

    def role_views(self, t: Tensor, name: str, layout: Layout) -> dict[str, Tensor]:
        """Writable views of the roles parameter ``name`` holds in a tensor ``t`` of its shape."""
        return dict(zip("qkv", self.views({name: t}, layout)))

    def key_weight(self, layout: Layout) -> str | None:
        """The key projection's own weight, where it is a parameter of its own applied by ``F.linear``."""
        return None

    def heads_dim(self, layout: Layout) -> int:
        """The dim of each Q/K/V weight along which its heads are stacked: its rows (the columns of a weight
        stored transposed)."""
        return 1 if layout.transposed else 0

    def assumed(self, layout: Layout) -> str | None:
        """What the weights' names and shapes cannot confirm about this packing's rows, or None."""
        return None

    def implied(self, params: Mapping[str, tuple[int, ...]], heads: int | None) -> list[Arguments]:
        """The layouts of this packing (their ``QKVLayout`` arguments) that a module's weights (name -> shape, in
        registration order) imply, with ``heads`` query heads where the shapes do not say; [] where they cannot
        tell. What a refusal offers, and the first proposal for a module only the computation found
        (:func:`diag.layouts.vocab.implied_layouts`)."""
        return []


PACKINGS: dict[str, Packing] = {}


def register_packing(packing: Packing) -> Packing:
    """Add a packing to the vocabulary (``QKVLayout(packing=packing.name)``); its name must be new."""
    if not isinstance(packing, Packing) or not packing.name or not isinstance(packing.name, str):
        raise SpecError(f"register_packing needs a Packing instance with a name, got {packing!r}")
    if packing.name in PACKINGS:
        raise SpecError(f"register_packing: a packing named {packing.name!r} is registered already "
                        f"({type(PACKINGS[packing.name]).__name__}); choose another name")
    PACKINGS[packing.name] = packing
    return packing


def packing_of(layout: Layout) -> Packing:
    return PACKINGS[layout.packing]


class _Three(Packing):
    """Three parameters, one role each, heads as contiguous blocks."""

    row_blocks_are_heads = True

    def names(self, layout):
        return (layout.q, layout.k, layout.v)

    def check(self, layout):
        if layout.k is None or layout.v is None:
            return f"QKVLayout(packing={self.name!r}) needs the names q=, k= and v={self._what}"
        return super().check(layout)

    _what = ""

    def roles(self, layout):
        return {layout.q: ("q",), layout.k: ("k",), layout.v: ("v",)}

    def role_views(self, t, name, layout):
        return {self.roles(layout)[name][0]: t}

    def bias(self, biases, layout):
        return _separate_bias(biases, layout)


def _separate_bias(biases: Mapping[str, Tensor], layout: Layout) -> tuple[Tensor | None, Tensor | None]:
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    bq, bk = biases.get(layout.q), biases.get(layout.k)
    bq = None if bq is None else bq.reshape(h, d)
    bk = None if bk is None else bk.reshape(-1)[: g * d].reshape(g, d)
    return bq, bk


class Separate(_Three):
    name, doc = "separate", "three weights: H*D, G*D, G*D rows, heads as contiguous blocks"

    def rows(self, layout):
        return {layout.q: layout.n_heads * layout.head_dim, layout.k: layout.kv_heads * layout.head_dim}

    def split(self, tensors, layout):
        parts = [rows_of(tensors[n], layout.transposed) for n in (layout.q, layout.k, layout.v)]
        h, g = layout.n_heads, layout.kv_heads
        return tuple(p.reshape(n, -1, p.shape[-1]) for p, n in zip(parts, (h, g, g)))

    def key_weight(self, layout):
        return layout.k

    def implied(self, params, heads):
        """The first three weights (rows, E) of one width whose rows hold H, G, G heads of one size."""
        biases = {b for name in params for b in bias_names(name)}  # a (heads, D) bias is no projection
        by_width: dict[int, list[str]] = {}
        for name, shape in params.items():
            if len(shape) == 2 and name not in biases:
                by_width.setdefault(shape[1], []).append(name)
        for names in by_width.values():
            if len(names) < 3 or not heads:
                continue
            (rq, _), (rk, _), (rv, _) = (params[n] for n in names[:3])
            d = rq // heads
            if rq % heads == 0 and rk == rv and rk % d == 0 and heads % (rk // d) == 0:
                return [_arguments(heads, d, *names[:3], n_kv_heads=rk // d)]
        return []


class Heads3D(_Three):
    name, doc = "heads_3d", "three 3-D per-head weights (H, D, E), (G, D, E), (G, D, E); (H, E, D) transposed"
    _what = " of three 3-D weights"

    def shape_problem(self, layout, shapes):
        for name, heads in zip((layout.q, layout.k, layout.v), (layout.n_heads, layout.kv_heads, layout.kv_heads)):
            shape = tuple(shapes[name])
            d = shape[2] if layout.transposed else (shape[1] if len(shape) == 3 else None)
            if len(shape) != 3 or shape[0] != heads or (name != layout.v and d != layout.head_dim):
                want = "(heads, E, D)" if layout.transposed else "(heads, D, E)"
                return (f"{name!r} has shape {shape}, but {layout.describe()} needs a 3-D per-head weight {want} "
                        f"with heads={heads}, D={layout.head_dim}")
        return None

    def implied(self, params, heads):
        """The first three 3-D weights of one shape (H, a, b), (G, a, b), (G, a, b), H a multiple of G: per head
        (heads, D, E), or (heads, E, D) where a > b (a head is narrower than the model); both where a == b."""
        by_tail: dict[tuple[int, ...], list[str]] = {}
        for name, shape in params.items():
            if len(shape) == 3:
                by_tail.setdefault(tuple(shape[1:]), []).append(name)
        for (a, b), names in by_tail.items():  # the first three of a shape (W_O may share it: registered last)
            if len(names) < 3:
                continue
            names = names[:3]
            h, g, g2 = (params[n][0] for n in names)
            if g == g2 and h % g == 0:
                return [_arguments(h, b if t else a, *names, packing=self.name, n_kv_heads=g, transposed=t)
                        for t in ((True,) if a > b else (False,) if a < b else (False, True))]
        return []

    def split(self, tensors, layout):
        parts = [_heads_3d(tensors[n], layout.transposed) for n in (layout.q, layout.k, layout.v)]
        h, g = layout.n_heads, layout.kv_heads
        return tuple(p.reshape(n, -1, p.shape[-1]) for p, n in zip(parts, (h, g, g)))

    def heads_dim(self, layout):
        return 0  # (heads, D, E), or (heads, E, D) transposed


class QKV(Packing):
    name, doc = "q_kv", "q: queries, k: one weight whose rows are [all K | all V]"

    def names(self, layout):
        return (layout.q, layout.k)

    def check(self, layout):
        if layout.k is None:
            return "QKVLayout(packing='q_kv') needs q= (queries) and k= (the fused [K | V] weight)"
        return super().check(layout)

    def rows(self, layout):
        return {layout.q: layout.n_heads * layout.head_dim, layout.k: 2 * layout.kv_heads * layout.head_dim}

    def split(self, tensors, layout):
        h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
        kv = rows_of(tensors[layout.k], layout.transposed)
        q, k, v = rows_of(tensors[layout.q], layout.transposed), *kv.split([g * d, kv.shape[0] - g * d], dim=0)
        return q.reshape(h, d, q.shape[-1]), k.reshape(g, d, k.shape[-1]), v.reshape(g, -1, v.shape[-1])

    def bias(self, biases, layout):
        return _separate_bias(biases, layout)

    def roles(self, layout):
        return {layout.q: ("q",), layout.k: ("k", "v")}

    def role_views(self, t, name, layout):
        if name == layout.q:
            return {"q": t}
        rows, kv = rows_of(t, layout.transposed), layout.kv_heads * layout.head_dim
        return {"k": rows[:kv], "v": rows[kv:]}

    def key_weight(self, layout):
        return layout.k

    def assumed(self, layout):
        return FUSED_ORDER.format(d=layout.head_dim)


class _OneWeight(Packing):
    """One weight holding Q, K and V."""

    def rows(self, layout):
        return {layout.q: (layout.n_heads + 2 * layout.kv_heads) * layout.head_dim}

    def split(self, tensors, layout):
        q, k, v = self._parts(rows_of(tensors[layout.q], layout.transposed), layout)
        h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
        e = q.shape[-1]
        return q.reshape(h, d, e), k.reshape(g, d, e), v.reshape(g, -1, e)

    def bias(self, biases, layout):
        fused = biases.get(layout.q)
        if fused is None:
            return None, None
        q, k, _ = self._parts(fused[:, None], layout)
        h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
        return q.reshape(h, d, 1)[..., 0], k.reshape(g, d, 1)[..., 0]

    def _parts(self, fused: Tensor, layout: Layout) -> Views:
        """Q, K, V rows of one weight given as rows (R, E), in any shape that reshapes to heads."""
        raise NotImplementedError

    def implied(self, params, heads):
        """The first weight (3E, E) or (E, 3E) whose width the head count divides."""
        for name, shape in params.items():
            if len(shape) == 2 and 3 * min(shape) == max(shape) and heads and min(shape) % heads == 0:
                return [_arguments(heads, min(shape) // heads, q=name, packing=self.name,
                                   transposed=shape[0] < shape[1])]
        return []


class Fused(_OneWeight):
    name, doc = "fused", "q: one weight, rows [all Q | all K | all V]"

    def _parts(self, fused, layout):
        h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
        return tuple(fused.split([h * d, g * d, fused.shape[0] - (h + g) * d], dim=0))

    def assumed(self, layout):
        return FUSED_ORDER.format(d=layout.head_dim)


class FusedPerGroup(_OneWeight):
    name, doc = "fused_per_group", ("q: one weight, per key/value group [Q_1 .. Q_r | K | V] (groups=, order= "
                                    "make it general)")
    row_blocks_are_heads = True  # a block of whole groups holds whole heads

    def check(self, layout):
        if not isinstance(layout.order, str) or sorted(layout.order) != ["k", "q", "v"]:
            return (f"QKVLayout.order={layout.order!r}: expected the letters q, k and v once each, in the order "
                    "of their blocks inside a group, e.g. 'qkv' or 'qvk'")
        groups = layout.groups
        if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool) or groups < 1
                                   or layout.n_heads % groups or layout.kv_heads % groups):
            return (f"QKVLayout.groups={groups!r}: expected a whole number >= 1 that divides n_heads="
                    f"{layout.n_heads} and n_kv_heads={layout.kv_heads} (every group holds whole heads)")
        return None

    def _parts(self, fused, layout):
        """Q, K, V as views (groups, heads per group, D, E) of the rows (R, E)."""
        h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
        groups = layout.groups or g
        size = {"q": h // groups, "k": g // groups, "v": g // groups}
        grouped = fused.reshape(groups, h // groups + 2 * (g // groups), d, fused.shape[-1])
        parts, start = {}, 0
        for role in layout.order:
            parts[role] = grouped[:, start:start + size[role]]
            start += size[role]
        return parts["q"], parts["k"], parts["v"]

    def implied(self, params, heads):
        return []  # its key/value head count is not in one weight's shape; with G == H it is fused_per_head

    def views(self, tensors, layout):
        """Views (groups * n, D, E) where that is a view, else (groups, n, D, E) (several groups of several
        heads: Falcon's Q), which a reader reshapes to (-1, E)."""
        return tuple(_flat_view(p) for p in self._parts(rows_of(tensors[layout.q], layout.transposed), layout))


def _flat_view(part: Tensor) -> Tensor:
    """(groups, n, D, E) as (groups * n, D, E) where that is a view, else as it is."""
    try:
        return part.view(-1, *part.shape[2:])
    except RuntimeError:
        return part


class FusedPerHead(FusedPerGroup):
    name, doc = "fused_per_head", "q: one weight, per head [Q_h | K_h | V_h] (GPT-NeoX, BLOOM)"

    def check(self, layout):
        if layout.kv_heads != layout.n_heads:
            return ("QKVLayout(packing='fused_per_head') needs n_kv_heads == n_heads; for grouped "
                    "heads packed [Q_1..Q_r | K | V] per group use packing='fused_per_group'")
        return Packing.check(self, layout)

    def rows(self, layout):
        return {layout.q: 3 * layout.n_heads * layout.head_dim}

    def implied(self, params, heads):
        return _OneWeight.implied(self, params, heads)


def _arguments(n_heads: int, head_dim: int, q: str, k: str | None = None, v: str | None = None,
               **options: Any) -> Arguments:
    """The keyword arguments of ``QKVLayout(n_heads, head_dim, q, k, v, **options)``."""
    return {"n_heads": n_heads, "head_dim": head_dim, "q": q, "k": k, "v": v, **options}


for _packing in (Separate(), Fused(), FusedPerHead(), FusedPerGroup(), QKV(), Heads3D()):
    register_packing(_packing)
