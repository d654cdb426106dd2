"""Where each unit of a planned series comes from: the store, a worker process, or computed here.

Every analysable checkpoint's unit (:mod:`diag.offline.units`) is taken against the last checkpoint that
succeeded before it. Its name in the store (:mod:`diag.offline.store`) is known from the plan alone, before
anything is computed, so a caller can ask whether the store already holds a finished analysis of exactly
these units (:meth:`UnitSource.finished`) before it writes a single output.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from diag.offline.jobs import Pool
from diag.offline.plan import Planned
from diag.offline.store import UnitStore, fingerprint
from diag.offline.units import ProbeFn, UnitResult, compute_unit

__all__ = ["UnitSource"]


class UnitSource:
    """The units of ``entries`` (the plan's, in step order): from ``store``, from a worker of :meth:`start`
    (which computed it against the checkpoint planned before it), or computed here."""

    def __init__(self, entries: list[Planned], sec_top: int, probe: ProbeFn | None, store: UnitStore | None) -> None:
        self.sec_top, self.probe = sec_top, probe
        identity = getattr(probe, "identity", None)
        self.probe_id = None if probe is None else identity() if callable(identity) else None
        self.store = store if probe is None or self.probe_id is not None else None  # an unnamed probe: no store
        self.ok = [e for e in entries if e.error is None]
        self.planned = {e.path: (self.ok[i - 1] if i else None) for i, e in enumerate(self.ok)}
        self.futures: dict[Path, Future] = {}
        self.pool: Pool | None = None

    def _key(self, entry: Planned, previous: Planned | None) -> str | None:
        if self.store is None:
            return None
        return fingerprint(entry, previous, self.sec_top, self.probe_id)

    def finished(self) -> bool:
        """Whether the store holds a finished analysis of exactly the planned units (nothing to compute)."""
        keys = [self._key(e, self.planned[e.path]) for e in self.ok]
        if self.store is None or not keys or None in keys:
            return False
        return self.store.holds_finished([k for k in keys if k is not None])

    def start(self, jobs: int) -> None:
        """With ``jobs > 1``, hand every unit the store does not hold to ``jobs`` worker processes."""
        if jobs <= 1 or len(self.ok) <= 1:
            return
        self.pool = Pool(jobs, self.sec_top, self.probe, self.store)
        for entry in self.ok:
            previous = self.planned[entry.path]
            key = self._key(entry, previous)
            if key is None or self.store is None or not self.store.has(key):
                self.futures[entry.path] = self.pool.submit(entry, previous, key)

    def result(self, entry: Planned, previous: Planned | None) -> UnitResult:
        key = self._key(entry, previous)
        cached = None if key is None or self.store is None else self.store.load(key)
        if cached is not None:
            return cached
        future = self.futures.pop(entry.path, None)
        if future is not None and self.planned[entry.path] is previous:
            result = future.result()
        else:
            result = compute_unit(entry, previous, self.sec_top, self.probe)
            if key is not None and self.store is not None and not result.previous_failed:
                self.store.save(key, result)
        if result.previous_failed:  # the checkpoint before was analysed but cannot be read now: no update
            return self.result(entry, None)
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
