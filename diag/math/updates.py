"""Optimizer updates: a stacked snapshot of weight matrices before a step, the update after it, its ratios.

Pure tensor math: no modules, no I/O. One snapshot/update routine for both users:

* :class:`UpdateTracker` (the Monitor and the checkpoint series): update ratios
  sigma_1(dW)/sigma_1(W) and ||dW||_F/||W||_F of the Q, K, V (and O) projections, batched
  across layers, sigma_1 by :class:`diag.math.norms.Sigma1`;
* ``hooks.steplimit.SpectralStepLimit``: the same snapshot and update, sigma_1 by
  :func:`diag.math.norms.power_sigma1`, and the step rescaled from them.

A snapshot stacks the matrices in groups of equal shape, dtype and device (in the order first
seen), in the work dtype (:func:`work_dtype`), so that each group is one batched computation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from diag.math.norms import Reduce, Sigma1, frobenius

__all__ = ["UpdateTracker", "Stack", "stack_by_shape", "update_of", "work_dtype", "UPDATE_CHUNK_BYTES"]

K = TypeVar("K", bound=Hashable)

# Bytes of one stacked group of matrices in the update-ratio computation: bounds the
# temporaries (the stacked weights after the step and their difference from before).
UPDATE_CHUNK_BYTES = 32 * 2**20


def work_dtype(w: Tensor) -> torch.dtype:
    """The dtype of the snapshot and of dW: float32 for float32/bf16/fp16 weights (dW to one float32
    rounding per entry, exact where the two values are within a factor 2: Sterbenz); float64 stays."""
    return torch.float64 if w.dtype == torch.float64 else torch.float32


@dataclass
class Stack(Generic[K]):
    """Matrices of one shape, dtype and device, stacked: ``before`` (c, rows, cols), in the work dtype."""

    members: list[K]  # the caller's key of each stacked matrix, in stacking order
    before: Tensor


def stack_by_shape(items: Sequence[tuple[K, Tensor]], chunk_bytes: int | None = None) -> list[Stack[K]]:
    """Copies of the (rows, cols) matrices of ``items`` (key, matrix), stacked per (shape, dtype, device),
    groups in the order first seen, each split into stacks of at most ``chunk_bytes`` (None: no split).
    One copy per matrix, straight into the stack."""
    groups: dict[tuple, list[tuple[K, Tensor]]] = {}
    for key, w in items:
        groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append((key, w))
    stacks = []
    for members in groups.values():
        first = members[0][1]
        per = len(members)
        if chunk_bytes is not None:
            size = first.numel() * torch.finfo(work_dtype(first)).bits // 8
            per = max(1, chunk_bytes // max(1, size))
        for start in range(0, len(members), per):
            part = members[start : start + per]
            before = torch.empty((len(part), *first.shape), dtype=work_dtype(first), device=first.device)
            for j, (_, w) in enumerate(part):
                before[j].copy_(w)
            stacks.append(Stack([key for key, _ in part], before))
    return stacks


def update_of(stack: Stack, after: Sequence[Tensor], *, in_place: bool) -> Tensor:
    """The update of each stacked matrix, given the matrices ``after`` the step (in ``stack.members`` order).

    ``in_place=False``: dW = after - before, a new stack; ``stack.before`` is kept (to rescale the step).
    ``in_place=True``: before - after = -dW, written over ``stack.before``, which is spent (no second
    stacked copy: a fresh allocation of that size costs more in page faults than the subtraction);
    norms do not see the sign."""
    if not in_place:
        delta = torch.stack(list(after)).to(stack.before.dtype)  # (c, rows, cols)
        delta -= stack.before
        return delta
    delta = stack.before
    for j, w in enumerate(after):
        delta[j].sub_(w)
    stack.before = torch.empty(0)  # spent: it holds -dW now
    return delta


# The matrices of one layer: (wq, wk, wv) per head, or {"q": ..., "k": ..., "v": ..., "o": ...}.
Projections = Sequence[Tensor] | Mapping[str, Tensor]


def _named(mats: Projections, as_given: bool = False) -> list[tuple[str, Tensor]]:
    """(name, matrix) of one layer; a sequence is (wq, wk, wv). Per-head (heads, D, E) -> (heads*D, E).
    as_given: keep each matrix's orientation (rows split across processes stay rows)."""
    items = mats.items() if isinstance(mats, Mapping) else zip("qkv", mats)
    return [(name, w.flatten(0, -2) if as_given else _storage_order(w.flatten(0, -2))) for name, w in items]


def _storage_order(w: Tensor) -> Tensor:
    """w, or w^T where that is the order w's elements are stored in (GPT-2's Conv1D weights are stored
    (E, 3E): their row views are transposed). The update ratio and the Frobenius ratio do not change
    under a transpose, and copying and subtracting along contiguous rows is faster
    (docs/cost.md#implementation-choices)."""
    return w.mT if w.stride(-1) != 1 and w.stride(-2) == 1 else w


