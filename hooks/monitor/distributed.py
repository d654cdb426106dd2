"""The Monitor beyond one eager process: ranks, sharded parameters, agreed alerts.

* :func:`rank`, :func:`world_size`: 0 and 1 unless ``torch.distributed`` is
  initialised. Only rank 0 writes files (the Monitor's ``logdir`` sinks and
  ``alerts.jsonl``).
* :class:`QKVReader`: the Q/K/V weights (and gradients) of the monitored layers,
  and the W_O weight where the layout names one (for the update ratio), as whole
  tensors in float32 or better. Plain parameters (one process, DDP) are read in
  place, with no collective. FSDP2 parameters are DTensors sharded on one dim: they
  are read one layer at a time, the local shards of that layer's weights (and of
  its Q/K/V gradients when the step samples them) packed into one flat buffer and
  one ``all_gather_into_tensor``, so at most one layer's gathered weights exist at
  a time. Only the parameters a layout names are gathered, and only when the
  Monitor reads them: on steps that sample gradients, spectra or update ratios,
  and at the call after an update-ratio sample.
* :class:`SharedDetectors`: with ``stop_on_critical`` in a multi-rank job, every
  rank judges rank 0's observation (one broadcast per sampled step), so every rank
  raises :class:`~diag.detectors.base.TrainingHalted` at the same step and none is left
  waiting in a collective.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from diag.detectors import Alert, Detectors, Observation
from hooks.layout.discover import AttentionLayer

__all__ = ["rank", "world_size", "gather_full", "local_shards", "gather_like", "QKVReader", "SharedDetectors"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dtensor_type() -> type | None:
    """DTensor, if anything imported it (otherwise no tensor can be one): never imported just to check."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _float(t: Tensor) -> Tensor:
    """Metrics are computed in float32 or better: half and bfloat16 tensors are widened."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _shard_dim(t: Tensor) -> int | None:
    """The dim of a 1-D-mesh DTensor sharded as Shard(d), -1 if replicated, None if not packable."""
    from torch.distributed.tensor import Replicate, Shard

    if t.device_mesh.ndim != 1:
        return None
    placement = t.placements[0]
    if isinstance(placement, Shard):
        return placement.dim % t.dim()
    return -1 if isinstance(placement, Replicate) else None


def gather_full(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Whole tensors, in float32 or better, for plain tensors and DTensors alike.

    DTensors on a 1-D mesh sharded on one dim (FSDP2's ``Shard(0)``; uneven shards
    allowed) are gathered in one ``all_gather_into_tensor`` per mesh: each rank packs
    a header (its mesh coordinate and the rows of each of its shards) and every shard,
    padded to ``ceil(rows / world)`` rows, into one flat buffer. Other DTensors (2-D
    meshes as in HSDP, ``Partial``) fall back to ``full_tensor()``, one collective each.
    Every rank must call this with the same tensors in the same order.
    """
    dtensor = _dtensor_type()
    out: list[Tensor | None] = [None] * len(tensors)
    by_mesh: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if dtensor is None or not isinstance(t, dtensor):
            out[i] = _float(t)
        elif _shard_dim(t) == -1:
            out[i] = _float(t.to_local())
        elif _shard_dim(t) is None:
            out[i] = _float(t.full_tensor())
        else:
            by_mesh.setdefault(t.device_mesh, []).append(i)
    for mesh, members in by_mesh.items():
        full = _gather_sharded(mesh, [tensors[i].detach() for i in members])
        for i, f in zip(members, full):
            out[i] = f
    return out  # type: ignore[return-value]


