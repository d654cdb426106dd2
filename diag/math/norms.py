"""Matrix norms: sigma_1 by three estimators, and the Frobenius norm of batches of matrices.

Pure tensor math: no modules, no I/O. One family of sigma_1 estimators for everything that
needs the largest singular value of a weight or of an update:

* :func:`top_singular_value`: exact to ``rtol`` (the slow, accurate setting; references).
* :class:`Sigma1`: block Krylov warm-started across calls (the Monitor's update ratios and
  the checkpoint series, through :class:`diag.math.updates.UpdateTracker`).
* :func:`power_sigma1` with :func:`largest_row`: a fixed number of warm-started power
  iterations, two mat-vecs each (the spectral step limit, ``hooks.steplimit``: the paper's
  cheap estimate, a lower bound; docs/steplimit.md says how loose).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from diag.errors import ConfigError

__all__ = ["top_singular_value", "Sigma1", "power_sigma1", "largest_row", "frobenius", "Reduce"]

# Sums a tensor over the processes that each hold some rows of the same matrices (an all-reduce under
# tensor parallelism); every process calls it with tensors of the same shape, in the same order.
Reduce = Callable[[Tensor], Tensor]

_TINY = 1e-30
COLD_POWER = 8  # block power steps before a cold Krylov start: the space starts near the top


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
    (the global RNG is untouched) after ``COLD_POWER`` block power steps (two skinny
    products each: the cold start then needs 48-64 vectors instead of 112-144, and costs
    a third to a half less on GPT-2 shapes; benchmarks/overhead.py item 4). It stops when
    one more block changes the estimate by less than ``rtol`` relative for every matrix of the batch, or, with
    ``max_dim``, when the subspace reaches that many vectors; if the subspace would
    grow past n it returns the exact float64 value. The estimate is a Ritz value: it
    never exceeds sigma_1 beyond float32 rounding.

    Measured (tests/math/test_math.py, benchmarks/overhead.py): on GPT-2-small Q/K/V
    weights and AdamW updates, rtol=1e-3 gives a relative error below 1e-3 cold and
    well below that warm; block 16 is where CPU batched matmuls stop being
    matrix-vector bound.

    ``reduce`` (tensor parallelism): each process passes its rows (..., m_r, n) of matrices whose rows
    are split across processes and gets sigma_1 of the whole (..., m, n), the same on every process.
    Every sum over rows goes through ``reduce``: with n <= ``exact_below`` the Gram matrix W^T W
    (n x n, float64: exact, one reduce); else the same block Krylov on W^T W, its space in R^n, with one
    reduce per block (the next block and the projected Gram matrix's new entries together) and one per
    cold power step. The rows are never transposed to the short side here.
    """

    def __init__(
        self, block: int = 16, rtol: float = 1e-3, exact_below: int = 128, max_dim: int | None = 256,
        reduce: Reduce | None = None,
    ) -> None:
        if block < 1 or not rtol > 0:
            raise ConfigError(f"Sigma1(block={block}, rtol={rtol}): expected block >= 1 and rtol > 0, e.g. "
                              "Sigma1(block=16, rtol=1e-3)")
        self.block, self.rtol, self.exact_below, self.max_dim = block, rtol, exact_below, max_dim
        self.reduce = reduce
        self._starts: dict[object, Tensor] = {}
        self.last_dim = 0  # the subspace size the last Krylov call ended with (for benchmarks/tests)

    def __call__(self, w: Tensor, key: object = None) -> Tensor:
        if self.reduce is not None:
            return self._split_rows(w, key)
        if min(w.shape[-2:]) <= self.exact_below:  # exact; a non-finite matrix is NaN, without a host read
            finite = torch.isfinite(w).flatten(-2).all(-1)
            exact = torch.linalg.matrix_norm(torch.where(finite[..., None, None], w, 0).to(torch.float64), ord=2)
            return torch.where(finite, exact, torch.nan)
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

    def _split_rows(self, w: Tensor, key: object) -> Tensor:
        """sigma_1 of matrices whose rows are split across processes (see the class docstring); NaN for the
        whole batch when any of it is not finite (every process takes the same branch: it sees the reduced sums)."""
        if w.shape[-1] <= self.exact_below:
            return self._gram_split(w)
        work = w.to(torch.float32)
        try:
            sigma, ritz = self._krylov(work, self._start(work, key))
        except RuntimeError:  # torch.linalg errors on NaN input, on every process alike
            sigma, ritz = None, None
        if sigma is None or not bool(torch.isfinite(sigma).all()):
            self._starts.pop(key, None)
            return torch.full(w.shape[:-2], torch.nan, dtype=torch.float64, device=w.device)
        if ritz is None:  # the Krylov space would be nearly all of R^n: exact instead
            self._starts.pop(key, None)
            return self._gram_split(w)
        if key is not None:
            self._starts[key] = ritz
        return sigma

    def _gram_split(self, w: Tensor) -> Tensor:
        """Exact: the top eigenvalue of W^T W (n x n, float64), summed over every process's rows."""
        w64 = w.to(torch.float64)
        gram = self.reduce(w64.transpose(-1, -2) @ w64)
        finite = torch.isfinite(gram).flatten(-2).all(-1)
        vals = torch.linalg.eigvalsh(torch.where(finite[..., None, None], gram, 0))
        return torch.where(finite, vals[..., -1].clamp_min(0).sqrt(), torch.nan)

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
        start = start.expand(*work.shape[:-2], n, block)
        for _ in range(COLD_POWER):  # block power steps: two skinny products each, no eigensolver
            gram_start = work.transpose(-1, -2) @ (work @ start)  # (..., n, b): summed over every process's rows
            start = torch.linalg.qr(gram_start if self.reduce is None else self.reduce(gram_start)).Q
        return start

    def _krylov(self, work: Tensor, start: Tensor) -> tuple[Tensor, Tensor | None]:
        """Block Krylov on W^T W from ``start``: (sigma_1, the top Ritz vectors for the next start), or
        (sigma_1 so far, None) when the space would be nearly all of R^n. Each block's sums over rows (the
        next block W^T W q and the projected Gram matrix's new entries) go through ``reduce`` in one call
        when the rows are split across processes."""
        reduce = self.reduce if self.reduce is not None else _whole
        n, block = work.shape[-1], start.shape[-1]
        q = torch.linalg.qr(start).Q  # (..., n, b), the same on every process
        wq = work @ q  # (..., m, b): this process's rows
        both = reduce(torch.cat([work.transpose(-1, -2) @ wq, wq.transpose(-1, -2) @ wq], -2))
        z, gram = both[..., :n, :], both[..., n:, :].double()  # (..., n, b), (..., b, b): the projected W^T W
        basis, w_basis = q, wq
        estimate = None
        while True:
            vals, vecs = torch.linalg.eigh((gram + gram.transpose(-1, -2)) / 2)
            new = vals[..., -1].clamp_min(0).sqrt()
            done = estimate is not None and bool(((new - estimate).abs() <= self.rtol * new).all())
            full = self.max_dim is not None and basis.shape[-1] + block > self.max_dim
            if done or full:
                self.last_dim = basis.shape[-1]
                return new, basis @ vecs[..., -block:].to(basis.dtype)  # the top Ritz vectors: next start
            if basis.shape[-1] + block > n:  # the Krylov space is nearly everything: exact instead
                self.last_dim = n
                return new, None
            estimate = new
            for _ in range(2):  # re-orthogonalise twice against the whole basis
                z = z - basis @ (basis.transpose(-1, -2) @ z)
            q = torch.linalg.qr(z).Q
            wq = work @ q
            both = reduce(torch.cat([work.transpose(-1, -2) @ wq, w_basis.transpose(-1, -2) @ wq,
                                     wq.transpose(-1, -2) @ wq], -2))
            d = basis.shape[-1]
            z, cross, corner = both[..., :n, :], both[..., n:n + d, :].double(), both[..., n + d:, :].double()
            gram = torch.cat([torch.cat([gram, cross], -1), torch.cat([cross.transpose(-1, -2), corner], -1)], -2)
            basis, w_basis = torch.cat([basis, q], -1), torch.cat([w_basis, wq], -1)


