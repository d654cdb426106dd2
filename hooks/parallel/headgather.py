"""The Monitor under tensor parallelism: every rank measures the heads it holds; one gather of their scalars.

Under tensor parallelism a layer's heads live on the ranks of the tensor-parallel mesh dim, a contiguous
block each (:mod:`hooks.parallel.heads`), with their weights, gradients and attention kernel. So on a
sampled step each rank computes, from its own shards and with no weight gather:

* the spectra and gradient norms of its heads; where other mesh dims hold the same block (FSDP2 beside
  tensor parallelism, its ``dp`` ranks; or DDP replicas), the block's heads are shared out among them
  (:func:`hooks.parallel.work.work_of`), so no head is computed twice; beside FSDP2 the gradient norms come
  from each rank's own rows of the block instead (:func:`grad_squares`: per-head sums of squares, added up
  after the gather), so no gradient is gathered;
* the attention statistics of its block, from its own kernel call (every rank computes them for its own
  batch; the logged ones are those of rank 0's batch, as under DDP);

and :class:`HeadGather` packs these per-head scalars (float64) into one buffer per rank and gathers them
with one ``all_gather_into_tensor`` per sampled step, on every rank, which assembles every layer's
arrays in global head order: the tags (``L00/H03``) and the values are those of one process. The
per-layer values derived from per-head ones (``grad_ratio_qk_v``, ``attn_entropy_uniform``) are computed
after the gather. The update ratios are per layer (sigma_1 of a whole matrix): the ranks of a block's
tensor-parallel group share their rows through :func:`tp_reduce` (``diag.math.norms.Sigma1``'s reduce:
W^T W summed over the ranks' rows, never the weights).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from diag.catalog.metrics import METRICS, PER_HEAD_METRICS, family_metrics
from diag.errors import SpecError
from diag.layouts.packings import packing_of
from diag.layouts.vocab import QKVLayout
from diag.math.attention import AttentionStats
from diag.math.metrics import grad_ratio
from diag.math.norms import Reduce
from diag.outputs.records import attention_metrics
from hooks.parallel.gather import all_gather_rows, gather_kind
from hooks.parallel.heads import HeadBlock
from hooks.parallel.work import Work, block_of, replica_of, work_of

__all__ = ["BlockLayer", "tp_reduce", "grad_squares", "HeadGather"]

SPECTRA = family_metrics("spectra")  # per query head; ``spectrum`` ones with head_dim values each
ATTENTION = tuple(m for m in family_metrics("attention") if m in PER_HEAD_METRICS)  # per head of the block


class BlockLayer(Protocol):
    """What the head gather reads of a monitored layer (:class:`hooks.layout.discover.AttentionLayer` has it)."""

    index: int
    name: str
    block: HeadBlock | None

    @property
    def layout(self) -> QKVLayout: ...

    def params(self) -> dict[str, Tensor]: ...


def rows_are_heads(layout: QKVLayout) -> bool:
    """Whether each of Q, K and V is a weight of its own whose dim-0 rows are its heads' rows, one block of rows per
    head (three weights stored untransposed): what :func:`grad_squares` reads."""
    packing = packing_of(layout)
    return not layout.transposed and all(len(roles) == 1 for roles in packing.roles(layout).values())


def grad_squares(layer: BlockLayer) -> dict[str, Tensor] | None:
    """Per-head sums of squares (float64) of this rank's own rows of the block's Q/K/V gradients (its FSDP2 shard of
    them): ``grad_sq_q`` (H / t,), ``grad_sq_k``, ``grad_sq_v`` (G / t,); their sums over the FSDP2 ranks of the
    block are the squared gradient norms. None when a Q/K/V parameter has no ``.grad``. For layouts whose rows are
    heads (:func:`rows_are_heads`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lay, block = layer.layout, layer.block
    out = {}
    for role, name, heads in (("q", lay.q, block.layout.n_heads), ("k", lay.k, block.layout.kv_heads),
                              ("v", lay.v, block.layout.kv_heads)):
        p = layer.params()[name]
        if p.grad is None:
            return None
        grad = p.grad.detach()
        local = grad.to_local()
        _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
        rows = grad.shape[0] // block.size  # of the block, along the heads' dim
        first = offset[0] - block.index * rows  # this rank's first row within the block
        squares = local.reshape(local.shape[0], -1).double().square().sum(1)  # (local rows,)
        head = torch.div(torch.arange(first, first + local.shape[0], device=local.device), rows // heads,
                         rounding_mode="floor")
        out[f"grad_sq_{role}"] = torch.zeros(heads, dtype=torch.float64, device=local.device).index_add_(
            0, head, squares)
    return out


def tp_reduce(block: HeadBlock) -> Reduce:
    """The sum over the ranks of ``block``'s tensor-parallel group (an all-reduce): what the update ratios need
    to take sigma_1 and ||.||_F of matrices whose rows (heads) those ranks share."""
    group = block.mesh.get_group(block.dim)

    def reduce(t: Tensor) -> Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=group)
        return t

    return reduce


