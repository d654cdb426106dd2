"""Matrices whose rows or columns are split across ranks, as the step limit sees them.

Tensor parallelism's ``ColwiseParallel`` splits a Linear weight's rows (its output features, so an
attention layer's heads) across the tensor-parallel ranks, ``RowwiseParallel`` its columns; FSDP2 splits
rows across its ranks (HSDP: across its shard dim; the replicate dim holds copies). A rank's part of a
matrix W is then a block ``W[rows_r, cols_r]``. sigma_1 of W needs the sums over the ranks that share its
rows (in ``W^T u``) and over those that share its columns (in ``W v``): :class:`Split` holds the two
process groups and this rank's columns, :func:`split_of` reads them from a parameter's placements, and
:func:`split_largest_row` is :func:`diag.math.norms.largest_row` across them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from diag.errors import ConfigError
from diag.math.norms import Reduce, largest_row
from hooks.parallel.dtensors import is_dtensor

__all__ = ["Split", "split_of", "split_largest_row"]


def _sum(group: object) -> Reduce:
    def reduce(t: Tensor) -> Tensor:  # sums in place where t is contiguous (callers pass fresh tensors)
        t = t.contiguous()
        dist.all_reduce(t, group=group)
        return t

    return reduce


@dataclass(frozen=True)
class Split:
    """Where a rank's block of a matrix lies: ``rows`` / ``cols`` the process groups sharing its rows / columns
    (None: not split that way), its columns ``first_col`` .. ``first_col + n_cols`` of the whole."""

    rows: object | None
    cols: object | None
    first_col: int
    n_cols: int

    @property
    def sum_rows(self) -> Reduce | None:
        return None if self.rows is None else _sum(self.rows)

    @property
    def sum_cols(self) -> Reduce | None:
        return None if self.cols is None else _sum(self.cols)

    @property
    def key(self) -> tuple:
        """Matrices are batched only with others split over the same groups."""
        return id(self.rows), id(self.cols)


def _group(name: str, mesh, dims: list[int]) -> object | None:
    """The process group of the ranks along mesh ``dims``: one dim's, or every rank's when ``dims`` are all of a
    mesh that spans the job (FSDP2 and tensor parallelism both splitting rows)."""
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise ConfigError(f"SpectralStepLimit: {name!r} is split on mesh dims {dims} of a {tuple(mesh.shape)} mesh in one "
                      "direction; only one mesh dim, or all of a mesh spanning the job, can be summed over; exclude it "
                      f"(exclude=[{name!r}])")


def split_of(name: str, param: Tensor) -> Split | None:
    """How ``param`` (a 2-D weight: rows = dim 0) is split across ranks, None when this rank holds it whole (a plain
    tensor, or a replicated DTensor). Raises :class:`ConfigError` for what the step limit cannot sum over."""
    if not is_dtensor(param):
        return None
    rows, cols = [], []
    for mesh_dim, placement in enumerate(param.placements):
        dim = getattr(placement, "dim", None)  # Shard, FSDP2's _StridedShard
        if dim is None:
            if not placement.is_replicate():
                raise ConfigError(f"SpectralStepLimit: {name!r} has placement {placement} on mesh dim {mesh_dim}; "
                                  f"only Shard and Replicate are supported; exclude it (exclude=[{name!r}])")
            continue
        if param.dim() != 2:
            raise ConfigError(f"SpectralStepLimit: {name!r} ({tuple(param.shape)}) is split across ranks; only 2-D "
                              f"weights can be bounded split; exclude it (exclude=[{name!r}])")
        (rows if dim % 2 == 0 else cols).append(mesh_dim)
    if not rows and not cols:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    mesh = param.device_mesh
    return Split(_group(name, mesh, rows), _group(name, mesh, cols), offset[1], shape[1])


def split_largest_row(a: Tensor, fallback: Tensor, split: Split | None) -> Tensor:
    """:func:`diag.math.norms.largest_row` of matrices split as ``split`` says: the unit largest row of each whole
    (B, m, n) matrix, this rank's columns of it (B, n_c); ``a``: this rank's blocks (B, m_r, n_c). Ties go to the
    lowest rank of the rows' group, as one process takes the first."""
    if split is None:
        return largest_row(a, fallback)
    norms2 = a.square().sum(2)  # (B, m_r)
    if split.cols is not None:
        dist.all_reduce(norms2, group=split.cols)
    batch = torch.arange(a.shape[0], device=a.device)
    if a.shape[1]:
        top = norms2.max(dim=1)
        best, index = top.values, top.indices
    else:  # no rows here (uneven FSDP2 shards)
        best = torch.full((a.shape[0],), -1.0, dtype=a.dtype, device=a.device)
        index = torch.zeros(a.shape[0], dtype=torch.long, device=a.device)
    row = a[batch, index] if a.shape[1] else torch.zeros_like(fallback)  # (B, n_c)
    if split.rows is not None:
        whole = best.clone()
        dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=split.rows)
        me = float(dist.get_rank(split.rows))
        owner = torch.where(best == whole, me, float("inf")).to(a.dtype)
        dist.all_reduce(owner, op=dist.ReduceOp.MIN, group=split.rows)
        row = torch.where((owner == me)[:, None], row, 0)
        dist.all_reduce(row, group=split.rows)
        best = whole
    norm = best.clamp_min(0).sqrt()
    return torch.where(norm[:, None] > 0, row / norm.clamp_min(1e-30)[:, None], fallback)
