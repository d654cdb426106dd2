"""Where recorded runs and frozen sets come from: the code's commit, whether its tree differs from it, hashes.

A run records the commit it was trained at and whether the code that trains and monitors it (``diag/``,
``hooks/``, ``evaluation/``) had uncommitted changes (:func:`recording_stamp`, written into ``run.json`` by
:mod:`evaluation.runs`); a frozen set (:mod:`evaluation.freeze`) records the detectors' commit and a hash of
their source (:func:`detector_hash`), which a replay compares with the source it runs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["CODE", "DETECTOR_SOURCES", "changed", "code_differs", "detector_hash", "file_hash", "head", "now",
           "recording_stamp", "spec_hash"]

ROOT = Path(__file__).resolve().parent.parent
CODE = ("diag", "hooks", "evaluation")  # what trains, monitors and records a run
FROZEN = "evaluation/frozen"  # the frozen sets' manifests and results: written after the freeze, never code
# what the replay runs: the detectors (their thresholds, the risk model) and the closer look of the default cadence
DETECTOR_SOURCES = ("diag/detectors", "diag/math/attention.py", "hooks/monitor/cadence.py")


def now() -> str:
    """The time in UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:  # no git
        return None
    return done.stdout if done.returncode == 0 else None


def head(root: Path = ROOT) -> str | None:
    """The commit checked out (None outside a git checkout)."""
    out = _git(root, "rev-parse", "HEAD")
    return out.strip() if out else None


def changed(root: Path = ROOT, paths: tuple[str, ...] = CODE) -> list[str]:
    """The files under ``paths`` that differ from the commit checked out (untracked ones included; the frozen
    sets' folder left out)."""
    out = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths) or ""
    files = [line[3:] for line in out.splitlines() if line.strip()]
    return [f for f in files if not f.startswith(FROZEN + "/")]


def code_differs(a: str, b: str, root: Path = ROOT) -> list[str]:
    """The files of ``CODE`` (the frozen sets' folder left out) that differ between commits ``a`` and ``b``; a
    commit git does not know differs in everything (``["?"]``)."""
    if a == b:
        return []
    out = _git(root, "diff", "--name-only", a, b, "--", *CODE)
    if out is None:
        return ["?"]
    return [f for f in out.splitlines() if f and not f.startswith(FROZEN + "/")]


def recording_stamp(root: Path = ROOT) -> dict:
    """What a run records of the code it was recorded with: the commit and the changed files of ``CODE``."""
    return {"commit": head(root), "changed": changed(root)}


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def detector_hash(root: Path = ROOT) -> str:
    """sha256 over the detectors' source files (``DETECTOR_SOURCES``: every file but caches), each as its path
    relative to ``root`` and its content's sha256, in path order."""
    files = []
    for name in DETECTOR_SOURCES:
        path = root / name
        files += sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) \
            if path.is_dir() else [path]
    digest = hashlib.sha256()
    for p in sorted(files):
        digest.update(f"{p.relative_to(root).as_posix()}\0{file_hash(p)}\n".encode())
    return digest.hexdigest()


def spec_hash(spec: dict) -> str:
    """sha256 of a run's configuration (a RunSpec as a dict), as canonical JSON."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
