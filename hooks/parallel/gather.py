"""Whole tensors from sharded ones: the Q/K/V weights (and gradients) of the monitored layers, and W_O, in float32
or better.

FSDP2 parameters are DTensors sharded on one dim: they are read one layer at a time, the local shards of that
layer's weights (and of its Q/K/V gradients when the step samples them) packed into one flat buffer and one
``all_gather_into_tensor``, so at most one layer's gathered weights exist at a time.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hooks.layout.discover import AttentionLayer

__all__ = ["gather_full", "local_shards", "gather_like", "gathers_rows"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

def _dtensor_type() -> type | None:
    """DTensor, if anything imported it (otherwise no tensor can be one): never imported just to check."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _float(t: Tensor) -> Tensor:
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
    dtensor = _dtensor_type()
    keep = list(keep) if keep is not None else [None] * len(tensors)
    out: list[Tensor | None] = [None] * len(tensors)
    by_group: dict[tuple, list[tuple[int, _Plan]]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if dtensor is None or not isinstance(t, dtensor):
            out[i] = _float(t)
            continue
        plan = _plan(t, keep[i])
        if plan.kind == "local":
            out[i] = _float(t.to_local())
        elif plan.kind == "full":
            out[i] = _float(t.full_tensor())
        else:
            by_group.setdefault((plan.mesh, plan.mesh_dim), []).append((i, plan))
    for members in by_group.values():
        full = _gather_sharded([tensors[i].detach() for i, _ in members], [plan for _, plan in members])
        for (i, _), f in zip(members, full):
            out[i] = f
    return out  # type: ignore[return-value]


def local_shards(tensors: dict[str, Tensor], keep: int | None = None) -> dict[str, Tensor] | None:
    """Copies of this rank's shards, in float32 or better, when every tensor is a DTensor that :func:`gather_full`
    packs (one mesh dim besides ``keep`` shards it); else None. No collective: what the update-ratio snapshot
    keeps under FSDP2 (1/world of a layer's weights per rank, not the gathered whole; beside tensor parallelism,
    1/(FSDP2 ranks) of this rank's block)."""
    dtensor = _dtensor_type()
    if dtensor is None or not tensors or not all(isinstance(t, dtensor) for t in tensors.values()):
        return None
    if any(_plan(t, keep).kind != "gather" for t in tensors.values()):
        return None
    return {name: _float(t.detach().to_local()).clone() for name, t in tensors.items()}


def gather_like(like: dict[str, Tensor], locals_: dict[str, Tensor], keep: int | None = None) -> dict[str, Tensor]:
    """The whole tensors (blocks, with ``keep``) whose shards on this rank are ``locals_``, each sharded as the
    DTensor of the same name in ``like`` (from :func:`local_shards`): one all-gather, as :func:`gather_full`.
    Every rank calls it."""
    from torch.distributed.tensor import DTensor

    names = list(locals_)
    shards = [DTensor.from_local(locals_[n], like[n].device_mesh, like[n].placements, run_check=False,
                                 shape=like[n].shape, stride=like[n].stride()) for n in names]
    return dict(zip(names, gather_full(shards, [keep] * len(shards))))


def _gather_sharded(shards: list[Tensor], plans: list[_Plan]) -> list[Tensor]:
    """One all_gather over the mesh dim of ``plans`` (all the same) for DTensors sharded on it (see
    :func:`gather_full`)."""
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
    gathered = torch.empty(size * buf.numel(), dtype=dtype, device=buf.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    all_gather(gathered, buf, group=mesh.get_group(mesh_dim))
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


def _keep(layer: AttentionLayer) -> int | None:
    """Under tensor parallelism, the mesh dim whose shard of the layer (its block of heads) this rank keeps."""
    return None if layer.block is None else layer.block.dim


def gathers_rows(layer: AttentionLayer) -> bool:
    """Whether reading the layer's Q/K/V weights gathers them over a mesh dim (FSDP2, HSDP; beside tensor
    parallelism, FSDP2's rows of this rank's block)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) and _plan(p.detach(), _keep(layer)).kind == "gather"
                                       for p in layer.params().values())
