"""Whether the evaluation's ground truth and the detectors' own definition find the same attention states.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.agree RUNS [--set SET] [--only PART]

For every run under ``RUNS`` recorded at every step (``RunSpec.every == 1``): the episodes of
:func:`evaluation.groundtruth.episodes` (the evaluation's implementation) and of
:func:`diag.detectors.states.episodes_of` (the detectors') over the same observations, and every difference
between them, one line each: the run, the head or layer, the state, and since / opened / until (and whether it
is a baseline episode, where the detectors' episodes say) on each side, ``-`` for an episode one side does not
have. Episodes of one head or layer and state are paired where they overlap in time. Exits 1 when any differ.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from evaluation.groundtruth import episodes
from evaluation.seeds import SETS
from evaluation.truth import Run, load_runs

__all__ = ["Difference", "differences", "agree"]


@dataclass(frozen=True)
class Difference:
    run: str
    state: str
    where: str
    ours: tuple | None  # (since, opened, until, baseline)
    theirs: tuple | None

    def line(self) -> str:
        def side(e: tuple | None) -> str:
            if e is None:
                return "-"
            since, opened, until, baseline = e
            base = "" if baseline is None else f" baseline={'yes' if baseline else 'no'}"
            return f"since {since} opened {opened} until {'open' if until is None else until}{base}"
        return f"{self.run} {self.where} {self.state}: ground truth {side(self.ours)} | detectors {side(self.theirs)}"


def _key(e) -> tuple:
    baseline = getattr(e, "baseline", None)
    return int(e.since), int(e.opened), None if e.until is None else int(e.until), baseline


def _overlap(a: tuple, b: tuple) -> bool:
    end_a, end_b = (a[2] if a[2] is not None else float("inf")), (b[2] if b[2] is not None else float("inf"))
    return a[0] < end_b and b[0] < end_a


def _same(a: tuple, b: tuple) -> bool:
    """Equal since, opened and until; baseline too where both sides say."""
    return a[:3] == b[:3] and (a[3] is None or b[3] is None or a[3] == b[3])


def differences(run: str, ours: list, theirs: list) -> list[Difference]:
    """Every episode of one side that the other does not have alike, paired by (state, where) and overlap."""
    groups: dict[tuple[str, str], tuple[list, list]] = defaultdict(lambda: ([], []))
    for side, eps in ((0, ours), (1, theirs)):
        for e in eps:
            groups[(e.state, e.where)][side].append(_key(e))
    out = []
    for (state, where), (mine, other) in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        other = sorted(other)
        for a in sorted(mine):
            match = next((b for b in other if _same(a, b)), None) or next((b for b in other if _overlap(a, b)), None)
            if match is not None:
                other.remove(match)
            if match is None or not _same(a, match):
                out.append(Difference(run, state, where, a, match))
        out += [Difference(run, state, where, None, b) for b in other]
    return out


def agree(runs: list[Run]) -> list[Difference]:
    """The differences on every run recorded at every step (the others are skipped)."""
    from diag.detectors.config import StatesConfig
    from diag.detectors.states import episodes_of

    out = []
    for run in runs:
        if run.spec.every == 1:
            out += differences(run.name, episodes(run.obs), episodes_of(run.obs, StatesConfig()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", choices=sorted(SETS), help="only the runs of this set (default: every run found)")
    parser.add_argument("--only", action="append", default=[], help="only runs whose name contains this")
    args = parser.parse_args()
    runs = [r for r in load_runs(args.runs, SETS[args.set] if args.set else None)
            if all(part in r.name for part in args.only)]
    every_step = [r for r in runs if r.spec.every == 1]
    found = agree(every_step)
    for d in found:
        print(d.line())
    print(f"{len(every_step)} runs recorded at every step ({len(runs) - len(every_step)} others skipped): "
          f"{len(found)} differences on {len({d.run for d in found})} runs")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
