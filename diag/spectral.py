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

import torch
from torch import Tensor

__all__ = [
    "qk_singular_values",
    "qk_singular_values_reference",
    "expand_kv_heads",
    "spectral_energy_concentration",
    "effective_rank",
    "stable_rank",
    "top_singular_value",
]


def expand_kv_heads(wk: Tensor, n_heads: int) -> Tensor:
    """Repeat key/value heads (G, ...) so that row h serves query head h: (H, ...)."""
    groups = wk.shape[0]
    if n_heads % groups:
        raise ValueError(f"{n_heads} query heads cannot share {groups} key/value heads evenly")
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
    n_heads, d_head = wq.shape[0], wq.shape[1]
    wq64, wk64 = wq.to(torch.float64), wk.to(torch.float64)
    gram_q, gram_k = wq64 @ wq64.transpose(1, 2), wk64 @ wk64.transpose(1, 2)  # (H, D, D), (G, D, D)
    # A non-finite weight makes its head's Gram non-finite: checked on D x D, not on D x E.
    finite_q, finite_k = _finite_heads(gram_q), _finite_heads(gram_k)
    eye = torch.eye(d_head, dtype=torch.float64, device=wq.device)
    gram_q = torch.where(finite_q[:, None, None], gram_q, eye)
    gram_k = expand_kv_heads(torch.where(finite_k[:, None, None], gram_k, eye), n_heads)
    low, info = torch.linalg.cholesky_ex(gram_q)  # G_q = L L^T
    sym = low.transpose(1, 2) @ gram_k @ low  # (H, D, D), eigenvalues sigma^2
    energy = torch.linalg.eigvalsh((sym + sym.transpose(1, 2)) / 2).flip(-1)  # descending
    sv = energy.clamp_min(0).sqrt()
    failed = (info != 0).nonzero().flatten()
    if failed.numel():
        sv[failed] = _qr_core_singular_values(wq64[failed], expand_kv_heads(wk64, n_heads)[failed])
    ok = finite_q & expand_kv_heads(finite_k, n_heads)
    return torch.where(ok[:, None], sv, torch.nan)


def _qr_core_singular_values(wq64: Tensor, wk64: Tensor) -> Tensor:
    """The same spectrum from thin QR factors: robust for singular heads, about twice as slow."""
    r_q = torch.linalg.qr(wq64.transpose(1, 2), mode="r").R  # (n, D, D)
    r_k = torch.linalg.qr(wk64.transpose(1, 2), mode="r").R
    return torch.linalg.svdvals(r_q @ r_k.transpose(1, 2))


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


def top_singular_value(w: Tensor, exact_below: int = 128, block: int = 8, rtol: float = 1e-6) -> Tensor:
    """sigma_1 of a matrix or a batch of matrices (..., m, n), float64; NaN if not finite.

    Small matrices (min(m, n) <= exact_below): the full singular values, float64.
    Larger ones: block Krylov on W^T W from a fixed start block (a private generator:
    the global RNG is untouched) with full re-orthogonalisation; the products run in
    float32, the Rayleigh-Ritz step (the top eigenvalue of W restricted to the basis)
    in float64. Every second block it checks whether the estimate changed by less than
    ``rtol`` relative (measured error on weights and AdamW updates of GPT-2-sized
    layers: below 1e-7; see tests/test_math.py); the full singular values if the
    subspace would grow past n. The estimate is a Ritz value: it does not exceed
    sigma_1 beyond float32 rounding.
    """
    if not bool(torch.isfinite(w).all()):
        return torch.full(w.shape[:-2], torch.nan, dtype=torch.float64, device=w.device)
    if min(w.shape[-2:]) <= exact_below:
        return torch.linalg.matrix_norm(w.to(torch.float64), ord=2)
    work = w.to(torch.float32)
    if work.shape[-2] < work.shape[-1]:
        work = work.transpose(-1, -2)  # (..., m, n) with m >= n: the Krylov space lives in R^n
    n = work.shape[-1]
    gen = torch.Generator(device=w.device).manual_seed(0)
    start = torch.randn(n, block, generator=gen, dtype=torch.float32, device=w.device)
    q = torch.linalg.qr(start.expand(*work.shape[:-2], n, block)).Q  # (..., n, b)
    wq = work @ q  # (..., m, b)
    basis, w_basis = q, wq
    estimate = torch.zeros(work.shape[:-2], dtype=torch.float64, device=w.device)
    while True:
        if basis.shape[-1] // block % 2 == 1:  # Rayleigh-Ritz every second block
            wb = w_basis.to(torch.float64)
            new = torch.linalg.eigvalsh(wb.transpose(-1, -2) @ wb)[..., -1].clamp_min(0).sqrt()
            if bool(((new - estimate).abs() <= rtol * new).all()):
                return new
            estimate = new
        if basis.shape[-1] + block > n:  # the Krylov space is nearly everything: do it exactly
            return torch.linalg.matrix_norm(w.to(torch.float64), ord=2)
        z = work.transpose(-1, -2) @ wq  # (..., n, b): the next Krylov block of W^T W
        for _ in range(2):  # re-orthogonalise twice against the whole basis
            z = z - basis @ (basis.transpose(-1, -2) @ z)
        q = torch.linalg.qr(z).Q
        wq = work @ q
        basis, w_basis = torch.cat([basis, q], -1), torch.cat([w_basis, wq], -1)
