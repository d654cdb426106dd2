"""Which heads of a layer this rank holds: tensor parallelism splits them into contiguous blocks.

With ``parallelize_module`` and ``ColwiseParallel`` on the Q/K/V projections, ``RowwiseParallel`` on W_O
(the plan of torchtitan and Megatron), rank ``i`` of the ``t`` ranks of the tensor-parallel mesh dim holds
rows ``[i R / t, (i + 1) R / t)`` of every Q/K/V weight, so query heads ``[i H / t, (i + 1) H / t)`` and
key/value heads ``[i G / t, (i + 1) G / t)`` (H, G: the layout's head counts), and the matching columns
of W_O; its attention kernel computes those heads only. :func:`head_block` reads this from the
parameters' DTensor placements at discovery, and gives the layout of the rank's block (H / t query heads,
G / t key/value heads, the same names and packing) that its kernel, its local shards and its gradients
follow.

FSDP2 shards the same parameters on other mesh dims: its own dims come first in the mesh (HSDP: a
replicate dim, then the shard dim), so under an ``FSDPModule`` the leading ``Replicate`` placements and
the first ``Shard`` are FSDP2's and any later ``Shard`` of the heads' dim is tensor parallelism's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from diag.errors import SpecError
from diag.layouts.packings import packing_of
from diag.layouts.vocab import QKVLayout
from hooks.parallel.dtensors import is_dtensor

__all__ = ["HeadBlock", "head_block"]


@dataclass(frozen=True)
class HeadBlock:
    """The heads of one attention layer that this rank holds under tensor parallelism.

    mesh, dim: the parameters' device mesh and its tensor-parallel dim; index: this rank's coordinate on
    it, of ``size``; layout: the layer's layout as this rank's shards hold it (``n_heads / size`` query
    heads, ``n_kv_heads / size`` key/value heads, the same names, packing and pairing)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    dim: int
    index: int
    size: int
    layout: QKVLayout

    @property
    def first_head(self) -> int:
        """The global number of this rank's first query head."""
        return self.index * self.layout.n_heads


def _tp_dims(t: Tensor, tensor_dim: int, under_fsdp: bool) -> list[int]:
    """Mesh dims on which tensor parallelism shards ``tensor_dim`` of the DTensor ``t`` (FSDP2's dims skipped)."""
    from torch.distributed.tensor import Replicate, Shard

    dims, fsdp_dims = [], under_fsdp
    for mesh_dim, placement in enumerate(t.placements):
        if fsdp_dims:  # FSDP2's dims lead: HSDP's replicate dim(s), then its shard dim
            fsdp_dims = isinstance(placement, Replicate)
            continue
        if isinstance(placement, Shard) and placement.dim % t.dim() == tensor_dim:
            dims.append(mesh_dim)
    return dims


def _heads_dim(layout: QKVLayout, name: str) -> int:
    """The dim of a weight along which its heads are stacked (Q/K/V: as its packing says; W_O: its columns)."""
    if name == layout.o and name not in layout.param_names:
        return 0 if layout.o_is_transposed else 1
    return packing_of(layout).heads_dim(layout)


def head_block(name: str, layout: QKVLayout, weights: dict[str, Tensor], under_fsdp: bool) -> HeadBlock | None:
    """The block of heads this rank holds, None when tensor parallelism does not split the layer's heads.

    weights: the layout's Q/K/V (and W_O) parameters by name. Raises :class:`SpecError` for a split that is not
    whole heads on every rank (a fused [Q | K | V] weight, head counts the ranks do not divide, key/value heads
    replicated while the query heads are split, W_O not split with them)."""
    qkv = list(layout.param_names)
    split = {n: _tp_dims(weights[n], _heads_dim(layout, n), under_fsdp) if is_dtensor(weights[n]) else []
             for n in layout.weight_names}
    if not any(split[n] for n in qkv):
        return None
    mesh = weights[qkv[0]].device_mesh
    if any(len(split[n]) != 1 for n in qkv) or len({split[n][0] for n in qkv}) != 1 or any(
            weights[n].device_mesh != mesh for n in qkv):
        raise SpecError(f"{name}: tensor parallelism splits its heads unevenly: mesh dims sharding the heads of "
                        f"{ {n: split[n] for n in qkv} }; every Q/K/V weight must be split on the same one mesh dim "
                        "(ColwiseParallel on each of them), key/value heads included; leave this layer out of the "
                        "Monitor's spec or parallelize its projections alike")
    first = weights[qkv[0]]
    dim = split[qkv[0]][0]
    size = first.device_mesh.size(dim)
    if layout.o is not None and split.get(layout.o) != [dim]:
        raise SpecError(f"{name}: its Q/K/V heads are split across {size} tensor-parallel ranks but its output "
                        f"projection {layout.o!r} is not split by heads on the same mesh dim; use RowwiseParallel on "
                        "it (torchtitan's plan), or leave this layer out of the Monitor's spec")
    index = first.device_mesh.get_local_rank(dim)
    return HeadBlock(first.device_mesh, dim, index, size, _local_layout(name, layout, size, index))


def _local_layout(name: str, layout: QKVLayout, size: int, index: int) -> QKVLayout:
    """The layout of one rank's block: the same weights, n_heads / size and n_kv_heads / size heads."""
    h, g = layout.n_heads, layout.kv_heads
    problem = None
    if not packing_of(layout).row_blocks_are_heads:
        problem = (f"packing={layout.packing!r} keeps all query heads before the key and value heads, so a "
                   "contiguous block of rows is not a block of whole heads")
    elif h % size or g % size:
        problem = f"{h} query and {g} key/value heads do not split evenly across {size} ranks"
    elif layout.groups is not None and layout.groups % size:
        problem = f"its {layout.groups} row groups do not split evenly across {size} ranks"
    kv_map = None
    if problem is None and not layout.default_pairing:
        hl, gl = h // size, g // size
        blocks = [[layout.kv_index[i * hl + j] - i * gl for j in range(hl)] for i in range(size)]
        if any(not 0 <= kv < gl for block in blocks for kv in block):
            problem = f"kv_map={layout.kv_map} pairs query heads with key/value heads of other ranks"
        else:
            kv_map = tuple(blocks[index])
    if problem is not None:
        raise SpecError(f"{name}: tensor parallelism over {size} ranks does not give each rank whole heads: "
                        f"{problem}; its layout is {layout.describe()}. Shard the projections by whole heads "
                        "(separate q/k/v projections with ColwiseParallel), or leave this layer out of the Monitor's "
                        "spec")
    values = {**layout.to_dict(), "n_heads": h // size, "kv_map": None if kv_map is None else list(kv_map)}
    if layout.n_kv_heads is not None:
        values["n_kv_heads"] = g // size
    if layout.groups is not None:
        values["groups"] = layout.groups // size
    return QKVLayout.from_dict(values)
