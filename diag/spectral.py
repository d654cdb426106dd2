"""Spectra of the per-head bilinear forms W_h = Wq_h^T Wk_h, and summaries of a spectrum.

Pure tensor math: no modules, no I/O. Shapes use H for query heads, G for key/value
heads (grouped-query attention pairs query head h with key head h // (H // G)),
D for the head dimension and E for the model (input) dimension.

The nonzero singular values of Wq_h^T Wk_h (E x E, rank <= D) equal those of the
D x D core R_q R_k^T, where Wq_h^T = Q_q R_q and Wk_h^T = Q_k R_k are thin QR
factorisations: Wq_h^T Wk_h = Q_q (R_q R_k^T) Q_k^T and Q_q, Q_k have orthonormal
columns. The core is computed in float64, so the spectrum is exact to float64
rounding of the float32 weights.
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
    """
    n_heads, d_head, _ = wq.shape
    finite_q, finite_k = _finite_heads(wq), _finite_heads(wk)
    wq64 = torch.where(finite_q[:, None, None], wq, 0).to(torch.float64)
    wk64 = torch.where(finite_k[:, None, None], wk, 0).to(torch.float64)
    r_q = torch.linalg.qr(wq64.transpose(1, 2), mode="r").R  # (H, D, D) upper triangular
    r_k = torch.linalg.qr(wk64.transpose(1, 2), mode="r").R  # (G, D, D)
    core = r_q @ expand_kv_heads(r_k, n_heads).transpose(1, 2)  # (H, D, D)
    sv = torch.linalg.svdvals(core)  # (H, D) descending
    ok = finite_q & expand_kv_heads(finite_k, n_heads)
    return torch.where(ok[:, None], sv, torch.nan)


def qk_singular_values_reference(wq_h: Tensor, wk_h: Tensor) -> Tensor:
    """Slow, obviously correct: full SVD of the E x E product of one head, float64."""
    product = wq_h.double().T @ wk_h.double()  # (E, E)
    return torch.linalg.svdvals(product)[: wq_h.shape[0]]


def spectral_energy_concentration(sv: Tensor, top: int) -> Tensor:
    """SEC_s = (s_1^2 + ... + s_s^2) / sum_i s_i^2 over the last dimension (Qi et al., 2025)."""
    energy = sv.square()
    return energy[..., :top].sum(-1) / energy.sum(-1)


def effective_rank(sv: Tensor) -> Tensor:
    """exp(-sum p_i log p_i) with p_i = s_i / sum_j s_j (Roy & Vetterli, 2007)."""
    p = sv / sv.sum(-1, keepdim=True)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def stable_rank(sv: Tensor) -> Tensor:
    """||W||_F^2 / sigma_1^2."""
    return sv.square().sum(-1) / sv[..., 0].square()


def top_singular_value(w: Tensor, exact_below: int = 128, block: int = 8, rtol: float = 1e-6) -> Tensor:
    """sigma_1 of a matrix or a batch of matrices (..., m, n), float64; NaN if not finite.

    Small matrices (min(m, n) <= exact_below): the full singular values. Larger ones:
    block Krylov on W^T W from a fixed start block (a private generator: the global
    RNG is untouched) with full re-orthogonalisation, then Rayleigh-Ritz; iterates
    until the estimate changes by less than ``rtol`` relative (measured error about
    ``rtol / 10``; see tests/test_math.py), falling back to the full singular values
    if the subspace would grow past n. The estimate never exceeds sigma_1 (a Ritz value).
    """
    w64 = w.to(torch.float64)
    if not bool(torch.isfinite(w64).all()):
        return torch.full(w.shape[:-2], torch.nan, dtype=torch.float64, device=w.device)
    if min(w64.shape[-2:]) <= exact_below:
        return torch.linalg.matrix_norm(w64, ord=2)
    if w64.shape[-2] < w64.shape[-1]:
        w64 = w64.transpose(-1, -2)  # (..., m, n) with m >= n: the Krylov space lives in R^n
    n = w64.shape[-1]
    gen = torch.Generator(device=w64.device).manual_seed(0)
    start = torch.randn(n, block, generator=gen, dtype=torch.float64, device=w64.device)
    q = torch.linalg.qr(start.expand(*w64.shape[:-2], n, block)).Q  # (..., n, b)
    wq = w64 @ q  # (..., m, b)
    basis, w_basis = q, wq
    estimate = torch.zeros(w64.shape[:-2], dtype=torch.float64, device=w64.device)
    while True:
        gram = w_basis.transpose(-1, -2) @ w_basis  # (..., k, k): W restricted to the basis
        new = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
        if bool(((new - estimate).abs() <= rtol * new).all()):
            return new
        if basis.shape[-1] + block > n:  # the Krylov space is nearly everything: do it exactly
            return torch.linalg.matrix_norm(w64, ord=2)
        estimate = new
        z = w64.transpose(-1, -2) @ wq  # (..., n, b): the next Krylov block of W^T W
        for _ in range(2):  # re-orthogonalise twice against the whole basis
            z = z - basis @ (basis.transpose(-1, -2) @ z)
        q = torch.linalg.qr(z).Q
        wq = w64 @ q
        basis, w_basis = torch.cat([basis, q], -1), torch.cat([w_basis, wq], -1)
