"""A held-out set frozen before it is recorded, sealed once recorded, replayed once: the protocol as code.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.freeze SET                  # 1. before recording
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.plan SET --out RUNS --jobs 2  # 2. record it once
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.freeze SET --recorded RUNS  # 3. seal the recording
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.report RUNS --set SET       # 4. replay it once

1. **Freeze** writes ``evaluation/frozen/SET/manifest.json``: the time, the commit checked out (the detectors'
   and the seeds'; refused while ``diag/``, ``hooks/`` or ``evaluation/`` have uncommitted changes), the
   detectors' configuration (every ``AlertConfig`` field; the closer look has none of its own), a hash of the
   detectors' source (:func:`evaluation.provenance.detector_hash`), and per run of the set (evaluation/seeds.py)
   its RunSpec and the hash of it. A set is frozen once.
2. **Recording** (:mod:`evaluation.plan`) writes into each run's ``run.json`` the commit it ran at, the files
   that differed from it, and its start and end (:mod:`evaluation.runs`).
3. **Seal** (``--recorded RUNS``) checks every run against the manifest and refuses the set if any run was
   recorded at another commit than the frozen one (a commit that differs from it only in ``evaluation/frozen/``,
   the manifest committed before recording, holds the frozen code), with uncommitted changes, before the
   freeze, or with another configuration; it adds per run its recording's times and commit and the sha256 of
   its ``observations.jsonl`` and ``run.json``. A run not recorded refuses the seal unless ``--missing-ok``
   (then the manifest lists it).
4. **Replay** (:mod:`evaluation.report`, :func:`replayable`) refuses a set that is not sealed, whose detectors'
   source hash differs from the source it would run (a changed detector is measured on a new set), whose
   records differ from their sealed hashes, or that was replayed already; it writes ``judged.json`` (every
   run's verdicts with their evidence) and ``report.md`` beside the manifest.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from evaluation.provenance import ROOT, changed, code_differs, detector_hash, file_hash, head, now, spec_hash
from evaluation.seeds import SETS
from evaluation.spec import RunSpec

__all__ = ["FROZEN", "Refused", "freeze", "jsonable", "load_manifest", "replayable", "seal"]

FROZEN = ROOT / "evaluation" / "frozen"
RECORDS = ("observations.jsonl", "run.json")


class Refused(RuntimeError):
    """A step of the protocol that would break it: what is wrong, and what to do instead."""


def jsonable(x: object) -> object:
    """``x`` with tuples as lists, numpy scalars as Python ones and non-finite floats as strings ("inf",
    "nan"): strict JSON."""
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n")


def detectors_config() -> dict:
    """The configuration the replay runs the detectors with: AlertConfig's defaults (the closer look follows the
    detectors' own reasons and has no configuration of its own)."""
    from diag.detectors import AlertConfig

    return {"alerts": AlertConfig().fields()}


def freeze(name: str, specs: list[RunSpec], frozen: Path = FROZEN, root: Path = ROOT) -> dict:
    """Write the set's manifest before any of its runs is recorded; refused when the set is frozen already, or
    the code under ``root`` has uncommitted changes."""
    path = frozen / name / "manifest.json"
    if path.exists():
        raise Refused(f"{path} exists: {name} is frozen already (a set is frozen once; a changed plan is a new set "
                      "in evaluation/seeds.py)")
    dirty = changed(root)
    if dirty:
        raise Refused(f"uncommitted changes in {', '.join(dirty[:5])}{' ...' if len(dirty) > 5 else ''}: commit the "
                      "detectors and the seeds, then freeze (the manifest names the commit they are measured at)")
    commit = head(root)
    if commit is None:
        raise Refused(f"{root} is not a git checkout: a frozen set names the commit of its detectors")
    manifest = {"set": name, "frozen_at": now(), "detector_commit": commit, "detector_hash": detector_hash(root),
                "config": detectors_config(),
                "runs": {s.name: {"spec": asdict(s), "config_hash": spec_hash(asdict(s))} for s in specs}}
    write_json(path, manifest)
    return manifest


def load_manifest(name: str, frozen: Path = FROZEN) -> dict:
    path = frozen / name / "manifest.json"
    if not path.exists():
        raise Refused(f"{name} has no manifest ({path}): freeze it before recording "
                      f"(python -m evaluation.freeze {name})")
    return json.loads(path.read_text())


