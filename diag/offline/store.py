"""Computed checkpoints kept on disk, so that an interrupted analysis resumes where it stopped.

Each unit (:mod:`diag.offline.units`: one checkpoint's spectra and the update from the one before it) is
written as one JSON file (floats as their shortest round-trip text: exact), named by a fingerprint of
everything it depends on: the two checkpoints' files (names, sizes, modification times), their layers'
layouts, ``sec_top`` and the probe. A later run over the same checkpoints and options finds it and
computes only what is missing; anything changed (a file re-written, another option) has another name and
is computed again. The outputs are always written from the units in step order, so a resumed analysis's
``metrics.jsonl`` equals an uninterrupted one's byte for byte.

An analysis that ran to its end leaves ``finished`` beside its units (a JSON object): the units it used, its
number of checkpoints and its steps. It is removed when an analysis starts, so a folder of units without it holds a
stopped analysis (:meth:`UnitStore.state`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from diag.layouts.vocab import QKVLayout
from diag.offline.plan import Planned
from diag.offline.units import UnitResult

__all__ = ["UnitStore", "FOLDER", "FINISHED"]

FOLDER = "per-checkpoint"  # under analyze's --out
FINISHED = "finished"  # written by an analysis that ran to its end (JSON; not a unit: no .json suffix)
VERSION = 1  # of the unit computation: a change to what a unit holds changes every name


def _files(path: Path) -> list[Path]:
    """The files a checkpoint is read from: the file, or the files of its folder (a model folder, or the
    shards beside an index)."""
    folder = path if path.is_dir() else path.parent if path.name.endswith(".index.json") else None
    if folder is None:
        return [path]
    return sorted(p for p in folder.iterdir() if p.is_file())


def _identity(entry: Planned) -> list[Any]:
    files = []
    for f in _files(entry.path):
        stat = f.stat()
        files.append([f.name, stat.st_size, stat.st_mtime_ns])
    return [str(entry.path.resolve()), files]


def _layout(layout: QKVLayout) -> dict[str, Any]:
    return dict(layout.to_dict())


def fingerprint(entry: Planned, previous: Planned | None, sec_top: int, probe: str | None) -> str:
    """The name of a unit: a hash of what its arrays depend on."""
    assert entry.layers is not None
    what = {
        "version": VERSION,
        "checkpoint": _identity(entry),
        "previous": None if previous is None else _identity(previous),
        "layers": [[la.name, la.label, _layout(la.layout)] for la in entry.layers],
        "sec_top": sec_top,
        "probe": probe,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:40]


class UnitStore:
    """Units as ``<fingerprint>.json`` in ``folder``; written atomically (a reader never sees half a unit)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        self.used.add(key)
        return (self.folder / f"{key}.json").is_file()

    def load(self, key: str) -> UnitResult | None:
        self.used.add(key)
        return self._read(key)

    def _read(self, key: str) -> UnitResult | None:
        try:
            return UnitResult.from_json(json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):  # not there, or not whole: computed again
            return None

    def state(self) -> str | None:
        """``"finished"`` (an analysis ran to its end), ``"stopped"`` (units without that), or None (no unit)."""
        if (self.folder / FINISHED).is_file():
            return "finished"
        if self.folder.is_dir() and any(self.folder.iterdir()):
            return "stopped"
        return None

    def finished(self) -> dict[str, Any] | None:
        """What the finished analysis wrote in ``finished`` (``units``, ``checkpoints``, ``steps``), or None."""
        try:
            done = json.loads((self.folder / FINISHED).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return done if isinstance(done, dict) and isinstance(done.get("units"), list) else None

    def holds_finished(self, keys: list[str]) -> bool:
        """Whether a finished analysis of exactly these units is here, every unit whole."""
        done = self.finished()
        return (done is not None and set(done["units"]) == set(keys)
                and all(self._read(key) is not None for key in keys))

    def begin(self) -> None:
        """An analysis starts: until :meth:`finish`, the folder holds a stopped one."""
        (self.folder / FINISHED).unlink(missing_ok=True)

    def finish(self, steps: list[int]) -> None:
        """The analysis ran to its end over ``steps``: record the units it used."""
        self.folder.mkdir(parents=True, exist_ok=True)
        done = {"units": sorted(self.used), "checkpoints": len(steps), "steps": steps}
        path = self.folder / FINISHED
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(done), encoding="utf-8")
        tmp.replace(path)

    def save(self, key: str, result: UnitResult) -> None:
        self.used.add(key)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{key}.json"
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_json()), encoding="utf-8")
        tmp.replace(path)

    def forget_others(self) -> None:
        """Remove the units this analysis did not use (those of checkpoints or options it does not analyse)."""
        if not self.folder.is_dir():
            return
        for old in self.folder.iterdir():
            if old.name != FINISHED and old.suffix in (".json", ".tmp") and old.name.split(".")[0] not in self.used:
                old.unlink(missing_ok=True)
