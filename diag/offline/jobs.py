"""A series spread over processes (``--jobs N``): each process computes whole units, the caller writes.

The plan (which checkpoints, which layers) is made once, in the calling process; each unit (a checkpoint and
the one before it, :mod:`diag.offline.units`) is computed by one of ``N`` worker processes, started with
``spawn`` (no state inherited from the caller). Units are pure functions of their checkpoints, so the
results, consumed in step order by the caller, are those of one process: the same ``metrics.jsonl`` byte for
byte. One condition: every worker runs with the caller's number of ``torch`` threads
(``torch.get_num_threads()``, e.g. from ``OMP_NUM_THREADS``), since CPU kernels split their sums by thread
(an SVD on 1 thread and on 2 differs in the last bits); ``N`` workers of ``T`` threads each use ``N x T``
cores, so on a machine of C cores ``OMP_NUM_THREADS=C/N`` for both runs. A worker stores its unit as soon as
it is done (:mod:`diag.offline.store`), so an interrupted run keeps what was finished.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor

import torch

from diag.offline.plan import Planned
from diag.offline.store import UnitStore
from diag.offline.units import ProbeFn, UnitResult, compute_unit

__all__ = ["Pool"]


def _init(threads: int) -> None:
    torch.set_num_threads(threads)


def _unit(entry: Planned, previous: Planned | None, sec_top: int, probe: ProbeFn | None,
          store: str | None, key: str | None) -> UnitResult:
    result = compute_unit(entry, previous, sec_top, probe)
    if store is not None and key is not None and not result.previous_failed:
        UnitStore(store).save(key, result)
    return result


class Pool:
    """``jobs`` worker processes computing units; :meth:`submit` returns a future of the unit."""

    def __init__(self, jobs: int, sec_top: int, probe: ProbeFn | None, store: UnitStore | None) -> None:
        threads = torch.get_num_threads()  # the caller's: the same bits as one process (see the docstring)
        self.sec_top, self.probe, self.store = sec_top, probe, store
        self._executor = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init, initargs=(threads,))

    def submit(self, entry: Planned, previous: Planned | None, key: str | None) -> Future:
        folder = None if self.store is None else str(self.store.folder)
        return self._executor.submit(_unit, entry, previous, self.sec_top, self.probe, folder, key)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
