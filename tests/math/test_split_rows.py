"""sigma_1, the update ratios and the power iteration of matrices whose rows or columns are split across processes
(tensor parallelism) equal the one-process values.

The processes are threads here: each holds a block of every matrix, and the reduce sums the blocks' tensors
across threads (a barrier, then every thread adds the contributions in thread order, as an all-reduce gives
every rank the same sum). The references: float64 full SVD, and the one-process estimators on the whole matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from diag.math.norms import Sigma1, power_sigma1
from diag.math.updates import UpdateTracker


class ThreadSum:
    """An all-reduce (sum) between ``n`` threads; also counts the calls."""

    def __init__(self, n: int) -> None:
        self.barrier, self.slots, self.calls = threading.Barrier(n), [None] * n, [0] * n

    def of(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls[i] += 1
            self.slots[i] = t.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()
            return total

        return reduce


def _in_threads(n: int, work: Callable[[int], object]) -> list:
    out, errors = [None] * n, []

    def run(i: int) -> None:
        try:
            out[i] = work(i)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def _matrices(batch: int, m: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # a few strong directions over noise: sigma_1 well separated, as trained attention weights
    low = torch.randn(batch, m, 3, generator=gen) @ torch.randn(batch, 3, n, generator=gen)
    return low + 0.1 * torch.randn(batch, m, n, generator=gen)


@pytest.mark.parametrize(("m", "n", "parts"), [(48, 32, 2), (40, 96, 4), (300, 160, 2), (96, 200, 3)])
def test_sigma1_of_rows_split_across_processes(m, n, parts):
    """n <= 128: the Gram matrix (exact, one reduce); n > 128: block Krylov with one reduce per block. Every process
    gets the same value; it is sigma_1 of the whole matrix (float64 SVD) to the estimator's rtol (1e-6 here)."""
    w = _matrices(3, m, n, seed=m + n)
    want = torch.linalg.matrix_norm(w.double(), ord=2)
    rows = torch.tensor_split(w, parts, dim=1)  # uneven blocks where m % parts
    sums = ThreadSum(parts)
    got = _in_threads(parts, lambda i: Sigma1(rtol=1e-6, reduce=sums.of(i))(rows[i], key="w"))
    for g in got:
        assert torch.equal(g, got[0])  # the same on every process
    torch.testing.assert_close(got[0], want, rtol=1e-6 if n <= 128 else 2e-5, atol=0)
    assert len(set(sums.calls)) == 1  # every process took part in every sum
    if n <= 128:
        assert sums.calls[0] == 1


def test_sigma1_split_warm_start_and_nan():
    """A second call on the same key starts from the first call's Ritz vectors (fewer reduces); a non-finite block
    on one process makes the value NaN on every process, and the next call starts cold again."""
    w = _matrices(2, 300, 160, seed=7)
    rows = torch.tensor_split(w, 2, dim=1)
    sums = ThreadSum(2)
    est = [Sigma1(rtol=1e-3, reduce=sums.of(i)) for i in range(2)]
    _in_threads(2, lambda i: est[i](rows[i], key="w"))
    cold = sums.calls[0]
    _in_threads(2, lambda i: est[i](rows[i] * 1.001, key="w"))
    assert sums.calls[0] - cold < cold
    bad = [rows[0].clone(), rows[1]]
    bad[0][1, 0, 0] = float("nan")
    got = _in_threads(2, lambda i: est[i](bad[i], key="w"))
    assert all(bool(torch.isnan(g).all()) for g in got)
    assert "w" not in est[0]._starts and "w" not in est[1]._starts


@pytest.mark.parametrize("split", ["rows", "cols", "both"])
def test_power_iteration_split_equals_one_process(split):
    """The step limit's power iteration on blocks of split matrices, from the one-process start vectors (each
    process its columns of them), gives the one-process sigma_1 and right vector (to float32 rounding)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, 24, 20, generator=gen)
    v = torch.randn(4, 2, 20, generator=gen)
    v = v / v.norm(dim=2, keepdim=True)
    want_s, want_v = power_sigma1(a, v, iters=5)
    grid = {"rows": (2, 1), "cols": (1, 2), "both": (2, 2)}[split]
    row_blocks, col_blocks = grid
    n = row_blocks * col_blocks
    row_sums = [ThreadSum(row_blocks) for _ in range(col_blocks)]  # ranks sharing columns j sum over rows
    col_sums = [ThreadSum(col_blocks) for _ in range(row_blocks)]

    def work(i: int):
        r, c = divmod(i, col_blocks)
        block = torch.tensor_split(torch.tensor_split(a, row_blocks, dim=1)[r], col_blocks, dim=2)[c]
        start = torch.tensor_split(v, col_blocks, dim=2)[c]
        rows = row_sums[c].of(r) if row_blocks > 1 else None
        cols = col_sums[r].of(c) if col_blocks > 1 else None
        return power_sigma1(block, start, iters=5, rows=rows, cols=cols)

    got = _in_threads(n, work)
    for i, (s, vec) in enumerate(got):
        c = i % col_blocks
        torch.testing.assert_close(s, want_s, rtol=1e-5, atol=0)
        torch.testing.assert_close(vec, torch.tensor_split(want_v, col_blocks, dim=1)[c], rtol=1e-4, atol=1e-6)


def test_update_tracker_split_equals_one_process():
    """Update ratios of matrices whose rows two processes share (W_Q, W_K, W_V per head block, W_O transposed):
    sigma_1 and Frobenius ratios equal the one-process tracker's on the whole matrices."""
    gen = torch.Generator().manual_seed(5)
    before = {"q": torch.randn(4, 8, 32, generator=gen), "k": torch.randn(2, 8, 32, generator=gen),
              "o": torch.randn(32, 32, generator=gen)}
    after = {name: w + 0.01 * torch.randn(w.shape, generator=gen) for name, w in before.items()}
    want = UpdateTracker().measure(UpdateTracker().snapshot([before]), [after])[0]

    def block(mats: dict, i: int) -> dict:
        return {"q": mats["q"][2 * i : 2 * i + 2], "k": mats["k"][i : i + 1],
                "o": mats["o"][:, 16 * i : 16 * i + 16].mT}

    sums = ThreadSum(2)

    def work(i: int) -> dict:
        tracker = UpdateTracker(reduce=sums.of(i))
        return tracker.measure(tracker.snapshot([block(before, i)]), [block(after, i)])[0]

    got = _in_threads(2, work)
    for g in got:
        assert set(g) == set(want)
        for name in want:
            torch.testing.assert_close(g[name], want[name], rtol=1e-5, atol=0)
