"""Record every run of a set (evaluation/seeds.py) that a folder does not hold yet.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.plan design --out runs/eval --jobs 2
    .venv/bin/python -m evaluation.plan report --out runs/eval --list     # what it would record

A run is complete when its folder holds ``run.json`` (written last), so an interrupted plan resumes where it
stopped. Runs go longest first, ``--jobs`` at a time, each in its own process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from evaluation.runs import Claimed, record
from evaluation.seeds import SETS
from evaluation.spec import RunSpec

# rough seconds per step at the run's cadence, for the order only
COST = {"lm": 1.0, "vit": 0.15, "hf": 0.25, "finetune": 0.5}


def missing(name: str, root: Path) -> list[RunSpec]:
    todo = [s for s in SETS[name] if not (root / s.name / "run.json").exists()]
    # longest first; the Hugging Face language models' NormSoftmax twins (the causal test of a plateau alert) last
    return sorted(todo, key=lambda s: (s.task == "hf" and s.twin != "",
                                       -COST[s.task] * s.steps * (1 + (s.layers or 4) / 4)))


def groups(todo: list[RunSpec], jobs: int) -> list[tuple[int, list[RunSpec]]]:
    """The runs by their thread count, each group with as many processes as keep the threads within ``jobs``
    (the rounding replicas' two threads each: two of them side by side on two cores take three times as long)."""
    by_threads: dict[int, list[RunSpec]] = {}
    for spec in todo:
        by_threads.setdefault(max(spec.threads, 1), []).append(spec)
    return [(max(1, jobs // threads), specs) for threads, specs in sorted(by_threads.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("set", choices=sorted(SETS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--list", action="store_true", help="print the runs still to record and stop")
    parser.add_argument("--only", action="append", default=[],
                        help="record only runs whose name contains this (repeated: all of them)")
    parser.add_argument("--skip", action="append", default=[],
                        help="leave out runs whose name contains this (repeated: any of them)")
    args = parser.parse_args()
    todo = [s for s in missing(args.set, args.out) if all(part in s.name for part in args.only)
            and not any(part in s.name for part in args.skip)]
    print(f"{args.set}: {len(SETS[args.set])} runs, {len(todo)} to record", flush=True)
    if args.list:
        print("\n".join(s.name for s in todo))
        return
    start, done = time.perf_counter(), 0
    for jobs, specs in groups(todo, args.jobs):
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(record, spec, args.out): spec for spec in specs}
            for future in as_completed(futures):
                done, spec, error = done + 1, futures[future], future.exception()
                outcome = ("" if error is None else f" NOT RECORDED: {error}" if isinstance(error, Claimed)
                           else f" FAILED: {error!r}")
                print(f"[{done}/{len(todo)}] {time.perf_counter() - start:7.0f}s {spec.name}{outcome}", flush=True)


if __name__ == "__main__":
    main()
