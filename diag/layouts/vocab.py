"""The layout vocabulary: where W_Q, W_K, W_V (and the output projection W_O) live in an attention module,
and how they are packed.

A :class:`QKVLayout` is plain data: parameter names relative to the attention
module, the packing, and the head counts. What depends on the packing lives in its registered class
(:mod:`diag.layouts.packings`); the functions here dispatch to it. :func:`split_qkv` applies it to any
tensors that share the parameters' shapes (weights, gradients, updates), so the
live monitor and the checkpoint analysis slice heads the same way; :func:`split_o`
gives W_O, whose update ratio is measured with those of Q, K and V.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from diag.errors import SpecError
from diag.layouts.biases import biases_of
from diag.layouts.packings import PACKINGS, packing_of, rows_of

__all__ = [
    "PACKINGS",
    "QKVLayout",
    "split_qkv",
    "qkv_views",
    "split_o",
    "split_projections",
    "split_qkv_bias",
    "qk_heads",
    "shape_problem",
    "implied_layouts",
]


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
            raise SpecError(f"QKVLayout.packing={self.packing!r}; expected one of {tuple(PACKINGS)}")
        if self.n_heads < 1 or self.head_dim < 1:
            raise SpecError(
                f"QKVLayout needs n_heads >= 1 and head_dim >= 1, got {self.n_heads}, {self.head_dim}"
            )
        if self.n_heads % self.kv_heads:
            raise SpecError(
                f"QKVLayout: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}; every key/value "
                "head serves the same number of query heads: check both counts against the model's config"
            )
        if isinstance(self.groups, numbers.Integral) and not isinstance(self.groups, bool):
            object.__setattr__(self, "groups", int(self.groups))  # a numpy integer from a config: stored as int
        problem = packing_of(self).check(self)
        if problem is not None:
            raise SpecError(problem)
        if self.kv_map is not None:
            self._check_kv_map()

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
        return tuple(n for n in packing_of(self).names(self) if n is not None)

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
        if self.packing != _DEFAULT_PACKING:
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


_DEFAULT_PACKING = next(f.default for f in fields(QKVLayout) if f.name == "packing")  # describe() leaves it out


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
    q, k, v = packing_of(layout).split(tensors, layout)
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
    return packing_of(layout).views(tensors, layout)


def split_o(tensors: Mapping[str, Tensor], layout: QKVLayout) -> Tensor | None:
    """W_O as (E_out, H*D), the nn.Linear orientation (a view), or None when the layout names none."""
    if layout.o is None:
        return None
    return rows_of(tensors[layout.o], layout.o_is_transposed)


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
    problem = packing_of(layout).shape_problem(layout, shapes)
    if problem is not None:
        return problem
    h, d = layout.n_heads, layout.head_dim
    if layout.o is not None:
        shape = tuple(shapes[layout.o])
        axis = "rows (o_transposed)" if layout.o_is_transposed else "columns"
        if len(shape) != 2 or shape[0 if layout.o_is_transposed else 1] != h * d:
            return (f"the output projection {layout.o!r} has shape {shape}, but {layout.describe()} needs "
                    f"{h * d} {axis} (n_heads * head_dim: W_O maps the concatenated heads back)")
    return None


def split_qkv_bias(biases: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor | None, Tensor | None]:
    """Per-head query and key biases (H, D), (G, D), sliced like :func:`split_qkv`; None where absent.

    ``biases`` maps the layout's weight names to their biases (or omits them).
    """
    return packing_of(layout).bias(biases, layout)


def qk_heads(params: Mapping[str, Tensor], layout: QKVLayout) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Per-head query and key weights (H, D, E), (G, D, E) (unpaired) and their biases (H, D), (G, D) or None,
    from a module's parameters by name (weights and biases alike)."""
    wq, wk, _ = split_qkv(params, layout)
    bq, bk = split_qkv_bias(biases_of(params, layout.param_names), layout)
    return wq, wk, bq, bk


def implied_layouts(params: Mapping[str, tuple[int, ...]], heads: int | None) -> list[QKVLayout]:
    """The layouts a module's weights (name -> shape, in registration order) imply, every registered packing's
    in registration order (:meth:`diag.layouts.packings.Packing.implied`), with ``heads`` query heads where the
    shapes do not say."""
    return [QKVLayout(**arguments) for packing in PACKINGS.values() for arguments in packing.implied(params, heads)]
