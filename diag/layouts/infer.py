"""Read a layout from the computation: which rows of which weight became each head the attention kernel got.

Given the module input x (n, T, E) and the q (n, H, T, D) and k (n, G', S, D) that the kernel received, each
candidate weight's projection of x is cut into blocks of D rows, and each kernel head is matched with the one
block whose **per-position Gram across sequences** it reproduces: ``<z_a[t], z_b[t]>`` for sequences a, b at
the same position t. That profile is unchanged by anything that rotates each position the same way in every
sequence (RoPE, any variant, partial or not), by a common scale (``q * scale`` before the kernel), and it keeps
more than the norms do (the norm check's blind spot: at initialisation a QK-norm makes every norm equal, the
cross terms still differ). A norm applied to q or k between projection and kernel (QK-norm, under any name) is
matched by applying the module's own norm-like children to the blocks.

The matched blocks give the head count and size, the packing, the storage orientation and the query -> key
head pairing; :func:`layout_from_blocks` turns them into the :class:`QKVLayout` whose split reproduces them.
Pure tensor functions: the live module is read by ``hooks.layout.confirm``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from diag.layouts.vocab import QKVLayout, shape_problem, split_qkv

__all__ = ["Block", "profiles", "match_heads", "split_ids", "same_split", "layout_from_blocks", "fused_layouts",
           "query_source"]


@dataclass(frozen=True)
class Block:
    """Rows ``block*D .. block*D+D`` (per head: slice ``block``) of weight ``name`` read in ``orient``.

    orient: ``rows`` (R, E), ``cols`` (E, R), ``heads`` (H, D, E), ``heads_t`` (H, E, D)."""

    name: str
    orient: str
    block: int
    transform: str = ""  # the norm-like child applied between projection and kernel, "" for none


def query_source(x: Tensor, q: Tensor, k: Tensor, cross: bool) -> Tensor:
    """What the queries were projected from: x, or its first tokens when the kernel got fewer queries than x
    has tokens while its keys are all of x's (class attention: CaiT's and VOLO's class token queries)."""
    if not cross and x.dim() == 3 and q.shape[2] < x.shape[1] == k.shape[2]:
        return x[:, : q.shape[2]]
    return x


def profiles(z: Tensor) -> Tensor:
    """(n, heads, T, D) -> (heads, T * n * n): per-position Grams across sequences, float64, unit norm."""
    z = z.double()
    gram = torch.einsum("ahtd,bhtd->htab", z, z).flatten(1)
    return gram / gram.norm(dim=1, keepdim=True).clamp_min(1e-300)


def match_heads(kernel: Tensor, candidates: Tensor, tol: float) -> list[list[int]]:
    """For each kernel head profile (Hk, F), the candidate profiles (C, F) within ``tol`` (Euclidean,
    both of unit norm) of it."""
    if candidates.numel() == 0:
        return [[] for _ in range(kernel.shape[0])]
    dist = (2 - 2 * kernel @ candidates.T).clamp_min(0).sqrt()  # (Hk, C)
    return [torch.nonzero(row <= tol).flatten().tolist() for row in dist]


def _thin(shape: tuple[int, ...], e_axis: int) -> tuple[int, ...]:
    """The shape with its input axis (size E) cut to 1: a split depends on rows only, so ids stay small."""
    return tuple(1 if i == e_axis % len(shape) else size for i, size in enumerate(shape))


def _e_axis(layout: QKVLayout, ndim: int) -> int:
    if ndim == 3:
        return 1 if layout.transposed else 2
    return 0 if layout.transposed else 1