def _whole(sums: Tensor) -> Tensor:
    """The sums over rows when one process holds every row: as they are."""
    return sums


def power_sigma1(a: Tensor, v: Tensor, iters: int, rows: Reduce | None = None,
                 cols: Reduce | None = None) -> tuple[Tensor, Tensor]:
    """Warm-started power iteration on a (B, m, n) batch from k unit start vectors v (B, k, n), each
    iterated on its own: sigma_1 (the largest of the k estimates |A^T u|, u = Av/|Av|: a lower bound)
    and the right vector that gave it (a start vector stays where A v = 0).

    rows / cols: where the matrices' rows (columns) are split across processes (tensor parallelism), the
    sum over them; each process passes its block (B, m_r, n_c) and its columns of v, and gets the same
    sigma_1 as one process holding the whole (to float rounding: the sums run in another order), and its
    columns of the vector. Two reduces per iteration for each split."""
    vecs = v.transpose(1, 2)  # (B, n, k)
    sigma = torch.zeros(v.shape[:2], dtype=a.dtype, device=a.device)  # (B, k)
    for _ in range(iters):
        u = torch.bmm(a, vecs)  # (B, m, k)
        if cols is not None:
            u = cols(u)
        norm = u.norm(dim=1, keepdim=True) if rows is None else rows(u.square().sum(1, keepdim=True)).sqrt()
        u = u / norm.clamp_min(_TINY)
        w = torch.bmm(a.transpose(1, 2), u)  # (B, n, k)
        if rows is not None:
            w = rows(w)
        sigma = w.norm(dim=1) if cols is None else cols(w.square().sum(1)).sqrt()  # (B, k)
        vecs = torch.where(sigma.unsqueeze(1) > 0, w / sigma.clamp_min(_TINY).unsqueeze(1), vecs)
    best = sigma.argmax(dim=1)  # (B,)
    return sigma.max(dim=1).values, vecs[torch.arange(a.shape[0], device=a.device), :, best]


def largest_row(a: Tensor, fallback: Tensor) -> Tensor:
    """The unit largest row of each (B, m, n) matrix: a second start in an update's row space that catches
    a step whose top direction jumped away from the warm start (``fallback`` (B, n) where the matrix is 0)."""
    norms = a.norm(dim=2)  # (B, m)
    top = norms.max(dim=1)
    row = a[torch.arange(a.shape[0], device=a.device), top.indices]  # (B, n)
    return torch.where(top.values.unsqueeze(1) > 0, row / top.values.clamp_min(_TINY).unsqueeze(1), fallback)


def frobenius(x: Tensor) -> Tensor:
    """||x||_F of each matrix of (..., rows, cols), float64: row norms in x's dtype (float32 at least;
    short sums, exact to ~1e-7), combined in float64: faster than an upcast of the whole tensor on a CPU
    (docs/cost.md#implementation-choices)."""
    rows = torch.linalg.vector_norm(x, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).double()
    return torch.linalg.vector_norm(rows, dim=-1)
