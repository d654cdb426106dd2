"""The weight-side signal families, batched: spectra, gradient norms, update ratios.

Pure functions from per-head tensors (see :func:`diag.layouts.split_qkv`) to
dictionaries of float64 tensors; the monitor and the checkpoint analysis call
the same functions, so their numbers agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.math.spectral import (
    Sigma1,
    effective_rank,
    qk_singular_values,
    qk_singular_values_of_layers,
    spectral_energy_concentration,
    stable_rank,
    top_singular_value,
)

__all__ = [
    "spectrum_metrics",
    "layer_spectra",
    "grad_metrics",
    "update_metrics",
    "qkv_update_metrics",
    "UpdateTracker",
    "DEFAULT_SEC_TOP",
]

# SEC_s with s = 4: with d_head = 64 a random-init head has SEC_4 of about 0.2;
# a head whose energy sits in a handful of directions approaches 1.
DEFAULT_SEC_TOP = 4


def spectrum_metrics(wq: Tensor, wk: Tensor, sec_top: int = DEFAULT_SEC_TOP) -> dict[str, Tensor]:
    """Per-head qk_sigma1, qk_sec, qk_erank, qk_stable_rank and the spectrum itself.

    wq: (..., H, D, E); wk: (..., G, D, E). Leading dimensions (e.g. stacked layers
    of equal shape) are flattened into the head dimension for one batched call.
    """
    lead = wq.shape[:-3]
    # Row l*H + h of the flattened queries pairs with row l*G + h // (H/G) of the keys.
    sv = qk_singular_values(wq.flatten(0, -3), wk.flatten(0, -3))
    return _metrics_of_spectra(sv.reshape(*lead, wq.shape[-3], sv.shape[-1]), sec_top)


def _metrics_of_spectra(sv: Tensor, sec_top: int) -> dict[str, Tensor]:
    return {
        "qk_sigma1": sv[..., 0],
        "qk_sec": spectral_energy_concentration(sv, sec_top),
        "qk_erank": effective_rank(sv),
        "qk_stable_rank": stable_rank(sv),
        "qk_spectrum": sv,
    }


def layer_spectra(qk: Sequence[tuple[Tensor, Tensor]], sec_top: int = DEFAULT_SEC_TOP) -> list[dict[str, Tensor]]:
    """:func:`spectrum_metrics` of many layers: one batched call per group of equal shapes.

    qk: per layer, the per-head (wq, wk) of :func:`diag.layouts.split_qkv`. Returns the
    metrics of each layer, in the order given.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (wq, wk) in enumerate(qk):
        groups.setdefault((tuple(wq.shape), tuple(wk.shape), wq.dtype), []).append(i)
    out: list[dict[str, Tensor]] = [{} for _ in qk]
    for members in groups.values():
        sv = qk_singular_values_of_layers([qk[i] for i in members])  # (layers * H, D)
        batched = _metrics_of_spectra(sv.reshape(len(members), -1, sv.shape[-1]), sec_top)
        for j, i in enumerate(members):
            out[i] = {name: t[j] for name, t in batched.items()}
    return out


def grad_metrics(gq: Tensor, gk: Tensor, gv: Tensor) -> dict[str, Tensor]:
    """Frobenius norms per head of the Q, K, V gradient slices, and the layer's Q/K-to-V ratio.

    grad_ratio_qk_v = (mean_h |gQ_h| + mean_g |gK_g|) / (2 mean_g |gV_g|): a ratio of
    mean per-head norms, so grouped-query layers (fewer K/V heads) compare fairly.
    """
    norms = {f"grad_norm_{name}": _frobenius(g) for name, g in zip("qkv", (gq, gk, gv))}
    qk = norms["grad_norm_q"].mean(-1) + norms["grad_norm_k"].mean(-1)
    norms["grad_ratio_qk_v"] = qk / (2 * norms["grad_norm_v"].mean(-1))
    return norms


def update_metrics(before: Tensor, after: Tensor, name: str) -> dict[str, Tensor]:
    """sigma_1(dW)/sigma_1(W) and ||dW||_F/||W||_F of one update, dW = after - before.

    before, after: (..., rows, E), the whole projection of a layer (all heads).
    W is the matrix the update was applied to (``before``).
    """
    delta = after.double() - before.double()  # exact for float32 weights
    return {
        f"update_ratio_{name}": top_singular_value(delta) / top_singular_value(before),
        f"update_fro_{name}": torch.linalg.matrix_norm(delta) / torch.linalg.matrix_norm(before, dtype=torch.float64),
    }


# The matrices of one layer: (wq, wk, wv) per head, or {"q": ..., "k": ..., "v": ..., "o": ...}.
Projections = Sequence[Tensor] | Mapping[str, Tensor]


def _named(mats: Projections) -> list[tuple[str, Tensor]]:
    """(name, matrix) of one layer; a sequence is (wq, wk, wv). Per-head (heads, D, E) -> (heads*D, E)."""
    items = mats.items() if isinstance(mats, Mapping) else zip("qkv", mats)
    return [(name, _storage_order(w.flatten(0, -2))) for name, w in items]