def split_ids(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    """Which stored rows each head reads: ids (H, D, 1) for Q, and (H, D, 1) for the K paired with each
    query head. Two layouts that give the same ids split the same weights the same way."""
    tensors, offset = {}, 0
    for name in sorted(set(layout.param_names)):
        shape = _thin(tuple(shapes[name]), _e_axis(layout, len(shapes[name])))
        n = torch.Size(shape).numel()
        tensors[name] = torch.arange(offset, offset + n).reshape(shape)
        offset += n
    q, k, _ = split_qkv(tensors, layout, paired=True)
    if k.shape[0] != q.shape[0]:
        k = k[list(layout.kv_index)]
    return q, k


def same_split(a: QKVLayout, b: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether two layouts read the same Q and K heads (and pairing) out of the same weights."""
    if a.n_heads != b.n_heads or a.head_dim != b.head_dim:
        return False
    qa, ka = split_ids(a, shapes)
    qb, kb = split_ids(b, shapes)
    return qa.shape == qb.shape and ka.shape == kb.shape and bool((qa == qb).all() and (ka == kb).all())


_BLOCK_E_AXIS = {"rows": 1, "cols": 0, "heads": 2, "heads_t": 1}


def _block_ids(block: Block, shape: tuple[int, ...], d: int) -> Tensor:
    """The stored-row ids (D, 1) of a block, numbered as :func:`_ids_by_param` numbers its parameter."""
    shape = _thin(shape, _BLOCK_E_AXIS[block.orient])
    ids = torch.arange(torch.Size(shape).numel()).reshape(shape)
    if block.orient == "cols":
        ids = ids.T
    elif block.orient in ("heads", "heads_t"):
        ids = ids if block.orient == "heads" else ids.transpose(1, 2)
        return ids[block.block]
    return ids[block.block * d:(block.block + 1) * d]


def fused_layouts(h: int, d: int, name: str, g: int, q_first: bool = False, **fields: Any) -> list[QKVLayout]:
    """Every way one weight can hold h query and g key/value heads of d rows each, the named packings first:
    [all Q | all K | all V], per key/value group [Q_1..Q_r | K | V] (per head when g == h), then any grouping
    of whole heads with the Q, K and V blocks in any order (CodeGen: 4 groups of [Q | V | K]). ``q_first``:
    where Q and K blocks are the same size (g == h), only orders with Q before K (a test that cannot tell a
    query block from a key block, as the probe forward's scaling cannot, would otherwise take either).
    ``fields``: the other QKVLayout fields (transposed, cross, adapter)."""
    out = [QKVLayout(h, d, name, packing=p, n_kv_heads=g, **fields)
           for p in ("fused", "fused_per_group" if g < h else "fused_per_head")]
    orders = ["".join(o) for o in itertools.permutations("qkv")]
    if q_first and g == h:
        orders = [o for o in orders if o.index("q") < o.index("k")]
    for groups in (n for n in range(1, g + 1) if g % n == 0):
        for order in orders:
            if order != "qkv" or groups not in (1, g):  # (1, "qkv") is fused, (g, "qkv") the one above
                out.append(QKVLayout(h, d, name, packing="fused_per_group", n_kv_heads=g, groups=groups,
                                     order=order, **fields))
    return out


def _candidates(q: Block, k: Block, shapes: Mapping[str, tuple[int, ...]], h: int, g: int, d: int,
                value: str | None) -> list[QKVLayout]:
    transposed = q.orient in ("cols", "heads_t")
    if q.name == k.name:
        return fused_layouts(h, d, q.name, g, transposed=transposed)
    rows_k = shapes[k.name][0 if k.orient == "rows" else -1] if k.orient in ("rows", "cols") else None
    out = []
    if rows_k == 2 * g * d:
        out.append(QKVLayout(h, d, q.name, k.name, packing="q_kv", n_kv_heads=g, transposed=transposed))
    if value is not None:
        packing = "heads_3d" if q.orient in ("heads", "heads_t") else "separate"
        out.append(QKVLayout(h, d, q.name, k.name, value, packing=packing, n_kv_heads=g, transposed=transposed))
    return out


def layout_from_blocks(q_blocks: Sequence[Block], k_blocks: Sequence[Block], kv_of_query: Sequence[int],
                       shapes: Mapping[str, tuple[int, ...]], d: int, value: str | None) -> QKVLayout | None:
    """The layout whose split gives query head h the block ``q_blocks[h]`` and pairs it with
    ``k_blocks[kv_of_query[h]]``, or None when no packing of the vocabulary does.

    value: the value weight for three-weight packings (not visible in q and k)."""
    h = len(q_blocks)
    if len({(b.name, b.orient) for b in q_blocks}) != 1 or len({(b.name, b.orient) for b in k_blocks}) != 1:
        return None
    kv_blocks = sorted({b.block for b in k_blocks})
    g = len(kv_blocks)
    if g == 0 or h % g:
        return None
    want_q = torch.stack([_block_ids(b, shapes[b.name], d) for b in q_blocks])
    want_k = torch.stack([_block_ids(k_blocks[j], shapes[k_blocks[j].name], d) for j in kv_of_query])
    for layout in _candidates(q_blocks[0], k_blocks[0], shapes, h, g, d, value):
        if shape_problem(layout, shapes) is not None:
            continue
        q_ids, k_ids = _ids_by_param(layout, shapes)
        if q_ids.shape != want_q.shape or not bool((q_ids == want_q).all()):
            continue
        kv_map = []
        for target in want_k:
            hit = [gi for gi in range(k_ids.shape[0]) if bool((k_ids[gi] == target).all())]
            if len(hit) != 1:
                break
            kv_map.append(hit[0])
        else:
            found = replace(layout, kv_map=tuple(kv_map), adapter="inferred")
            return replace(found, kv_map=None) if found.default_pairing else found
    return None


def _ids_by_param(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    """Per-parameter row ids (each parameter numbered from 0, as :func:`_block_ids` does): Q (H, D, 1),
    K (G, D, 1), unpaired."""
    tensors = {}
    for name in set(layout.param_names):
        shape = _thin(tuple(shapes[name]), _e_axis(layout, len(shapes[name])))
        tensors[name] = torch.arange(torch.Size(shape).numel()).reshape(shape)
    q, k, _ = split_qkv(tensors, layout)
    return q, k
