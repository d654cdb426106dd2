"""Spectra of the per-head bilinear forms W_h = Wq_h^T Wk_h, and summaries of a spectrum.

Pure tensor math: no modules, no I/O. Shapes use H for query heads, G for key/value
heads (grouped-query attention pairs query head h with key head h // (H // G)),
D for the head dimension and E for the model (input) dimension.

The nonzero singular values of Wq_h^T Wk_h (E x E, rank <= D) equal those of the
D x D core R_q R_k^T, where Wq_h^T = Q_q R_q and Wk_h^T = Q_k R_k are thin QR
factorisations: Wq_h^T Wk_h = Q_q (R_q R_k^T) Q_k^T and Q_q, Q_k have orthonormal
columns. Everything is computed in float64, so the spectrum is exact to float64
rounding of the weights (condition numbers up to 1e3 are tested to 1e-5 relative).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from diag.errors import ConfigError

__all__ = [
    "qk_singular_values",
    "qk_singular_values_of_layers",
    "qk_singular_values_reference",
    "expand_kv_heads",
    "spectral_energy_concentration",
    "effective_rank",
    "stable_rank",
    "grams",
    "in_threads",
]


def expand_kv_heads(wk: Tensor, n_heads: int) -> Tensor:
    """Repeat key/value heads (G, ...) so that row h serves query head h: (H, ...)."""
    groups = wk.shape[0]
    if n_heads % groups:
        raise ConfigError(f"expand_kv_heads: {n_heads} query heads cannot share {groups} key/value heads evenly; "
                          f"the query head count must be a multiple of the key/value head count (check n_heads and "
                          f"n_kv_heads of the layout)")
    return wk.repeat_interleave(n_heads // groups, dim=0)


def _finite_heads(w: Tensor) -> Tensor:
    return torch.isfinite(w).flatten(1).all(dim=1)


def qk_singular_values(wq: Tensor, wk: Tensor) -> Tensor:
    """All D singular values of Wq_h^T Wk_h for every head, descending, float64.

    wq: (H, D, E) query projection rows per head; wk: (G, D, E) key rows per key head.
    Returns (H, D). Heads with non-finite weights get NaN.

    Route: the Gram matrices G_q = Wq_h Wq_h^T and G_k (D x D, float64) and the
    Cholesky factor G_q = L L^T give R_q = L^T, so the squared singular values
    of the core R_q R_k^T are the eigenvalues of the symmetric L^T G_k L. Heads
    whose G_q is singular (a dead or rank-deficient head) take the QR route.
    """
    return qk_singular_values_of_layers([(wq, wk)])


def qk_singular_values_of_layers(qk: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """:func:`qk_singular_values` of several layers of equal shapes in one batched call, (L*H, D).

    qk: per layer (wq (H, D, E), wk (G, D, E)), any strides: each layer's Grams are formed
    from its weights as they are (no stacked copy of all layers' weights first).
    """
    n_heads, d_head = qk[0][0].shape[0], qk[0][0].shape[1]
    gram_q = torch.cat([grams(wq) for wq, _ in qk])  # (L*H, D, D)
    gram_k = torch.cat([grams(wk) for _, wk in qk])  # (L*G, D, D)
    # A non-finite weight makes its head's Gram non-finite: checked on D x D, not on D x E.
    finite_q, finite_k = _finite_heads(gram_q), _finite_heads(gram_k)
    eye = torch.eye(d_head, dtype=torch.float64, device=gram_q.device)
    gram_q = torch.where(finite_q[:, None, None], gram_q, eye)
    # Row l*H + h of the queries pairs with row l*G + h // (H/G) of the keys: one repeat serves all layers.
    n_all = gram_q.shape[0]
    gram_k = expand_kv_heads(torch.where(finite_k[:, None, None], gram_k, eye), n_all)
    low, info = torch.linalg.cholesky_ex(gram_q)  # G_q = L L^T (not in threads: its BLAS calls are threaded)
    sym = low.transpose(1, 2) @ gram_k @ low  # (L*H, D, D), eigenvalues sigma^2
    energy = in_threads(torch.linalg.eigvalsh, (sym + sym.transpose(1, 2)) / 2).flip(-1)  # descending
    sv = energy.clamp_min(0).sqrt()
    failed = (info != 0).nonzero().flatten()
    if failed.numel():
        wq_all = torch.cat([wq for wq, _ in qk])
        wk_all = torch.cat([expand_kv_heads(wk, n_heads) for _, wk in qk])
        sv[failed] = _qr_core_singular_values(wq_all[failed].double(), wk_all[failed].double())
    ok = finite_q & expand_kv_heads(finite_k, n_all)
    return torch.where(ok[:, None], sv, torch.nan)


# Bytes of float64 weights converted at a time for the Gram matrices. One small buffer, reused:
# a fresh float64 copy of all GPT-2-small heads costs more (page faults) than the Grams themselves.
GRAM_CHUNK_BYTES = 4 * 2**20


def grams(w: Tensor) -> Tensor:
    """W_h W_h^T for each (D, E) matrix of w (n, D, E), float64 (exact products of the weights).

    The weights are converted to float64 a few matrices at a time through one buffer.
    """
    n, d, e = w.shape
    if w.dtype == torch.float64:
        return w @ w.transpose(1, 2)
    out = torch.empty(n, d, d, dtype=torch.float64, device=w.device)
    per = max(1, GRAM_CHUNK_BYTES // max(1, 8 * d * e))
    buf = torch.empty(min(per, n), d, e, dtype=torch.float64, device=w.device)
    for start in range(0, n, per):
        part = buf[: min(per, n - start)]
        part.copy_(w[start : start + per])
        torch.bmm(part, part.transpose(1, 2), out=out[start : start + part.shape[0]])
    return out


def in_threads(fn: Callable[[Tensor], Any], batch: Tensor) -> Any:
    """fn on a batch of small matrices, split across up to ``torch.get_num_threads()`` threads on a CPU.

    torch runs a batched eigvalsh of small matrices one after another on one core; each matrix's
    result does not depend on the split, so this only changes the time (measured:
    docs/cost.md#implementation-choices). Only for calls that stay on one core per matrix: cholesky,
    svdvals and eigvalsh of larger matrices call threaded BLAS inside and get slower. fn returns a
    tensor or a tuple of tensors, each batched along dim 0.
    """
    parts = min(torch.get_num_threads(), batch.shape[0] // 8)
    if batch.device.type != "cpu" or parts < 2:
        return fn(batch)
    chunks = batch.tensor_split(parts)
    results: list[Any] = [None] * parts
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(chunks[i])
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    if isinstance(results[0], Tensor):
        return torch.cat(results)
    return type(results[0])(tuple(torch.cat(field) for field in zip(*results)))


def _qr_core_singular_values(wq64: Tensor, wk64: Tensor) -> Tensor:
    """The same spectrum from thin QR factors: robust for singular heads, about twice as slow."""
    r_q = torch.linalg.qr(wq64.transpose(1, 2), mode="r").R  # (n, min(E, D), D)
    r_k = torch.linalg.qr(wk64.transpose(1, 2), mode="r").R
    sv = torch.linalg.svdvals(r_q @ r_k.transpose(1, 2))  # (n, min(E, D))
    return torch.nn.functional.pad(sv, (0, wq64.shape[1] - sv.shape[-1]))  # E < D: the other D - E are 0


def qk_singular_values_reference(wq_h: Tensor, wk_h: Tensor) -> Tensor:
    """Slow, obviously correct: full SVD of the E x E product of one head, float64."""
    product = wq_h.double().T @ wk_h.double()  # (E, E)
    return torch.linalg.svdvals(product)[: wq_h.shape[0]]


def spectral_energy_concentration(sv: Tensor, top: int) -> Tensor:
    """SEC_s = (s_1^2 + ... + s_s^2) / sum_i s_i^2 over the last dimension (Qi et al., 2025); 0 if all s_i = 0."""
    energy = sv.square()
    total = energy.sum(-1)
    return _zero_if_no_energy(energy[..., :top].sum(-1) / total, total)


def effective_rank(sv: Tensor) -> Tensor:
    """exp(-sum p_i log p_i) with p_i = s_i / sum_j s_j (Roy & Vetterli, 2007); 0 if all s_i = 0."""
    total = sv.sum(-1, keepdim=True)
    p = sv / total
    return _zero_if_no_energy(torch.exp(-torch.special.xlogy(p, p).sum(-1)), total[..., 0])


def stable_rank(sv: Tensor) -> Tensor:
    """||W||_F^2 / sigma_1^2; 0 if W = 0."""
    total = sv.square().sum(-1)
    return _zero_if_no_energy(total / sv[..., 0].square(), total)


def _zero_if_no_energy(value: Tensor, total: Tensor) -> Tensor:
    """A dead head (all singular values exactly 0, e.g. all-zero Wq rows) has rank 0 and no
    concentrated energy: 0 rather than 0/0 = NaN. NaN totals (non-finite weights) stay NaN."""
    return torch.where(total == 0, torch.zeros_like(value), value)