def _storage_order(w: Tensor) -> Tensor:
    """w, or w^T where that is the order w's elements are stored in (GPT-2's Conv1D weights are stored
    (E, 3E): their row views are transposed). The update ratio and the Frobenius ratio do not change
    under a transpose, and copying and subtracting along contiguous rows is 3x faster here."""
    return w.mT if w.stride(-1) != 1 and w.stride(-2) == 1 else w


def qkv_update_metrics(before: Projections, after: Projections) -> dict[str, Tensor]:
    """:func:`update_metrics` of Q, K, V (and O) of one layer: per-head (heads, D, E) tensors in the order
    q, k, v, or a mapping such as :func:`diag.layouts.split_projections` gives (``"o"``: (E_out, H*D))."""
    out: dict[str, Tensor] = {}
    after_named = dict(_named(after))
    for name, b in _named(before):
        out.update(update_metrics(b, after_named[name], name))
    return out


# Bytes of one stacked group of matrices in the update-ratio computation: bounds the
# temporaries (the stacked weights after the step and their difference from before).
UPDATE_CHUNK_BYTES = 32 * 2**20


@dataclass
class _Chunk:
    members: list[tuple[int, str]]  # (layer position, "q" | "k" | "v" | "o") of each stacked matrix
    before: Tensor  # (c, rows, E) copies of the matrices before the optimizer step


class UpdateTracker:
    """Update ratios of the Q, K, V (and O) projections of many layers, batched across layers.

    ``snap = tracker.snapshot(layers)`` before the optimizer step (a copy of the matrices,
    stacked in groups of equal shape of at most ``chunk_bytes``); after it,
    ``tracker.measure(snap, layers_after)`` gives, per layer, the same metrics as
    :func:`qkv_update_metrics`: ``update_ratio_<x>`` = sigma_1(dW)/sigma_1(W) and
    ``update_fro_<x>`` = ||dW||_F/||W||_F for each matrix x of the layer, with W the matrix
    before the step (all heads at once). sigma_1 comes from :class:`diag.math.spectral.Sigma1`,
    warm-started across calls per group (so keep one tracker per run and feed it the
    layers in the same order). A snapshot is measured once: ``measure`` turns it into the update.
    layers: per layer, the per-head (wq, wk, wv) of :func:`diag.layouts.split_qkv`, or a
    mapping name -> matrix such as :func:`diag.layouts.split_projections` gives (``q``,
    ``k``, ``v`` and, where the layer has one, ``o``); the same names before and after.
    """

    def __init__(self, rtol: float = 1e-3, chunk_bytes: int = UPDATE_CHUNK_BYTES) -> None:
        self.sigma_w, self.sigma_d = Sigma1(rtol=rtol), Sigma1(rtol=rtol)
        self.chunk_bytes = chunk_bytes

    def snapshot(self, layers: Sequence[Projections]) -> list[_Chunk]:
        groups: dict[tuple, list[tuple[int, str, Tensor]]] = {}
        for i, mats in enumerate(layers):
            for name, flat in _named(mats):
                groups.setdefault((tuple(flat.shape), flat.dtype, flat.device), []).append((i, name, flat))
        chunks = []
        for members in groups.values():
            size = members[0][2].numel() * torch.finfo(_work_dtype(members[0][2])).bits // 8
            per_chunk = max(1, self.chunk_bytes // max(1, size))
            for start in range(0, len(members), per_chunk):
                part = members[start : start + per_chunk]
                before = torch.stack([w for _, _, w in part]).to(_work_dtype(part[0][2]))
                chunks.append(_Chunk([(i, name) for i, name, _ in part], before))
        return chunks

    def measure(self, snapshot: list[_Chunk], layers: Sequence[Projections]) -> list[dict[str, Tensor]]:
        out: list[dict[str, Tensor]] = [{} for _ in layers]
        mats = {(i, name): w for i, ws in enumerate(layers) for name, w in _named(ws)}
        for c, chunk in enumerate(snapshot):
            key = (c, tuple(chunk.before.shape))
            sigma_w, fro_w = self.sigma_w(chunk.before, key), _frobenius(chunk.before)
            # The snapshot becomes W_before - W_after = -dW in place (no second stacked copy: a fresh
            # allocation of that size costs more in page faults than the subtraction); the norms
            # do not see the sign.
            delta = chunk.before
            for j, m in enumerate(chunk.members):
                delta[j].sub_(mats[m])
            chunk.before = torch.empty(0)  # spent: it holds -dW now
            ratio = self.sigma_d(delta, key) / sigma_w
            fro = _frobenius(delta) / fro_w
            for j, (i, name) in enumerate(chunk.members):
                out[i][f"update_ratio_{name}"] = ratio[j]
                out[i][f"update_fro_{name}"] = fro[j]
        return out


def _frobenius(x: Tensor) -> Tensor:
    """||x||_F of each matrix of (..., rows, cols), float64: row norms in x's dtype (float32 at least;
    short sums, exact to ~1e-7), combined in float64. 25x faster than an upcast of the whole tensor on a CPU."""
    rows = torch.linalg.vector_norm(x, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).double()
    return torch.linalg.vector_norm(rows, dim=-1)


def _work_dtype(w: Tensor) -> torch.dtype:
    """The dtype of the snapshot and of dW: float32 for float32/bf16/fp16 weights (dW to one float32
    rounding per entry, exact where the two values are within a factor 2: Sterbenz); float64 stays."""
    return torch.float64 if w.dtype == torch.float64 else torch.float32
