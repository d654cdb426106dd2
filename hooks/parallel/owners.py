"""FSDP2 alone (a 1-D mesh over every rank): each layer's weight-side metrics computed by one owner rank, and one
all-reduce of per-head and per-layer scalars.

Under ``fully_shard`` without tensor parallelism each rank holds a 1/world shard of every layer's Q/K/V/O weights
and gradients. The Monitor gathers nothing for the gradient norms: each rank sums the squares of its own shard of
the Q/K/V gradients per head (:class:`ShardSquares`; a head's elements may straddle two ranks' shards, so each
element is assigned by its global index, whatever the packing: rows of heads, GPT-2's transposed Conv1D whose heads
are blocks of columns, per-head 3-D weights), and those partial sums are added up by the all-reduce. The spectra and
the update ratios of layer ``i`` are computed by one rank, its owner ``i % world`` (:func:`owner_of`), from that
layer's shards gathered to it alone (:func:`hooks.parallel.gather.gather_to`), so the bytes each rank receives and
the spectra each rank computes fall as 1/world. :class:`ScalarSum` then gives every rank every layer's values in one
``all_reduce`` (float64, sum): every rank adds its partial sums of squares and, for the layers it owns, their
spectra or update ratios (zeros elsewhere), so every rank logs and judges one process's numbers.

The attention statistics are shared out the same way (:func:`share_attention`): on an attention sample each rank
captures only the layers it owns (those whose layout is settled; the capture's ``only``), from its own batch, and one
float64 all-reduce gives every rank every layer's per-head values as its owner measured them, so layer ``i``'s
attention is that of rank ``i % world``'s first sequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from diag.layouts.packings import packing_of
from diag.layouts.vocab import QKVLayout, split_qkv
from diag.math.attention import AttentionStats
from hooks.parallel.dtensors import is_dtensor
from hooks.parallel.gather import gather_kind

__all__ = ["OwnedLayer", "fsdp_alone", "owner_of", "owned_layers", "share_attention", "ShardSquares", "ScalarSum"]


class OwnedLayer(Protocol):
    """What the owner path reads of a monitored layer (:class:`hooks.layout.discover.AttentionLayer` has it)."""

    index: int
    block: object

    @property
    def layout(self) -> QKVLayout: ...

    def params(self) -> dict[str, Tensor]: ...

    def weights(self) -> dict[str, Tensor]: ...


def fsdp_alone(layer: OwnedLayer) -> bool:
    """Whether every weight of ``layer`` (Q/K/V and W_O) is a DTensor ``Shard``-ed on a 1-D mesh that spans the job
    (FSDP2's ``fully_shard`` without tensor parallelism); HSDP's 2-D mesh, tensor parallelism and plain parameters
    are not."""
    if layer.block is not None or not (dist.is_available() and dist.is_initialized()):
        return False
    for t in layer.weights().values():
        if not is_dtensor(t):
            return False
        t = t.detach()
        mesh = t.device_mesh
        if (mesh.ndim != 1 or mesh.size() != dist.get_world_size() or type(t.placements[0]).__name__ != "Shard"
                or gather_kind(t) != "gather"):
            return False
    return True


def owner_of(position: int, layer: OwnedLayer) -> int:
    """The mesh coordinate of the rank that computes the spectra and update ratios of the layer at ``position``
    among the Monitor's layers: round-robin, ``position % world``."""
    return position % next(iter(layer.weights().values())).device_mesh.size()


def _segments(layout: QKVLayout, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, Tensor]]:
    """For each Q/K/V parameter: the dim along which its heads are stacked (:meth:`Packing.heads_dim`) and, per
    index along that dim, the segment it belongs to: query head h -> h, key head g -> H + g, value head g ->
    H + G + g (H + 2G: none). Found by splitting probe tensors (the index along that dim, size 1 elsewhere) with
    :func:`split_qkv`, so every packing is read as the rest of the Monitor reads it."""
    hd, h, g = packing_of(layout).heads_dim(layout), layout.n_heads, layout.kv_heads
    out = {}
    for name in layout.param_names:
        probes = {}
        for other in layout.param_names:
            shape = [n if i == hd else 1 for i, n in enumerate(shapes[other])]
            probes[other] = (torch.arange(shapes[other][hd], dtype=torch.float64).reshape(shape) if other == name
                             else torch.full(shape, -1.0, dtype=torch.float64))
        seg = torch.full((shapes[name][hd],), h + 2 * g, dtype=torch.long)
        for base, part in zip((0, h, h + g), split_qkv(probes, layout)):
            for head in range(part.shape[0]):
                idx = part[head].reshape(-1)
                seg[idx[idx >= 0].long()] = base + head
        out[name] = (hd, seg)
    return out


