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

Under FSDP2 alone (a 1-D mesh over every rank, :func:`hooks.parallel.owners.fsdp_alone`) nothing is
gathered to every rank: the gradient norms come from per-head sums of squares of each rank's own shards,
layer ``i``'s shards are gathered to its owner rank ``i % world`` alone, which computes its spectra, its
sigma_1(W) and ||W||_F (its tracker lives there) and later its update ratios from dW gathered to it, and one
all-reduce of float64 scalars per sample (another where update ratios are measured) gives every rank every
layer's values (:mod:`hooks.parallel.owners`). HSDP and FSDP2 beside tensor parallelism keep the paths above.

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
from diag.math.metrics import grad_metrics, grad_ratio, layer_spectra
from diag.math.norms import frobenius
from diag.math.updates import UpdateTracker
from hooks.layout.discover import AttentionLayer
from hooks.monitor.reader import QKVReader, kept_dim
from hooks.parallel.gather import gather_like, gather_to, local_shards
from hooks.parallel.headgather import HeadGather, grad_squares, tp_reduce
from hooks.parallel.owners import ScalarSum, ShardSquares, fsdp_alone, owner_of

__all__ = ["WeightSide", "ShardSnapshot", "PendingUpdate", "AppliedUpdate", "nan_spectra"]

Warn = Callable[[str, str], None]  # (kind, message): reported once per kind
SPECTRA = family_metrics("spectra")
FAILED = -1  # the ScalarSum key of the spectra-failed flag (no layer has this index)


