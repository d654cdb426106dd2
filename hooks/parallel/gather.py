"""Whole tensors from sharded ones, in float32 or better: what the Monitor reads of DTensor weights and gradients.

FSDP2 parameters are DTensors sharded on one dim; the local shards of a layer's weights (and of its Q/K/V
gradients when the step samples them) are packed into one flat buffer and one ``all_gather_into_tensor``.
Under tensor parallelism each rank keeps its own block of heads (``keep``: the mesh dim it is split on), and
only the other mesh dims are gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hooks.parallel.dtensors import is_dtensor

__all__ = ["widened", "gather_kind", "gathers", "gather_full", "gather_to", "local_shards", "gather_like",
           "all_gather_rows"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def widened(t: Tensor) -> Tensor:
    """Metrics are computed in float32 or better: half and bfloat16 tensors are widened."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _sharded_dim(placement: object) -> int | None:
    """The tensor dim a placement shards (``Shard``, FSDP2's ``_StridedShard``), None for Replicate/Partial."""
    dim = getattr(placement, "dim", None)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


@dataclass(frozen=True)
class _Plan:
    """How one DTensor becomes the tensor this rank reads: gathered along tensor dim ``dim`` over mesh dim
    ``mesh_dim`` (``total`` rows once whole), or ``local`` (nothing to gather), or ``full`` (full_tensor())."""

    kind: str  # "gather", "local" or "full"
    mesh: object = None
    mesh_dim: int = 0
    dim: int = 0
    total: int = 0


def _plan(t: Tensor, keep: int | None) -> _Plan:
    """Every sharded mesh dim but ``keep`` (tensor parallelism's: this rank keeps its block of heads) is gathered.
    One such dim (FSDP2's ``Shard(0)``, HSDP's shard dim beside its replicate dim, FSDP2 beside tensor
    parallelism) is packed into one all-gather per mesh dim; more than one, or a ``Partial``, falls back to
    ``full_tensor()`` (without ``keep``)."""
    mesh, gather, tp_dim = t.device_mesh, [], None
    for mesh_dim, placement in enumerate(t.placements):
        dim = _sharded_dim(placement)
        if mesh_dim == keep:
            tp_dim = None if dim is None else dim % t.dim()
        elif dim is not None:
            gather.append((mesh_dim, dim % t.dim()))
        elif not placement.is_replicate():
            gather.append((mesh_dim, None))  # Partial: no rows to pack
    if not gather:
        return _Plan("local")
    if len(gather) > 1 or gather[0][1] is None:
        if keep is not None:
            raise RuntimeError(f"a {tuple(t.shape)} DTensor with placements {t.placements}: more than one mesh dim "
                               "besides tensor parallelism's shards it; leave this layer out of the Monitor's spec")
        return _Plan("full")
    mesh_dim, dim = gather[0]
    total = t.shape[dim] // (mesh.size(keep) if tp_dim == dim else 1)  # rows of this rank's block
    return _Plan("gather", mesh, mesh_dim, dim, total)


def gather_kind(t: Tensor, keep: int | None = None) -> str:
    """How reading ``t`` (this rank's block of it, with ``keep``) makes it whole: ``plain`` (not a DTensor: read in
    place), ``local`` (its local shard is the block: tensor parallelism alone), ``gather`` (one all-gather over
    one mesh dim: FSDP2, HSDP) or ``full`` (``full_tensor()``)."""
    return _plan(t.detach(), keep).kind if is_dtensor(t) else "plain"


def gathers(tensors: Iterable[Tensor], keep: int | None = None) -> bool:
    """Whether reading any of ``tensors`` issues a collective (FSDP2, HSDP; not tensor parallelism alone)."""
    return any(gather_kind(t, keep) in ("gather", "full") for t in tensors)


