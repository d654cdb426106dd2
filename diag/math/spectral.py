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

__all__ = [
    "qk_singular_values",
    "qk_singular_values_of_layers",
    "qk_singular_values_reference",
    "expand_kv_heads",
    "spectral_energy_concentration",
    "effective_rank",
    "stable_rank",
    "top_singular_value",
    "Sigma1",
    "grams",
    "in_threads",
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
    result does not depend on the split, so this only changes the time (144 matrices 64 x 64 on
    2 cores: 15 ms -> 8 ms on an idle machine, 27 -> 21 ms beside another busy process). Only for
    calls that stay on one core per matrix: cholesky, svdvals and eigvalsh of larger matrices call
    threaded BLAS inside and get slower (cholesky 4 ms -> 16 ms). fn returns a tensor or a tuple of
    tensors, each batched along dim 0.
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


def top_singular_value(w: Tensor, exact_below: int = 128, block: int = 16, rtol: float = 1e-6) -> Tensor:
    """sigma_1 of a matrix or a batch of matrices (..., m, n), float64; NaN if not finite.

    Cold-started :class:`Sigma1` with a tight tolerance (the slow, accurate setting);
    see there for the method.
    """
    return Sigma1(block=block, rtol=rtol, exact_below=exact_below, max_dim=None)(w)


class Sigma1:
    """sigma_1 of batches of matrices by block Krylov, warm-started from the previous call.

    ``sigma1(w, key)``: w is (..., m, n); returns (...) float64 (NaN where w is not
    finite). Matrices with min(m, n) <= ``exact_below`` get the full singular values in
    float64. Larger ones: block Krylov on W^T W with full re-orthogonalisation; the
    products run in float32, the Rayleigh-Ritz step takes the top eigenvalue of the
    projected Gram matrix in float64. The first block is the top ``block`` Ritz
    vectors of the previous call with the same ``key`` and shape (weights and
    optimizer updates change little between sampled steps, so the subspace goes on
    converging across calls), else a fixed random block from a private generator
    (the global RNG is untouched). It stops when one more block changes the estimate
    by less than ``rtol`` relative for every matrix of the batch, or, with
    ``max_dim``, when the subspace reaches that many vectors; if the subspace would
    grow past n it returns the exact float64 value. The estimate is a Ritz value: it
    never exceeds sigma_1 beyond float32 rounding.

    Measured (tests/math/test_math.py, benchmarks/overhead.py): on GPT-2-small Q/K/V
    weights and AdamW updates, rtol=1e-3 gives a relative error below 1e-3 cold and
    well below that warm; block 16 is where CPU batched matmuls stop being
    matrix-vector bound.
    """

    def __init__(
        self, block: int = 16, rtol: float = 1e-3, exact_below: int = 128, max_dim: int | None = 256
    ) -> None:
        if block < 1 or not rtol > 0:
            raise ValueError(f"Sigma1(block={block}, rtol={rtol}): expected block >= 1 and rtol > 0")
        self.block, self.rtol, self.exact_below, self.max_dim = block, rtol, exact_below, max_dim
        self._starts: dict[object, Tensor] = {}
        self.last_dim = 0  # the subspace size the last Krylov call ended with (for benchmarks/tests)

    def reset(self) -> None:
        self._starts.clear()

    def __call__(self, w: Tensor, key: object = None) -> Tensor:
        if min(w.shape[-2:]) <= self.exact_below:
            if not bool(torch.isfinite(w).all()):
                return self._per_matrix_nan_safe(w, key)
            return torch.linalg.matrix_norm(w.to(torch.float64), ord=2)
        work = w.to(torch.float32)
        if work.shape[-2] < work.shape[-1]:
            work = work.transpose(-1, -2)  # (..., m, n) with m >= n: the Krylov space lives in R^n
        # No finiteness pass over w first (it costs as much as a Krylov block): a non-finite entry makes
        # the products, hence the estimate, non-finite, or makes the small eigensolver fail.
        try:
            sigma, ritz = self._krylov(work, self._start(work, key))
        except RuntimeError:  # torch.linalg errors on NaN input
            sigma = None
        if sigma is None or not bool(torch.isfinite(sigma).all()):
            return self._per_matrix_nan_safe(w, key)
        if ritz is None:
            self._starts.pop(key, None)
            return torch.linalg.matrix_norm(w.to(torch.float64), ord=2)
        if key is not None:
            self._starts[key] = ritz
        return sigma

    def _per_matrix_nan_safe(self, w: Tensor, key: object) -> Tensor:
        """Non-finite matrices are NaN; the finite ones of the batch are still measured (cold)."""
        finite = torch.isfinite(w).flatten(-2).all(-1)
        out = torch.full(w.shape[:-2], torch.nan, dtype=torch.float64, device=w.device)
        if bool(finite.all()):  # finite, yet the estimate was not: measure exactly
            return torch.linalg.matrix_norm(w.to(torch.float64), ord=2)
        if bool(finite.any()):
            out[finite] = Sigma1(self.block, self.rtol, self.exact_below, self.max_dim)(w[finite])
        return out

    def _start(self, work: Tensor, key: object) -> Tensor:
        n = work.shape[-1]
        block = min(self.block, n)
        previous = self._starts.get(key) if key is not None else None
        if (previous is not None and previous.shape == (*work.shape[:-2], n, block)
                and previous.device == work.device and bool(torch.isfinite(previous).all())):
            return previous
        gen = torch.Generator(device=work.device).manual_seed(0)
        start = torch.randn(n, block, generator=gen, dtype=torch.float32, device=work.device)
        return start.expand(*work.shape[:-2], n, block)

    def _krylov(self, work: Tensor, start: Tensor) -> tuple[Tensor, Tensor | None]:
        n, block = work.shape[-1], start.shape[-1]
        q = torch.linalg.qr(start).Q  # (..., n, b)
        wq = work @ q  # (..., m, b)
        basis, w_basis = q, wq
        gram = (wq.transpose(-1, -2) @ wq).double()  # (..., d, d): the projected W^T W
        estimate = None
        while True:
            vals, vecs = torch.linalg.eigh((gram + gram.transpose(-1, -2)) / 2)
            new = vals[..., -1].clamp_min(0).sqrt()
            done = estimate is not None and bool(((new - estimate).abs() <= self.rtol * new).all())
            full = self.max_dim is not None and basis.shape[-1] + block > self.max_dim
            if done or full:
                self.last_dim = basis.shape[-1]
                ritz = basis @ vecs[..., -block:].to(basis.dtype)  # the top Ritz vectors: next start
                return new, ritz
            if basis.shape[-1] + block > n:  # the Krylov space is nearly everything: exact instead
                self.last_dim = n
                return new, None
            estimate = new
            z = work.transpose(-1, -2) @ wq  # (..., n, b): the next Krylov block of W^T W
            for _ in range(2):  # re-orthogonalise twice against the whole basis
                z = z - basis @ (basis.transpose(-1, -2) @ z)
            q = torch.linalg.qr(z).Q
            wq = work @ q
            cross = (w_basis.transpose(-1, -2) @ wq).double()  # (..., d, b)
            corner = (wq.transpose(-1, -2) @ wq).double()
            gram = torch.cat([torch.cat([gram, cross], -1), torch.cat([cross.transpose(-1, -2), corner], -1)], -2)
            basis, w_basis = torch.cat([basis, q], -1), torch.cat([w_basis, wq], -1)