def local_shards(tensors: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """Copies of this rank's shards, in float32 or better, when every tensor is a DTensor that
    :func:`gather_full` packs (a 1-D mesh, ``Shard(d)``); else None. No collective: what the update-ratio
    snapshot keeps under FSDP2 (1/world of a layer's weights per rank, not the gathered whole)."""
    dtensor = _dtensor_type()
    if dtensor is None or not tensors or not all(isinstance(t, dtensor) for t in tensors.values()):
        return None
    if any(_shard_dim(t) in (None, -1) for t in tensors.values()):
        return None
    return {name: _float(t.detach().to_local()).clone() for name, t in tensors.items()}


def gather_like(like: dict[str, Tensor], locals_: dict[str, Tensor]) -> dict[str, Tensor]:
    """The whole tensors whose shards on this rank are ``locals_``, each sharded as the DTensor of the same
    name in ``like`` (from :func:`local_shards`): one all-gather, as :func:`gather_full`. Every rank calls it."""
    from torch.distributed.tensor import DTensor

    names = list(locals_)
    shards = [DTensor.from_local(locals_[n], like[n].device_mesh, like[n].placements, run_check=False,
                                 shape=like[n].shape, stride=like[n].stride()) for n in names]
    return dict(zip(names, gather_full(shards)))


def _gather_sharded(mesh, shards: list[Tensor]) -> list[Tensor]:
    """One all_gather for DTensors sharded on a 1-D ``mesh`` (see :func:`gather_full`)."""
    size, coord = mesh.size(), mesh.get_local_rank()
    dtype = torch.float32
    for t in shards:
        dtype = torch.promote_types(dtype, t.dtype)
    dims = [_shard_dim(t) for t in shards]
    locals_ = [t.to_local().movedim(d, 0) for t, d in zip(shards, dims)]  # (rows_local, *rest)
    rests = [math.prod(t.shape) // t.shape[d] if t.shape[d] else 0 for t, d in zip(shards, dims)]
    slots = [math.ceil(t.shape[d] / size) * r for t, d, r in zip(shards, dims, rests)]
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
    all_gather(gathered, buf, group=mesh.get_group())
    rows = gathered.view(size, -1)
    rows = rows[rows[:, 0].long().argsort()]  # mesh coordinate order = shard order
    full, offset = [], header
    for j, (t, d, rest, slot) in enumerate(zip(shards, dims, rests, slots)):
        counts = rows[:, 1 + j].long().tolist()
        if min(counts) < 0 or sum(counts) != t.shape[d]:
            raise RuntimeError(f"gathering a {tuple(t.shape)} DTensor sharded on dim {d}: shard rows {counts} "
                               f"do not add up to {t.shape[d]} (an unexpected split rule); please report it with "
                               "the placement of this parameter, and leave this layer out of the Monitor's spec "
                               "meanwhile")
        moved = (t.shape[d],) + tuple(s for i, s in enumerate(t.shape) if i != d)
        pieces = [rows[r, offset : offset + c * rest] for r, c in enumerate(counts)]
        whole = torch.cat(pieces).view(moved).movedim(0, d).to(torch.promote_types(t.dtype, torch.float32))
        full.append(whole)
        offset += slot
    return full


class QKVReader:
    """Reads the Q/K/V weights (and gradients) of the monitored layers, a group of layers at a time.

    :meth:`groups`: plain parameters (one process, DDP) make one group of every layer: they are
    read in place, nothing is gathered or copied. Sharded ones (FSDP2 DTensors) make one group
    per layer, so the Monitor never holds more than one layer's gathered weights at a time
    (docs/cost.md). :meth:`read` returns a group's whole tensors in float32 or better, gathered
    in one collective per group; every rank reads the same groups in the same order.
    output: read W_O too (under ``layout.o``; its weight only, never its gradient).
    """

    def __init__(self, layers: Sequence[AttentionLayer], grads: bool = True, output: bool = True) -> None:
        self.layers, self.grads, self.output = list(layers), grads, output

    def sharded(self) -> bool:
        """Whether any weight is a DTensor (checked at each call: a model may be sharded after attaching)."""
        dtensor = _dtensor_type()
        return dtensor is not None and any(isinstance(p, dtensor) for layer in self.layers
                                           for p in layer.weights().values())

    def groups(self) -> list[list[AttentionLayer]]:
        """The layers in reading order: one group of all (plain), or one layer per group (sharded)."""
        return [[layer] for layer in self.layers] if self.sharded() else [list(self.layers)]

    def read(
        self, group: Sequence[AttentionLayer], weights: bool = True, grads: bool = False
    ) -> list[tuple[dict[str, Tensor] | None, dict[str, Tensor] | None]]:
        """(weights, grads) of each layer of ``group``: weights None when not asked, grads None when
        not asked or when a Q/K/V parameter has no ``.grad``."""
        tensors: list[Tensor] = []
        plan = []
        for layer in group:
            named = layer.params()
            wanted = (layer.weights() if self.output else named) if weights else {}
            with_grads = grads and self.grads and all(p.grad is not None for p in named.values())
            tensors += list(wanted.values()) + ([p.grad for p in named.values()] if with_grads else [])
            plan.append((list(wanted), list(named) if with_grads else None))
        full = iter(gather_full(tensors))  # one collective for the group
        out = []
        for names, grad_names in plan:
            read = {n: next(full) for n in names} if weights else None
            out.append((read, None if grad_names is None else {n: next(full) for n in grad_names}))
        return out


class SharedDetectors:
    """Detectors that judge rank 0's observation on every rank (see the module docstring).

    Weight, gradient and update metrics are the same on every rank; the loss and the
    attention statistics are each rank's own. Without ``stop_on_critical`` only rank
    0 judges (it alone writes alerts) and no collective is issued; with it, an
    observation that holds a loss or any metric other than an update ratio is
    broadcast from rank 0 first, so all ranks raise together.
    """

    def __init__(self, detectors: Detectors, stop_on_critical: bool) -> None:
        self.inner, self.stop = detectors, stop_on_critical

    def observe(self, observation: Observation) -> list[Alert]:
        """A sampled step's observation: rank 0's, broadcast (with ``stop_on_critical``). Every rank
        calls this at every sampled step, whatever the observation holds, so the broadcast always pairs."""
        if not self.stop:
            return self.inner.observe(observation) if rank() == 0 else []
        box = [observation]
        dist.broadcast_object_list(box, src=0)
        return self.inner.observe(box[0])

    def observe_updates(self, observation: Observation) -> list[Alert]:
        """The update ratios of the step before: computed from the (gathered) weights, the same on
        every rank, so no collective."""
        if not self.stop:
            return self.inner.observe(observation) if rank() == 0 else []
        return self.inner.observe(observation)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