def gather_full(tensors: Sequence[Tensor], keep: Sequence[int | None] | None = None) -> list[Tensor]:
    """Whole tensors (or, under tensor parallelism, this rank's whole blocks), in float32 or better, for plain
    tensors and DTensors alike.

    keep: per tensor, the mesh dim of tensor parallelism (None: none), whose shard this rank keeps as it is.
    DTensors sharded on one other mesh dim (FSDP2's ``Shard(0)``, HSDP's shard dim, FSDP2's ``_StridedShard``
    beside tensor parallelism; uneven shards allowed) are gathered in one ``all_gather_into_tensor`` per
    (mesh, mesh dim): each rank packs a header (its coordinate and the rows of each of its shards) and every
    shard, padded to ``ceil(rows / ranks)`` rows, into one flat buffer. Other DTensors (``Partial``, several
    sharded dims) fall back to ``full_tensor()``, one collective each. Every rank of a mesh dim's group must call
    this with the same tensors in the same order.
    """
    keep = list(keep) if keep is not None else [None] * len(tensors)
    out: list[Tensor | None] = [None] * len(tensors)
    by_group: dict[tuple, list[tuple[int, _Plan]]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if not is_dtensor(t):
            out[i] = widened(t)
            continue
        plan = _plan(t, keep[i])
        if plan.kind == "local":
            out[i] = widened(t.to_local())
        elif plan.kind == "full":
            out[i] = widened(t.full_tensor())
        else:
            by_group.setdefault((plan.mesh, plan.mesh_dim), []).append((i, plan))
    for members in by_group.values():
        full = _gather_sharded([tensors[i].detach() for i, _ in members], [plan for _, plan in members])
        for (i, _), f in zip(members, full):
            out[i] = f
    return out  # type: ignore[return-value]


def gather_to(tensors: Sequence[Tensor], dst: int) -> list[Tensor] | None:
    """The whole tensors, in float32 or better, on the rank at coordinate ``dst`` of their mesh dim only (None on
    the others): the packed buffer of :func:`gather_full`, sent with one ``gather`` instead of an all-gather, so only
    ``dst`` receives the shards. Every tensor is a DTensor that :func:`gather_full` packs, all on one (mesh, mesh
    dim); every rank of that dim calls it with the same tensors and the same ``dst``."""
    tensors = [t.detach() for t in tensors]
    plans = [_plan(t, None) for t in tensors]
    if any(p.kind != "gather" or (p.mesh, p.mesh_dim) != (plans[0].mesh, plans[0].mesh_dim) for p in plans):
        raise RuntimeError("gather_to needs DTensors sharded on one mesh dim, all on the same one")
    return _gather_sharded(tensors, plans, dst)


def local_shards(tensors: dict[str, Tensor], keep: int | None = None) -> dict[str, Tensor] | None:
    """Copies of this rank's shards, in float32 or better, when every tensor is a DTensor that :func:`gather_full`
    packs (one mesh dim besides ``keep`` shards it); else None. No collective: what the update-ratio snapshot
    keeps under FSDP2 (1/world of a layer's weights per rank, not the gathered whole; beside tensor parallelism,
    1/(FSDP2 ranks) of this rank's block)."""
    if not tensors or any(gather_kind(t, keep) != "gather" for t in tensors.values()):
        return None
    return {name: widened(t.detach().to_local()).clone() for name, t in tensors.items()}


def gather_like(like: dict[str, Tensor], locals_: dict[str, Tensor], keep: int | None = None,
                dst: int | None = None) -> dict[str, Tensor] | None:
    """The whole tensors (blocks, with ``keep``) whose shards on this rank are ``locals_``, each sharded as the
    DTensor of the same name in ``like`` (from :func:`local_shards`): one all-gather, as :func:`gather_full`; with
    ``dst``, one gather to that coordinate of the mesh dim (:func:`gather_to`: None on the other ranks). Every rank
    calls it."""
    from torch.distributed.tensor import DTensor

    names = list(locals_)
    shards = [DTensor.from_local(locals_[n], like[n].device_mesh, like[n].placements, run_check=False,
                                 shape=like[n].shape, stride=like[n].stride()) for n in names]
    if dst is not None:
        whole = gather_to(shards, dst)
        return None if whole is None else dict(zip(names, whole))
    return dict(zip(names, gather_full(shards, [keep] * len(shards))))


def _gather_sharded(shards: list[Tensor], plans: list[_Plan], dst: int | None = None) -> list[Tensor] | None:
    """One all_gather over the mesh dim of ``plans`` (all the same) for DTensors sharded on it (see
    :func:`gather_full`); with ``dst`` (a coordinate on that dim), one gather to that rank alone, and None on the
    others."""
    mesh, mesh_dim = plans[0].mesh, plans[0].mesh_dim
    size, coord = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    dtype = torch.float32
    for t in shards:
        dtype = torch.promote_types(dtype, t.dtype)
    dims = [p.dim for p in plans]
    locals_ = [t.to_local().movedim(d, 0) for t, d in zip(shards, dims)]  # (rows_local, *rest)
    rests = [math.prod(loc.shape[1:]) for loc in locals_]
    slots = [math.ceil(p.total / size) * r for p, r in zip(plans, rests)]
    header = len(shards) + 1
    buf = torch.zeros(header + sum(slots), dtype=dtype, device=locals_[0].device)
    buf[0] = coord
    offset = header
    for j, (loc, slot) in enumerate(zip(locals_, slots)):
        flat = loc.reshape(-1)
        # A shard larger than its slot (a split rule other than torch.chunk's) is flagged -1 in the
        # header, which every rank sees, so all ranks fail together below instead of deadlocking.
        buf[1 + j] = loc.shape[0] if flat.numel() <= slot else -1
        if flat.numel() <= slot:
            buf[offset : offset + flat.numel()] = flat.to(dtype)
        offset += slot
    group = mesh.get_group(mesh_dim)
    if dst is None:
        gathered = torch.empty(size * buf.numel(), dtype=dtype, device=buf.device)
        all_gather_rows(gathered, buf, group=group)
    else:  # every rank's buffer to dst alone: only dst receives (and holds) the layer
        parts = [torch.empty_like(buf) for _ in range(size)] if coord == dst else None
        dist.gather(buf, parts, dst=dist.get_global_rank(group, dst), group=group)
        if parts is None:
            return None
        gathered = torch.cat(parts)
    rows = gathered.view(size, -1)
    rows = rows[rows[:, 0].long().argsort()]  # mesh coordinate order = shard order
    full, offset = [], header
    for j, (t, loc, plan, rest, slot) in enumerate(zip(shards, locals_, plans, rests, slots)):
        counts = rows[:, 1 + j].long().tolist()
        if min(counts) < 0 or sum(counts) != plan.total:
            raise RuntimeError(f"gathering a {tuple(t.shape)} DTensor sharded on dim {plan.dim}: shard rows {counts} "
                               f"do not add up to {plan.total} (an unexpected split rule); please report it with "
                               "the placement of this parameter, and leave this layer out of the Monitor's spec "
                               "meanwhile")
        moved = (plan.total, *loc.shape[1:])
        pieces = [rows[r, offset : offset + c * rest] for r, c in enumerate(counts)]
        whole = torch.cat(pieces).view(moved).movedim(0, plan.dim).to(torch.promote_types(t.dtype, torch.float32))
        full.append(whole)
        offset += slot
    return full


def all_gather_rows(out: Tensor, buf: Tensor, group: object = None) -> None:
    """Every rank's ``buf`` into ``out`` (``world * buf.numel()`` values, rank order) in one collective:
    ``all_gather_into_tensor``, named ``all_gather_single`` from torch 2.13 on."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, buf, group=group)