class ShardSquares:
    """Per-head sums of squares of this rank's shards of a layer's Q/K/V gradients (float64): ``grad_sq_q`` (H,),
    ``grad_sq_k``, ``grad_sq_v`` (G,), whose sums over the ranks are the squared per-head gradient norms. No
    collective: each element of a shard is assigned to its head by its global index along the heads' dim (the
    shard's offset, ``compute_local_shape_and_global_offset``)."""

    def __init__(self) -> None:
        self._segments: dict[int, dict[str, tuple[int, Tensor]]] = {}  # layer index -> per parameter

    def __call__(self, layer: OwnedLayer) -> dict[str, Tensor] | None:
        """The sums of ``layer``, or None when a Q/K/V parameter has no ``.grad``."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        params, lay = layer.params(), layer.layout
        if any(p.grad is None for p in params.values()):
            return None
        segments = self._segments.get(layer.index)
        if segments is None:  # computed once per layer, kept on the gradients' device
            device = next(iter(params.values())).grad.device
            segments = {n: (hd, seg.to(device)) for n, (hd, seg) in
                        _segments(lay, {n: tuple(p.shape) for n, p in params.items()}).items()}
            self._segments[layer.index] = segments
        h, g = lay.n_heads, lay.kv_heads
        total = 0
        for name, p in params.items():
            grad = p.grad.detach()
            _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
            total = total + _head_squares(grad.to_local(), *segments[name], offset, h + 2 * g + 1)
        return {"grad_sq_q": total[:h], "grad_sq_k": total[h : h + g], "grad_sq_v": total[h + g : h + 2 * g]}


def _head_squares(local: Tensor, hd: int, seg: Tensor, offset: Sequence[int], segments: int) -> Tensor:
    """Sums of squares (float64) per segment of one shard ``local`` whose first element sits at global index
    ``offset``: each index along the heads' dim ``hd`` goes to its segment ``seg[offset[hd] + i]``."""
    others = [i for i in range(local.dim()) if i != hd]
    per = torch.linalg.vector_norm(local, dim=others, dtype=torch.float64).square()  # (local.shape[hd],)
    ids = seg[offset[hd] : offset[hd] + local.shape[hd]]
    return torch.zeros(segments, dtype=torch.float64, device=local.device).index_add_(0, ids, per)


class ScalarSum:
    """Named float64 values of many layers, summed over every rank in one ``all_reduce``.

    Every rank declares the same fields in the same order (:meth:`field`: layer index, name, shape) and adds what it
    holds (:meth:`add`: a rank's partial sums, or an owner's values); fields a rank leaves alone count zero. After
    :meth:`reduce`, :meth:`get` gives each field's sum, the same on every rank."""

    def __init__(self) -> None:
        self._fields: dict[tuple[int, str], tuple[int, tuple[int, ...]]] = {}  # -> (offset, shape)
        self._size = 0
        self._values: dict[tuple[int, str], Tensor] = {}
        self._sums: Tensor | None = None

    def field(self, layer: int, name: str, shape: Sequence[int] = ()) -> None:
        n = 1
        for s in shape:
            n *= s
        self._fields[(layer, name)] = (self._size, tuple(shape))
        self._size += n

    def add(self, layer: int, name: str, value: Tensor | float) -> None:
        self._values[(layer, name)] = value if isinstance(value, Tensor) else torch.tensor(float(value))

    def reduce(self, device: torch.device | str) -> None:
        """One all-reduce (sum) on the default group; every rank calls it with the same fields."""
        buf = torch.zeros(self._size, dtype=torch.float64, device=device)
        for key, value in self._values.items():
            offset, shape = self._fields[key]
            n = max(1, value.numel())
            buf[offset : offset + n] = value.detach().reshape(-1).to(device, torch.float64)
        dist.all_reduce(buf)
        self._sums = buf

    def flags(self, keys: Sequence[tuple[int, str]]) -> list[float]:
        """The sums of the one-value fields ``keys``, read to the host in one transfer."""
        if not keys:
            return []
        index = torch.tensor([self._fields[key][0] for key in keys], device=self._sums.device)
        return self._sums[index].tolist()

    def get(self, layer: int, name: str) -> Tensor:
        offset, shape = self._fields[(layer, name)]
        n = 1
        for s in shape:
            n *= s
        return self._sums[offset : offset + n].reshape(shape)

    @property
    def size(self) -> int:
        """Float64 values the all-reduce carries."""
        return self._size