class UpdateTracker:
    """Update ratios of the Q, K, V (and O) projections of many layers, batched across layers.

    ``snap = tracker.snapshot(layers)`` before the optimizer step (a copy of the matrices,
    stacked in groups of equal shape of at most ``chunk_bytes``); after it,
    ``tracker.measure(snap, layers_after)`` gives, per layer, ``update_ratio_<x>`` =
    sigma_1(dW)/sigma_1(W) and ``update_fro_<x>`` = ||dW||_F/||W||_F for each matrix x of the
    layer, with W the matrix before the step (all heads at once). sigma_1 comes from
    :class:`diag.math.norms.Sigma1`, warm-started across calls per group (so keep one tracker per
    run and feed it the layers in the same order). A snapshot is measured once: ``measure`` turns
    it into the update. ``measure`` is three stages that may run at different steps (the Monitor
    does): :meth:`norms_before` when the snapshot is taken, :meth:`advance` right after the optimizer
    step, :meth:`finish` whenever the ratios are wanted.
    layers: per layer, the per-head (wq, wk, wv) of :func:`diag.layouts.split_qkv`, or a
    mapping name -> matrix such as :func:`diag.layouts.split_projections` gives (``q``,
    ``k``, ``v`` and, where the layer has one, ``o``); the same names before and after.
    reduce: under tensor parallelism, each process passes its rows of every matrix (W_O transposed, its
    heads as rows) and ``reduce`` sums over the processes (:class:`diag.math.norms.Sigma1`): the ratios
    are those of the whole matrices, the same on every process.
    """

    def __init__(self, rtol: float = 1e-3, chunk_bytes: int = UPDATE_CHUNK_BYTES, reduce: Reduce | None = None) -> None:
        self.sigma_w, self.sigma_d = Sigma1(rtol=rtol, reduce=reduce), Sigma1(rtol=rtol, reduce=reduce)
        self.chunk_bytes, self.reduce = chunk_bytes, reduce

    def snapshot(self, layers: Sequence[Projections]) -> list[Stack[tuple[int, str]]]:
        items = [((i, name), flat) for i, mats in enumerate(layers)
                 for name, flat in _named(mats, as_given=self.reduce is not None)]
        return stack_by_shape(items, self.chunk_bytes)

    def measure(self, snapshot: list[Stack[tuple[int, str]]], layers: Sequence[Projections]) -> list[dict[str, Tensor]]:
        """The ratios of the update from ``snapshot`` to ``layers``: :meth:`norms_before`,
        :meth:`advance` and :meth:`finish` in one call."""
        norms = self.norms_before(snapshot)
        return self.finish(snapshot, self.advance(snapshot, layers), norms, len(layers))

    def norms_before(self, snapshot: list[Stack[tuple[int, str]]]) -> list[tuple[Tensor, Tensor]]:
        """(sigma_1(W), ||W||_F) of each stacked matrix, per stack: what the ratios divide by, computed
        while the snapshot still holds W (the Monitor does it on the sampled step that took it)."""
        return [(self.sigma_w(chunk.before, (c, tuple(chunk.before.shape))), self._frobenius(chunk.before))
                for c, chunk in enumerate(snapshot)]

    def advance(self, snapshot: list[Stack[tuple[int, str]]], layers: Sequence[Projections]) -> list[Tensor]:
        """-dW per stack, written over the snapshot (which is spent): elementwise work only, no host
        read, so the step right after a sampled one can take it on an accelerator without a sync."""
        mats = {(i, name): w for i, ws in enumerate(layers) for name, w in _named(ws, as_given=self.reduce is not None)}
        return [update_of(chunk, [mats[m] for m in chunk.members], in_place=True) for chunk in snapshot]

    def finish(self, snapshot: list[Stack[tuple[int, str]]], deltas: Sequence[Tensor],
               norms: Sequence[tuple[Tensor, Tensor]], n_layers: int) -> list[dict[str, Tensor]]:
        """Per layer, ``update_ratio_<x>`` and ``update_fro_<x>`` from the updates of :meth:`advance` and
        the norms of :meth:`norms_before` (any later step: the ratios are those of the step measured)."""
        out: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        for c, (chunk, delta, (sigma_w, fro_w)) in enumerate(zip(snapshot, deltas, norms)):
            ratio = self.sigma_d(delta, (c, tuple(delta.shape))) / sigma_w
            fro = self._frobenius(delta) / fro_w
            for j, (i, name) in enumerate(chunk.members):
                out[i][f"update_ratio_{name}"] = ratio[j]
                out[i][f"update_fro_{name}"] = fro[j]
        return out

    def _frobenius(self, x: Tensor) -> Tensor:
        """||x||_F per matrix; with ``reduce``, of the whole matrices whose rows the processes share."""
        if self.reduce is None:
            return frobenius(x)
        return self.reduce(frobenius(x).square()).sqrt()
