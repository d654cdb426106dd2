"""The weight-side families of a sampled step: gradient norms, spectra, update ratios.

The layers are read in the groups of :meth:`hooks.monitor.reader.QKVReader.groups`:
all layers at once for plain parameters (read in place, nothing copied), one
layer at a time for FSDP2 DTensors, whose gathered weights are dropped before the
next layer is gathered. Within a group the spectra are batched across layers of
equal shape (:func:`diag.math.metrics.layer_spectra`); the update-ratio snapshot
and its warm-started sigma_1 tracker are kept per group. Under FSDP2 the snapshot
is this rank's shards of the layer's weights (1/world of them), dW is taken shard
by shard with no collective, and the whole dW of one layer at a time is gathered
only when the ratios are measured.

Only what the step's families need is read: weights for spectra and update
ratios, gradients for the gradient norms; a step that samples only the loss
reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.catalog.metrics import METRICS, family_metrics
from diag.layouts.vocab import QKVLayout, split_projections, split_qkv
from diag.math.metrics import grad_metrics, layer_spectra
from diag.math.norms import frobenius
from diag.math.updates import UpdateTracker
from hooks.layout.discover import AttentionLayer
from hooks.monitor.reader import QKVReader, kept_dim
from hooks.parallel.gather import gather_like, local_shards
from hooks.parallel.headgather import HeadGather, grad_squares, tp_reduce

__all__ = ["WeightSide", "ShardSnapshot", "PendingUpdate", "AppliedUpdate", "nan_spectra"]

Warn = Callable[[str, str], None]  # (kind, message): reported once per kind


@dataclass
class ShardSnapshot:
    """The update-ratio snapshot of one FSDP2 layer: this rank's shards of its weights (``local``, float32
    or better), then, after :meth:`WeightSide.advance`, of -dW; ``params`` are the sharded parameters."""

    params: dict[str, Tensor]
    local: dict[str, Tensor]
    keep: int | None = None  # under tensor parallelism its mesh dim: what is gathered is this rank's block


@dataclass
class PendingUpdate:
    """The update-ratio snapshot of sampled step ``step``, taken before its optimizer step.

    groups: the layers as :meth:`QKVReader.groups` read them; per group, ``snapshots`` holds the
    stacks of W (:meth:`UpdateTracker.snapshot`) or a :class:`ShardSnapshot` (FSDP2), and ``norms``
    the norms of W (:meth:`UpdateTracker.norms_before`)."""

    step: int
    groups: list[list[AttentionLayer]]
    snapshots: list
    norms: list


@dataclass
class AppliedUpdate(PendingUpdate):
    """The update optimizer step ``step`` applied, taken at the next step (:meth:`WeightSide.advance`);
    ``deltas``: per group, the stacks of -dW (:meth:`UpdateTracker.advance`), or None for a
    :class:`ShardSnapshot`, whose ``local`` then holds this rank's shards of -dW."""

    deltas: list