def _check(run: str, entry: dict, info: dict, manifest: dict, root: Path) -> list[str]:
    """What is wrong with one recorded run against the manifest (nothing: an empty list)."""
    rec = info.get("recorded") or {}
    out = []
    if spec_hash(info["config"]) != entry["config_hash"]:
        out.append(f"{run}: recorded with another configuration than the frozen one")
    differs = code_differs(manifest["detector_commit"], rec.get("commit") or "?", root)
    if differs:
        out.append(f"{run}: recorded at commit {rec.get('commit')}, the set is frozen at "
                   f"{manifest['detector_commit']} (they differ in {', '.join(differs[:5])})")
    if rec.get("changed"):
        out.append(f"{run}: recorded with uncommitted changes in {', '.join(rec['changed'][:5])}")
    if not rec.get("start") or rec["start"] < manifest["frozen_at"]:
        out.append(f"{run}: recorded at {rec.get('start')}, before the freeze at {manifest['frozen_at']}")
    return out


def seal(name: str, runs: Path, frozen: Path = FROZEN, missing_ok: bool = False, root: Path = ROOT) -> dict:
    """Check every run of the set recorded under ``runs`` against the manifest and add its recording to it."""
    manifest = load_manifest(name, frozen)
    if "sealed_at" in manifest:
        raise Refused(f"{name} was sealed at {manifest['sealed_at']}: its recording is in the manifest already")
    problems, missing = [], []
    for run, entry in manifest["runs"].items():
        folder = runs / run
        if not (folder / "run.json").exists():
            missing.append(run)
            continue
        info = json.loads((folder / "run.json").read_text())
        problems += _check(run, entry, info, manifest, root)
        rec = info.get("recorded") or {}
        entry["recorded"] = {k: rec.get(k) for k in ("commit", "start", "end")}
        entry["sha256"] = {f: file_hash(folder / f) for f in RECORDS}
    if problems:
        raise Refused(f"{name}: {len(problems)} problems, the set is not sealed:\n" + "\n".join(problems))
    if missing and not missing_ok:
        raise Refused(f"{name}: {len(missing)} runs not recorded under {runs} ({', '.join(missing[:5])}"
                      f"{' ...' if len(missing) > 5 else ''}): record them (python -m evaluation.plan {name} --out "
                      f"{runs}), or seal without them (--missing-ok: the manifest lists them as missing)")
    manifest.update(missing=missing, sealed_at=now())
    write_json(frozen / name / "manifest.json", manifest)
    return manifest


def replayable(name: str, runs: Path, frozen: Path = FROZEN, root: Path = ROOT) -> dict:
    """The manifest of a set that may be replayed now, its records checked; else :class:`Refused`."""
    manifest = load_manifest(name, frozen)
    if "sealed_at" not in manifest:
        raise Refused(f"{name} is not sealed: seal its recording first (python -m evaluation.freeze {name} "
                      f"--recorded {runs})")
    current = detector_hash(root)
    if current != manifest["detector_hash"]:
        raise Refused(f"{name}: the detectors' source differs from the frozen one (hash {current[:12]}, frozen "
                      f"{manifest['detector_hash'][:12]} at {manifest['detector_commit'][:12]}): a changed detector "
                      "is measured on a new set (freeze one), or check out the frozen commit to replay this one")
    judged = frozen / name / "judged.json"
    if judged.exists():
        raise Refused(f"{name} was replayed already ({judged}): a set is replayed once")
    altered = [f"{run}/{f}" for run, entry in manifest["runs"].items() if "sha256" in entry
               for f, digest in entry["sha256"].items() if file_hash(runs / run / f) != digest]
    if altered:
        raise Refused(f"{name}: records differ from those sealed: {', '.join(altered[:5])}")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("set", choices=sorted(SETS))
    parser.add_argument("--recorded", type=Path, metavar="RUNS", help="seal the set's recording under RUNS")
    parser.add_argument("--missing-ok", action="store_true", help="seal without the runs not recorded")
    parser.add_argument("--frozen", type=Path, default=FROZEN, help="the frozen sets' folder")
    args = parser.parse_args()
    try:
        if args.recorded is None:
            manifest = freeze(args.set, SETS[args.set], args.frozen)
            print(f"{args.set}: frozen at {manifest['detector_commit'][:12]}, {len(manifest['runs'])} runs: "
                  f"{args.frozen / args.set / 'manifest.json'}")
        else:
            manifest = seal(args.set, args.recorded, args.frozen, args.missing_ok)
            print(f"{args.set}: sealed, {len(manifest['runs']) - len(manifest['missing'])} runs recorded, "
                  f"{len(manifest['missing'])} missing")
    except Refused as refused:
        raise SystemExit(f"refused: {refused}") from None


if __name__ == "__main__":
    main()
