"""The weight-side signal families, batched: spectra, gradient norms, update ratios.

Pure functions from per-head tensors (see :func:`diag.layouts.split_qkv`) to
dictionaries of float64 tensors; the monitor and the checkpoint analysis call
the same functions, so their numbers agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.spectral import (
    Sigma1,
    effective_rank,
    qk_singular_values,
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
    sv = sv.reshape(*lead, wq.shape[-3], sv.shape[-1])
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
        qs, ks = zip(*(qk[i] for i in members))
        batched = spectrum_metrics(torch.stack(qs), torch.stack(ks), sec_top)
        for j, i in enumerate(members):
            out[i] = {name: t[j] for name, t in batched.items()}
    return out


def grad_metrics(gq: Tensor, gk: Tensor, gv: Tensor) -> dict[str, Tensor]:
    """Frobenius norms per head of the Q, K, V gradient slices, and the layer's Q/K-to-V ratio.

    grad_ratio_qk_v = (mean_h |gQ_h| + mean_g |gK_g|) / (2 mean_g |gV_g|): a ratio of
    mean per-head norms, so grouped-query layers (fewer K/V heads) compare fairly.
    """
    norms = {
        "grad_norm_q": torch.linalg.vector_norm(gq.double(), dim=(-2, -1)),
        "grad_norm_k": torch.linalg.vector_norm(gk.double(), dim=(-2, -1)),
        "grad_norm_v": torch.linalg.vector_norm(gv.double(), dim=(-2, -1)),
    }
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


def qkv_update_metrics(before: Sequence[Tensor], after: Sequence[Tensor]) -> dict[str, Tensor]:
    """:func:`update_metrics` of Q, K and V of one layer, from per-head (heads, D, E) tensors."""
    out: dict[str, Tensor] = {}
    for name, b, a in zip("qkv", before, after):
        out.update(update_metrics(b.flatten(0, 1), a.flatten(0, 1), name))
    return out


# Bytes of one stacked group of matrices in the update-ratio computation: bounds the
# temporaries (the stacked weights after the step and their difference from before).
UPDATE_CHUNK_BYTES = 32 * 2**20


@dataclass
class _Chunk:
    members: list[tuple[int, str]]  # (layer position, "q" | "k" | "v") of each stacked matrix
    before: Tensor  # (c, rows, E) copies of the matrices before the optimizer step


class UpdateTracker:
    """Update ratios of the Q, K, V projections of many layers, batched across layers.

    ``snap = tracker.snapshot(qkv)`` before the optimizer step (a copy of the matrices,
    stacked in groups of equal shape of at most ``chunk_bytes``); after it,
    ``tracker.measure(snap, qkv_after)`` gives, per layer, the same metrics as
    :func:`qkv_update_metrics`: ``update_ratio_{q,k,v}`` = sigma_1(dW)/sigma_1(W) and
    ``update_fro_{q,k,v}`` = ||dW||_F/||W||_F, with W the matrix before the step. sigma_1
    comes from :class:`diag.spectral.Sigma1`, warm-started across calls per group (so
    keep one tracker per run and feed it the layers in the same order).
    qkv: per layer, the per-head (wq, wk, wv) of :func:`diag.layouts.split_qkv`.
    """

    def __init__(self, rtol: float = 1e-3, chunk_bytes: int = UPDATE_CHUNK_BYTES) -> None:
        self.sigma_w, self.sigma_d = Sigma1(rtol=rtol), Sigma1(rtol=rtol)
        self.chunk_bytes = chunk_bytes

    def snapshot(self, qkv: Sequence[Sequence[Tensor]]) -> list[_Chunk]:
        groups: dict[tuple, list[tuple[int, str, Tensor]]] = {}
        for i, mats in enumerate(qkv):
            for name, w in zip("qkv", mats):
                flat = w.flatten(0, 1)
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

    def measure(self, snapshot: list[_Chunk], qkv: Sequence[Sequence[Tensor]]) -> list[dict[str, Tensor]]:
        out: list[dict[str, Tensor]] = [{} for _ in qkv]
        mats = {(i, name): w for i, ws in enumerate(qkv) for name, w in zip("qkv", ws)}
        for c, chunk in enumerate(snapshot):
            delta = torch.stack([mats[m].flatten(0, 1) for m in chunk.members]).to(chunk.before.dtype)
            delta -= chunk.before  # in place: the stacked copy after the step becomes dW
            key = (c, tuple(chunk.before.shape))
            ratio = self.sigma_d(delta, key) / self.sigma_w(chunk.before, key)
            fro = _frobenius(delta) / _frobenius(chunk.before)
            for j, (i, name) in enumerate(chunk.members):
                out[i][f"update_ratio_{name}"] = ratio[j]
                out[i][f"update_fro_{name}"] = fro[j]
        return out


def _frobenius(x: Tensor) -> Tensor:
    """||x||_F of each matrix of (c, rows, cols), float64: row norms in x's dtype (short sums, exact to
    ~1e-7), combined in float64. 25x faster than an upcast of the whole tensor on a CPU."""
    rows = torch.linalg.vector_norm(x, dim=-1).double()
    return torch.linalg.vector_norm(rows, dim=-1)


def _work_dtype(w: Tensor) -> torch.dtype:
    """float32 holds the difference of two float32/bf16/fp16 weights exactly (Sterbenz); float64 stays."""
    return torch.float64 if w.dtype == torch.float64 else torch.float32