@dataclass
class ShardSnapshot:
    """The update-ratio snapshot of one FSDP2 layer: this rank's shards of its weights (``local``, float32
    or better), then, after :meth:`WeightSide.advance`, of -dW; ``params`` are the sharded parameters."""

    params: dict[str, Tensor]
    local: dict[str, Tensor]
    keep: int | None = None  # under tensor parallelism its mesh dim: what is gathered is this rank's block
    owner: int | None = None  # FSDP2 alone: the mesh coordinate of the rank the layer's dW is gathered to


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
        self.position = {layer.index: i for i, layer in enumerate(self.layers)}  # FSDP2 alone: owner_of's input
        self.squares = ShardSquares()
        self.pending: PendingUpdate | None = None
        self.applied: AppliedUpdate | None = None

    def sample(self, step: int, due: frozenset[str]) -> tuple[dict[int, dict[str, Tensor]], bool]:
        """{layer index: {metric: tensor}} of the families in ``due``, and whether the spectra failed."""
        out: dict[int, dict[str, Tensor]] = {layer.index: {} for layer in self.layers}
        weights, grads = bool(due & {"spectra", "updates"}), "grads" in due
        if not (weights or grads):
            return out, False
        groups, snapshots, norms, failed = self.reader.groups(), [], [], False
        owned = [len(group) == 1 and fsdp_alone(group[0]) for group in groups]  # FSDP2 alone: one owner per layer
        shared = ScalarSum() if any(owned) and due & {"grads", "spectra"} else None
        if shared is not None and "spectra" in due:
            shared.field(FAILED, "spectra_failed")
        for g, group in enumerate(groups):
            if owned[g]:
                self._owned(step, g, group[0], due, shared, snapshots, norms)
                continue
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
        if shared is not None:
            failed |= self._share(shared, [group[0] for group, mine in zip(groups, owned) if mine], due, out)
        if "updates" in due:
            self.pending = PendingUpdate(step, groups, snapshots, norms)
        return out, failed

    def _owned(self, step: int, g: int, layer: AttentionLayer, due: frozenset[str], shared: ScalarSum | None,
               snapshots: list, norms: list) -> None:
        """FSDP2 alone: this rank's part of layer ``layer`` (group ``g``): the per-head sums of squares of its shards
        of the gradients; the layer's shards gathered to its owner, which computes the spectra and sigma_1(W),
        ||W||_F; this rank's shards kept for the update. Values go into ``shared`` (summed by :meth:`_share`)."""
        i, lay = layer.index, layer.layout
        if "grads" in due:
            shared.field(i, "grads")  # ranks that had gradients
            for role, heads in (("q", lay.n_heads), ("k", lay.kv_heads), ("v", lay.kv_heads)):
                shared.field(i, f"grad_sq_{role}", (heads,))
            squares = self.squares(layer) if self.reader.grads else None
            if squares is not None:
                shared.add(i, "grads", 1.0)
                for name, value in squares.items():
                    shared.add(i, name, value)
        if "spectra" in due:  # the owner's values, zeros from the other ranks
            for m in SPECTRA:
                shared.field(i, m, (lay.n_heads, lay.head_dim) if METRICS[m].per == "spectrum" else (lay.n_heads,))
        if not due & {"spectra", "updates"}:
            return
        params = layer.weights() if "updates" in due else layer.params()
        owner = owner_of(self.position[i], layer)
        whole = gather_to(list(params.values()), owner)  # None on every rank but the owner
        norm = None
        if whole is not None:
            whole = dict(zip(params, whole))
            if "spectra" in due:
                wq, wk, _ = split_qkv(whole, lay, paired=True)
                metrics: dict[int, dict[str, Tensor]] = {i: {}}
                if not self._spectra(step, [layer], [(wq, wk)], metrics):
                    shared.add(FAILED, "spectra_failed", 1.0)
                for m in SPECTRA:
                    shared.add(i, m, metrics[i][m])
                del wq, wk
            if "updates" in due:
                tracker = self._tracker(g, [layer])
                stacks = tracker.snapshot([_projections(whole, layer)])
                norm = tracker.norms_before(stacks)  # kept on the owner until the ratios are measured
                del stacks
            del whole
        if "updates" in due:
            weights = layer.weights()
            norms.append(norm)
            snapshots.append(ShardSnapshot(weights, local_shards(weights), None, owner))

    def _share(self, shared: ScalarSum, layers: list[AttentionLayer], due: frozenset[str], out: dict) -> bool:
        """The all-reduce of :meth:`_owned`'s values, and every owned layer's metrics from it (the same on every
        rank); returns whether the spectra failed on some owner."""
        device = next(iter(layers[0].params().values())).device
        shared.reduce(device)
        keys = [(layer.index, "grads") for layer in layers] if "grads" in due else []
        keys += [(FAILED, "spectra_failed")] if "spectra" in due else []
        flags = shared.flags(keys)  # one host read
        world = next(iter(layers[0].params().values())).device_mesh.size()
        for layer, count in zip(layers, flags if "grads" in due else [None] * len(layers)):
            values = out[layer.index]
            if count is not None and count < world:
                self.warn("no-grad", f"diag: {layer.name} has no .grad at a sampled step; "
                          "call monitor.step after loss.backward()")
            elif count is not None:
                norms = {f"grad_norm_{r}": shared.get(layer.index, f"grad_sq_{r}").sqrt() for r in "qkv"}
                values.update(norms)
                values["grad_ratio_qk_v"] = grad_ratio(norms["grad_norm_q"], norms["grad_norm_k"],
                                                       norms["grad_norm_v"])
            if "spectra" in due:
                values.update({m: shared.get(layer.index, m) for m in SPECTRA})
        return "spectra" in due and flags[-1] > 0

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
        shared, owned = ScalarSum(), []
        for g, group in enumerate(applied.groups):
            snapshot, delta = applied.snapshots[g], applied.deltas[g]
            if isinstance(snapshot, ShardSnapshot) and snapshot.owner is not None:  # FSDP2 alone: dW to the owner
                self._measure_owned(g, group[0], snapshot, applied.norms[g], shared)
                owned.append(group[0])
                continue
            if isinstance(snapshot, ShardSnapshot):  # the whole -dW of this layer, one gather (every rank)
                whole = gather_like(snapshot.params, snapshot.local, snapshot.keep)
                snapshot.local = {}  # spent
                snapshot = self.trackers[g].snapshot([_projections(whole, group[0])])
                delta = [chunk.before for chunk in snapshot]
                del whole
            for layer, metrics in zip(group, self.trackers[g].finish(snapshot, delta, applied.norms[g], len(group))):
                out[layer.index] = metrics
        if owned:  # every owner's ratios to every rank: one all-reduce
            shared.reduce(next(iter(owned[0].params().values())).device)
            for layer in owned:
                out[layer.index] = {name: shared.get(layer.index, name) for name in _update_names(layer)}
        return applied.step, out

    def _measure_owned(self, g: int, layer: AttentionLayer, snapshot: ShardSnapshot, norms: list | None,
                       shared: ScalarSum) -> None:
        """FSDP2 alone: the layer's -dW shards gathered to its owner, which measures the ratios with its tracker and
        adds them to ``shared``; every rank declares the fields."""
        names = _update_names(layer)
        for name in names:
            shared.field(layer.index, name)
        whole = gather_like(snapshot.params, snapshot.local, dst=snapshot.owner)
        snapshot.local = {}  # spent
        if whole is None:
            return
        tracker = self.trackers[g]
        stacks = tracker.snapshot([_projections(whole, layer)])
        del whole
        metrics = tracker.finish(stacks, [chunk.before for chunk in stacks], norms, 1)[0]
        for name in names:
            shared.add(layer.index, name, metrics[name])

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


def _update_names(layer: AttentionLayer) -> list[str]:
    """The update-ratio metrics of a layer: both ratios of W_Q, W_K, W_V, and W_O where the layout names it."""
    matrices = "qkvo" if layer.layout.o is not None else "qkv"
    return [f"update_{kind}_{x}" for x in matrices for kind in ("ratio", "fro")]


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