class WeightSide:
    """Per-layer metric tensors of the weight-side families.

    The update ratios of a sampled step ``s`` take three stages: the snapshot and the norms of W
    on step ``s`` (``pending``, a :class:`PendingUpdate`); dW at step ``s + 1``, after the optimizer
    step, by :meth:`advance` (elementwise work, no host read: ``applied``, an :class:`AppliedUpdate`);
    the ratios by :meth:`measure` whenever the Monitor wants them (on its next sampled step, or at
    once in a run's first steps)."""

    def __init__(self, layers: Sequence[AttentionLayer], signals: frozenset[str], sec_top: int, warn: Warn,
                 heads: HeadGather | None = None) -> None:
        self.layers, self.sec_top, self.warn, self.heads = list(layers), sec_top, warn, heads
        # tensor parallelism: which heads of its block this rank computes (heads.work), and, beside FSDP2, gradient
        # norms from this rank's own rows (heads.from_rows): those gradients are not gathered
        self.reader = QKVReader(self.layers, grads="grads" in signals, output="updates" in signals,
                                gathered_grads=lambda layer: not self._from_rows(layer))
        self.trackers: dict[int, UpdateTracker] = {}  # group position -> its warm-started tracker
        self.pending: PendingUpdate | None = None
        self.applied: AppliedUpdate | None = None

    def sample(self, step: int, due: frozenset[str]) -> tuple[dict[int, dict[str, Tensor]], bool]:
        """{layer index: {metric: tensor}} of the families in ``due``, and whether the spectra failed."""
        out: dict[int, dict[str, Tensor]] = {layer.index: {} for layer in self.layers}
        weights, grads = bool(due & {"spectra", "updates"}), "grads" in due
        if not (weights or grads):
            return out, False
        groups, snapshots, norms, failed = self.reader.groups(), [], [], False
        for g, group in enumerate(groups):
            read = self.reader.read(group, weights=weights, grads=grads)  # (weights, grads) per layer
            if grads:
                self._grads(group, [gr for _, gr in read], out)
            if not weights:
                continue
            # K row h: the key head of query head h (kv_map), so the spectra pair heads as the model does
            qkv = [split_qkv(w, _layout(layer), paired=True) for layer, (w, _) in zip(group, read)]
            if "spectra" in due:
                qk = [m[:2] if layer.block is None else self.heads.work(layer).pair(*m[:2], _layout(layer))
                      for layer, m in zip(group, qkv)]
                failed |= not self._spectra(step, group, qk, out)
            if "updates" in due:
                tracker = self._tracker(g, group)
                whole = tracker.snapshot([_projections(w, layer) for layer, (w, _) in zip(group, read)])
                norms.append(tracker.norms_before(whole))  # sigma_1(W) needs the whole W: taken now
                params, keep = group[0].weights(), kept_dim(group[0])  # what the reader read: updates due, so W_O too
                shards = local_shards(params, keep) if len(group) == 1 else None  # sharded groups hold one layer
                snapshots.append(whole if shards is None else ShardSnapshot(params, shards, keep))
                del whole  # sharded: only this rank's shards are kept until the step after
            del read, qkv  # under FSDP2: this layer's gathered weights go before the next is gathered
        if "updates" in due:
            self.pending = PendingUpdate(step, groups, snapshots, norms)
        return out, failed

    def advance(self) -> None:
        """The step after a snapshot: dW of the pending snapshot, read from the weights now (under FSDP2
        a gather per group, so every rank calls it on the same step; FSDP2 shards: none, -dW shard by
        shard in place)."""
        pending, self.pending = self.pending, None
        deltas: list = []
        for g, (group, snapshot) in enumerate(zip(pending.groups, pending.snapshots)):
            if isinstance(snapshot, ShardSnapshot):
                for name, param in snapshot.params.items():
                    snapshot.local[name].sub_(param.detach().to_local())  # -dW, as the whole path
                deltas.append(None)
                continue
            read = self.reader.read(group, weights=True)
            after = [_projections(w, layer) for layer, (w, _) in zip(group, read)]
            deltas.append(self.trackers[g].advance(snapshot, after))
            del read, after
        self.applied = AppliedUpdate(pending.step, pending.groups, pending.snapshots, pending.norms, deltas)

    def measure(self) -> tuple[int, dict[int, dict[str, Tensor]]]:
        """The update ratios of the advanced snapshot: (the step they belong to, {layer index: metrics})."""
        applied, self.applied = self.applied, None
        out: dict[int, dict[str, Tensor]] = {}
        for g, group in enumerate(applied.groups):
            snapshot, delta = applied.snapshots[g], applied.deltas[g]
            if isinstance(snapshot, ShardSnapshot):  # the whole -dW of this layer, one gather (every rank)
                whole = gather_like(snapshot.params, snapshot.local, snapshot.keep)
                snapshot.local = {}  # spent
                snapshot = self.trackers[g].snapshot([_projections(whole, group[0])])
                delta = [chunk.before for chunk in snapshot]
                del whole
            for layer, metrics in zip(group, self.trackers[g].finish(snapshot, delta, applied.norms[g], len(group))):
                out[layer.index] = metrics
        return applied.step, out

    def _grads(self, group: list[AttentionLayer], grads: list, out: dict) -> None:
        for layer, gr in zip(group, grads):
            if self._from_rows(layer):  # per-head sums of squares of this rank's rows, added up after the gather
                gr = grad_squares(layer)
                if gr is not None:
                    out[layer.index].update(gr)
                    continue
            if gr is None:
                self.warn("no-grad", f"diag: {layer.name} has no .grad at a sampled step; "
                          "call monitor.step after loss.backward()")
            elif layer.block is None:
                out[layer.index].update(grad_metrics(*split_qkv(gr, layer.layout)))
            else:  # this rank's share of its block; the ratio is taken once every rank's norms are gathered
                gq, gk, gv = split_qkv(gr, layer.block.layout)
                work = self.heads.work(layer)
                out[layer.index].update({"grad_norm_q": frobenius(gq[work.q.start:work.q.stop]),
                                         "grad_norm_k": frobenius(gk[work.kv.start:work.kv.stop]),
                                         "grad_norm_v": frobenius(gv[work.kv.start:work.kv.stop])})

    def _from_rows(self, layer: AttentionLayer) -> bool:
        return self.heads is not None and self.heads.from_rows.get(layer.index, False)

    def _tracker(self, g: int, group: list[AttentionLayer]) -> UpdateTracker:
        """The warm-started tracker of group ``g``; under tensor parallelism its sums over rows are all-reduced
        over the block's tensor-parallel group (the groups hold layers of one mesh)."""
        if g not in self.trackers:
            block = group[0].block
            self.trackers[g] = UpdateTracker(reduce=None if block is None else tp_reduce(block))
        return self.trackers[g]

    def _spectra(self, step: int, group: list[AttentionLayer], qk: list, out: dict) -> bool:
        """Spectra of a group; if the linear algebra fails (an eigensolver or SVD that does not
        converge raises), they are NaN at this step and the other families are still logged."""
        try:
            metrics = layer_spectra([pair for pair in qk if pair[0].shape[0]], self.sec_top)
            metrics = iter(metrics)
            metrics = [next(metrics) if wq.shape[0] else nan_spectra(wq) for wq, _ in qk]  # no heads here: empty
        except Exception as err:  # noqa: BLE001 - e.g. torch.linalg.LinAlgError
            self.warn("spectra", f"diag: spectra failed at step {step} ({err!r}); logged as NaN, "
                      "the other signals are kept, training continues")
            metrics = [nan_spectra(wq) for wq, _ in qk]
            failed = True
        else:
            failed = False
        for layer, m in zip(group, metrics):
            out[layer.index].update(m)
        return not failed


def nan_spectra(wq: Tensor) -> dict[str, Tensor]:
    """The spectral metrics of one layer (per-head wq: (H, D, E)) as NaN, in their usual shapes: (H,) per head,
    (H, D) for a spectrum."""
    heads, dim = wq.shape[0], wq.shape[1]
    return {m: torch.full((heads, dim) if METRICS[m].per == "spectrum" else (heads,), torch.nan, dtype=torch.float64,
                          device=wq.device) for m in family_metrics("spectra")}


def _layout(layer: AttentionLayer) -> QKVLayout:
    """The layout of what this rank reads of ``layer``: under tensor parallelism, its block's."""
    return layer.layout if layer.block is None else layer.block.layout


def _projections(weights: dict[str, Tensor], layer: AttentionLayer) -> dict[str, Tensor]:
    """The matrices whose update ratios are measured; under tensor parallelism with this rank's heads as rows
    (W_O transposed: (H_l * D, E)), the rows the ranks' reduce sums over."""
    out = split_projections(weights, _layout(layer))
    if layer.block is not None and "o" in out:
        out["o"] = out["o"].mT
    return out