class HeadGather:
    """Per-head scalars of the heads each rank computed, assembled into whole layers on every rank.

    layers: the Monitor's layers; those with a :class:`HeadBlock` are gathered. One
    ``all_gather_into_tensor`` on the default group per call (every rank calls it at every sampled step that
    samples gradients, spectra or attention)."""

    def __init__(self, layers: Sequence[BlockLayer]) -> None:
        self.layers = [layer for layer in layers if layer.block is not None]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        for layer in self.layers:
            if layer.block.mesh.size() != self.world:
                raise SpecError(f"{layer.name}: its parameters' device mesh {tuple(layer.block.mesh.shape)} spans "
                                f"{layer.block.mesh.size()} of the {self.world} ranks; the Monitor gathers per-head "
                                "values over every rank, so it needs a mesh that spans the job (pipeline "
                                "parallelism is not supported); leave this layer out of the Monitor's spec")
        self.blocks = {layer.index: [block_of(layer.block, s) for s in range(self.world)] for layer in self.layers}
        self.replicas = {layer.index: [replica_of(layer.block, s) for s in range(self.world)] for layer in self.layers}
        # beside FSDP2: gradient norms from each rank's own rows (grad_squares), no gradient gathered
        self.from_rows = {layer.index: rows_are_heads(layer.layout) and any(
            gather_kind(p, layer.block.dim) == "gather" for p in layer.params().values()) for layer in self.layers}
        self._schema: dict[tuple, list[tuple[str, int]]] = {}  # (layer, rank, family) -> what it sends

    def work(self, layer: BlockLayer, rank: int | None = None) -> Work:
        """The heads ``rank`` (default: this one) computes of its block of ``layer``."""
        rank = self.rank if rank is None else rank
        count = layer.block.mesh.size() // layer.block.size
        return work_of(layer.block.layout, self.replicas[layer.index][rank], count)

    def gather(self, values: Mapping[int, dict[str, Tensor]], attention: Mapping[int, AttentionStats],
               refused: set[int], due: frozenset[str], spectra_failed: bool) -> tuple[dict[int, dict], set[int], bool]:
        """Whole layers' metrics from every rank's work: ({layer index: metrics in one process's order}, the layers
        some rank refused, whether some rank's spectra failed). ``values``: this rank's weight-side metrics of its
        work (:meth:`work`); ``attention``: its kernel's statistics of its block."""
        families = [f for f in ("grads", "spectra", "attention") if f in due]
        own = self._pack(values, attention, refused, families, spectra_failed)
        sizes = [self._size(s, families) for s in range(self.world)]
        width = max(sizes)
        buf = torch.full((width,), math.nan, dtype=torch.float64, device=own.device)
        buf[: own.numel()] = own
        rows = torch.empty(self.world * width, dtype=torch.float64, device=own.device)
        all_gather_rows(rows, buf)
        rows = rows.view(self.world, width)
        failed = bool((rows[:, 0] > 0).any())
        parsed = [self._unpack(rows[s], s, families) for s in range(self.world)]
        out, refused_any = {}, set()
        for layer in self.layers:
            pieces = [p[layer.index] for p in parsed]
            if any(piece["refused"] for piece in pieces):
                refused_any.add(layer.index)
                out[layer.index] = {}
                continue
            out[layer.index] = self._assemble(layer, pieces, families)
        return out, refused_any, failed

    # ------------------------------------------------------------------ the buffer

    def _fields(self, layer: BlockLayer, rank: int, family: str) -> list[tuple[str, int]]:
        """(name, numel) of what ``rank`` sends for ``family`` of ``layer`` (fixed for a run: computed once)."""
        key = (layer.index, rank, family)
        if key not in self._schema:
            self._schema[key] = self._fields_of(layer, rank, family)
        return self._schema[key]

    def _fields_of(self, layer: BlockLayer, rank: int, family: str) -> list[tuple[str, int]]:
        work, lay = self.work(layer, rank), layer.block.layout
        if family == "grads" and self.from_rows[layer.index]:
            return [("grad_sq_q", lay.n_heads), ("grad_sq_k", lay.kv_heads), ("grad_sq_v", lay.kv_heads)]
        if family == "grads":
            return [("grad_norm_q", len(work.q)), ("grad_norm_k", len(work.kv)), ("grad_norm_v", len(work.kv))]
        if family == "spectra":
            return [(m, len(work.q) * _width(m, lay)) for m in SPECTRA]
        h = lay.n_heads
        return [(m, h) for m in ATTENTION] + [("uniform_entropy", h), ("attn_rows", 1)]

    def _size(self, rank: int, families: list[str]) -> int:
        total = 1  # header: spectra failed
        for layer in self.layers:
            total += 1 + sum(1 + sum(n for _, n in self._fields(layer, rank, f)) for f in families)
        return total

    def _pack(self, values: Mapping[int, dict[str, Tensor]], attention: Mapping[int, AttentionStats],
              refused: set[int], families: list[str], spectra_failed: bool) -> Tensor:
        device = next(iter(self.layers[0].params().values())).device
        parts = [torch.tensor([float(spectra_failed)], dtype=torch.float64, device=device)]
        for layer in self.layers:
            mine = dict(values.get(layer.index, {}))
            stats = attention.get(layer.index)
            if stats is not None:
                mine.update(attention_metrics(stats), uniform_entropy=stats.uniform_entropy)
            parts.append(torch.tensor([float(layer.index in refused)], dtype=torch.float64, device=device))
            for family in families:
                fields = self._fields(layer, self.rank, family)
                present = all(name in mine and mine[name].numel() == n for name, n in fields)
                parts.append(torch.tensor([float(present)], dtype=torch.float64, device=device))
                for name, n in fields:
                    parts.append(mine[name].reshape(-1).to(device, torch.float64) if present
                                 else torch.full((n,), math.nan, dtype=torch.float64, device=device))
        return torch.cat(parts)

    def _unpack(self, row: Tensor, rank: int, families: list[str]) -> dict[int, dict]:
        out, offset = {}, 1
        for layer in self.layers:
            piece: dict = {"refused": bool(row[offset] > 0)}
            offset += 1
            for family in families:
                piece[family] = bool(row[offset] > 0)
                offset += 1
                for name, n in self._fields(layer, rank, family):
                    piece[name] = row[offset : offset + n]
                    offset += n
            piece["rank"] = rank
            out[layer.index] = piece
        return out

    # ------------------------------------------------------------------ whole layers

    def _assemble(self, layer: BlockLayer, pieces: list[dict], families: list[str]) -> dict[str, Tensor]:
        """One process's metrics of ``layer`` from every rank's piece, in global head order."""
        lay, block = layer.layout, layer.block
        hl, gl = block.layout.n_heads, block.layout.kv_heads
        out: dict[str, Tensor] = {}
        if "grads" in families and all(p["grads"] for p in pieces) and self.from_rows[layer.index]:
            norms = {f"grad_norm_{r}": self._summed(layer, pieces, f"grad_sq_{r}").sqrt() for r in "qkv"}
            out.update(norms)
            out["grad_ratio_qk_v"] = grad_ratio(norms["grad_norm_q"], norms["grad_norm_k"], norms["grad_norm_v"])
        elif "grads" in families and all(p["grads"] for p in pieces):
            q = self._heads(layer, pieces, lay.n_heads, hl, "q")
            kv = self._heads(layer, pieces, lay.kv_heads, gl, "kv")
            norms = {"grad_norm_q": q("grad_norm_q"), "grad_norm_k": kv("grad_norm_k"),
                     "grad_norm_v": kv("grad_norm_v")}
            out.update(norms)
            out["grad_ratio_qk_v"] = grad_ratio(norms["grad_norm_q"], norms["grad_norm_k"], norms["grad_norm_v"])
        if "spectra" in families and all(p["spectra"] for p in pieces):
            q = self._heads(layer, pieces, lay.n_heads, hl, "q")
            out.update({m: q(m, _width(m, lay)) for m in SPECTRA})
        writer = self.replicas[layer.index][0]  # the attention of rank 0's batch: its replica's blocks
        mine = [p for p in pieces if self.replicas[layer.index][p["rank"]] == writer]
        if "attention" in families and all(p["attention"] for p in mine):
            ordered = sorted(mine, key=lambda p: self.blocks[layer.index][p["rank"]])
            for m in ATTENTION:
                out[m] = torch.cat([p[m] for p in ordered])
            out["attn_rows"] = ordered[0]["attn_rows"]
            out["attn_entropy_uniform"] = torch.cat([p["uniform_entropy"] for p in ordered]).mean().reshape(1)
        return out

    def _summed(self, layer: BlockLayer, pieces: list[dict], metric: str) -> Tensor:
        """Every block's per-head values summed over the ranks holding it, blocks in order."""
        blocks = self.blocks[layer.index]
        return torch.cat([sum(p[metric] for p in pieces if blocks[p["rank"]] == j) for j in range(layer.block.size)])

    def _heads(self, layer: BlockLayer, pieces: list[dict], total: int, per_block: int, kind: str):
        """A function metric -> its (total, ...) tensor in global head order, from every rank's work ``kind``."""
        def assemble(metric: str, width: int = 1) -> Tensor:
            out = torch.full((total * width,), math.nan, dtype=torch.float64, device=pieces[0][metric].device)
            for p in pieces:
                work = self.work(layer, p["rank"])
                heads = work.q if kind == "q" else work.kv
                first = self.blocks[layer.index][p["rank"]] * per_block + heads.start
                out[first * width : (first + len(heads)) * width] = p[metric]
            return out if width == 1 else out.view(total, width)

        return assemble


def _width(metric: str, layout: QKVLayout) -> int:
    """Values per head of a spectral metric: ``head_dim`` singular values for a spectrum, else one."""
    return layout.head_dim if METRICS[metric].per == "spectrum" else 1