# The AttentionStats fields share_attention carries, with their lengths: per head, or one value per layer
_ATTENTION = (("entropy", "heads"), ("rank", "heads"), ("max_logit", "heads"), ("rows", 1),
              ("uniform_entropy", "heads"), ("sink", "heads"), ("sink_pos", "heads"))


def owned_layers(layers: Sequence[OwnedLayer]) -> set[int] | None:
    """Under FSDP2 alone on more than one rank (every layer :func:`fsdp_alone`): the indices of the layers this rank
    owns (:func:`owner_of` of their positions in ``layers``); None otherwise (one process, DDP, HSDP, tensor
    parallelism), where every rank measures every layer's attention."""
    if not layers or not all(fsdp_alone(layer) for layer in layers):
        return None
    mesh = next(iter(layers[0].weights().values())).device_mesh
    if mesh.size() < 2:
        return None
    me = mesh.get_local_rank()
    return {layer.index for p, layer in enumerate(layers) if owner_of(p, layer) == me}


def share_attention(layers: Sequence[OwnedLayer], results: Mapping[int, AttentionStats],
                    owned: set[int]) -> tuple[dict[int, AttentionStats], dict[int, int]]:
    """FSDP2 alone: every layer's attention statistics as its owner measured them, the same on every rank.

    ``results``: what this rank captured (its layers ``owned``, and any other whose layout was not yet settled, whose
    values are not used). One all-reduce (float64, sum) of, per layer, a flag "measured by its owner" and the
    per-head entropy, rank, max logit, uniform entropy, sink share and sink position and the valid rows (``2 + 6 H``
    values); one host read of the flags. A layer whose owner measured nothing is absent from the result, on every
    rank. ``maps`` stay where they were captured: a layer's are kept on its owner, None elsewhere.

    Returns the statistics by layer index, and the owner's mesh coordinate of each absent layer."""
    shared = ScalarSum()
    heads = {layer.index: layer.layout.n_heads for layer in layers}
    for layer in layers:
        i, h = layer.index, heads[layer.index]
        shared.field(i, "measured")
        for name, size in _ATTENTION:
            shared.field(i, name, (h if size == "heads" else size,))
        stats = results.get(i) if i in owned else None
        if stats is None or stats.rank is None:
            continue
        values = {name: getattr(stats, name) for name, _ in _ATTENTION}
        if any(v.numel() != (h if size == "heads" else size) for (name, size), v in zip(_ATTENTION, values.values())):
            continue  # not the layout's head count: left out, as an unmeasured layer
        shared.add(i, "measured", 1.0)
        for name, value in values.items():
            shared.add(i, name, value)
    shared.reduce(next(iter(layers[0].params().values())).device)
    flags = shared.flags([(layer.index, "measured") for layer in layers])  # one host read
    out, absent = {}, {}
    for p, (layer, flag) in enumerate(zip(layers, flags)):
        i = layer.index
        if flag < 0.5:
            absent[i] = owner_of(p, layer)
            continue
        mine = results.get(i) if i in owned else None
        out[i] = AttentionStats(**{name: shared.get(i, name) for name, _ in _ATTENTION},
                                maps=None if mine is None else mine.maps)
    return out, absent
