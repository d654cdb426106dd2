"""Which heads of its block a tensor-parallel rank computes: where other mesh dims hold the same block (FSDP2
beside tensor parallelism, or DDP replicas), the block's heads are shared out among them, so no head is computed
twice."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from diag.layouts.vocab import QKVLayout
from hooks.parallel.heads import HeadBlock

__all__ = ["Work", "work_of", "replica_of", "block_of"]


@dataclass(frozen=True)
class Work:
    """The heads of a rank's block that it computes: query heads ``q`` (spectra, grad norms of Q) and key/value
    heads ``kv`` (grad norms of K and V), local numbers within the block."""

    q: range
    kv: range

    def pair(self, wq: Tensor, wk: Tensor, layout: QKVLayout) -> tuple[Tensor, Tensor]:
        """(wq, wk) of the work's query heads for the spectra: K as its key heads (paired per query head where the
        work does not hold whole groups). wq (H_l, D, E); wk as ``split_qkv(paired=True)`` gives it."""
        q = wq[self.q.start:self.q.stop]
        if wk.shape[0] == wq.shape[0]:  # already one key head per query head (a kv_map)
            return q, wk[self.q.start:self.q.stop]
        r = layout.n_heads // layout.kv_heads
        if self.q.start % r == 0 and self.q.stop % r == 0:  # whole groups: their key heads, unrepeated
            return q, wk[self.q.start // r:self.q.stop // r]
        return q, wk[[h // r for h in self.q]]


def _chunk(n: int, parts: int, i: int) -> range:
    """torch.chunk's i-th part of range(n): ceil(n / parts) each, the last ones shorter or empty."""
    size = math.ceil(n / parts) if n else 0
    return range(min(i * size, n), min((i + 1) * size, n))


def work_of(layout: QKVLayout, replica: int, replicas: int) -> Work:
    """The heads of a block (``layout``: the block's) that replica ``replica`` of ``replicas`` computes: whole
    key/value groups where there are enough of them to go round, else a share of the query heads."""
    h, g = layout.n_heads, layout.kv_heads
    kv = _chunk(g, replicas, replica)
    if g >= replicas and layout.default_pairing:
        r = h // g
        return Work(range(kv.start * r, kv.stop * r), kv)
    return Work(_chunk(h, replicas, replica), kv)


def replica_of(block: HeadBlock, rank: int) -> int:
    """Which of the ranks holding the same block (the same coordinate on the tensor-parallel dim) ``rank`` is:
    its coordinates on the mesh's other dims, row-major."""
    grid = block.mesh.mesh  # (d0, d1, ...) global ranks
    coords = (grid == rank).nonzero()[0].tolist()
    others = [(c, grid.shape[d]) for d, c in enumerate(coords) if d != block.dim]
    index = 0
    for c, size in others:
        index = index * size + c
    return index


def block_of(block: HeadBlock, rank: int) -> int:
    """``rank``'s coordinate on the tensor-parallel dim of ``block``'s mesh."""
    return int((block.mesh.mesh == rank).nonzero()[0][block.dim])
