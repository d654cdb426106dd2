"""Whether the detectors' malignant collapses are the ones the ground truth sees in the full attention maps.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.agree RUNS [--set SET] [--only PART] [--figure PNG] [--scope head]
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.agree RUNS --replica    # the implementation check

For every run under ``RUNS`` recorded at every step with its attention maps (``attention.npz``,
:mod:`evaluation.maps`): the ground truth's malignant episodes (:mod:`evaluation.groundtruth`) at each setting
of a sweep of its parameters (:data:`SWEEP`: one parameter at a time, the others at their defaults), against the
detectors' (:func:`diag.detectors.states.episodes_of` with the default ``StatesConfig``, every step). Per
setting, one row of a Markdown table (:func:`curve`): the layers with a malignant onset on each side, those
where both have one within the matching window (the detectors' onset at most 10 steps before the truth's and at
most 50 after it: :data:`evaluation.matching.COLLAPSE`), those only one side has, and their agreement
(both / (both + truth only + detectors only)); ``--figure`` draws it; ``--scope head`` compares the heads'
onsets instead.

``--replica`` lists instead every episode on which :mod:`evaluation.replica` (the detectors' definition written a
second time) and the detectors differ, one line each, and exits 1 when any do: a check of the streaming
machine's implementation, not of the definition.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from evaluation.groundtruth import Definition, Episode, episodes
from evaluation.maps import TOP_KEYS, TOP_MASS, load_maps
from evaluation.matching import COLLAPSE
from evaluation.seeds import SETS
from evaluation.truth import Run, load_runs

__all__ = ["SWEEP", "Agreement", "Difference", "agree", "compare", "curve", "differences", "table"]

MAPS = "attention.npz"
SWEEP: dict[str, tuple] = {  # each parameter's settings, the others at their defaults
    "top_mass": TOP_MASS,
    "top_keys": TOP_KEYS,
    "queries": (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
    "few_columns": (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2),
    "sink_mass": (0.3, 0.4, 0.6, 0.8, 0.95),
    "window": (1, 5, 11, 21, 41),
}


@dataclass(frozen=True)
class Agreement:
    """Layers with a malignant onset on each side (their first), and how they pair up."""

    truth: int
    detectors: int
    both: int  # the detectors' first onset within the window of the truth's
    lags: tuple[int, ...]  # the detectors' onset minus the truth's, for each of both

    @property
    def truth_only(self) -> int:
        return self.truth - self.both

    @property
    def detectors_only(self) -> int:
        return self.detectors - self.both

    @property
    def agreement(self) -> float:
        union = self.truth + self.detectors - self.both
        return self.both / union if union else 1.0

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(self.truth + other.truth, self.detectors + other.detectors, self.both + other.both,
                         self.lags + other.lags)


def _first_onsets(eps: list, scope: str = "layer") -> dict[str, int]:
    out: dict[str, int] = {}
    for e in sorted(eps, key=lambda e: e.opened):
        if e.state == "malignant" and ("/" in e.where) == (scope == "head"):
            out.setdefault(e.where, int(e.opened))
    return out


def compare(truth: list[Episode], detectors: list, scope: str = "layer") -> Agreement:
    """The first malignant onset of each layer (``scope="head"``: head) on each side, paired within the window."""
    mine, theirs = _first_onsets(truth, scope), _first_onsets(detectors, scope)
    lags = tuple(theirs[w] - t for w, t in mine.items() if w in theirs and COLLAPSE.holds(theirs[w], t))
    return Agreement(len(mine), len(theirs), len(lags), lags)


def curve(runs: list[Run], base: Definition | None = None, sweep: dict[str, tuple] = SWEEP,
          scope: str = "layer") -> list[tuple[str, float, Agreement]]:
    """(parameter, setting, agreement summed over ``runs``) for every setting of ``sweep``; the runs need their
    attention maps."""
    from diag.detectors.config import StatesConfig
    from diag.detectors.states import episodes_of

    base = base or Definition()
    detectors = {r.name: episodes_of(r.obs, StatesConfig()) for r in runs}
    maps = {r.name: load_maps(r.path / MAPS) for r in runs}
    out = []
    for name, settings in sweep.items():
        for value in settings:
            d = base.replace(**{name: value})
            total = Agreement(0, 0, 0, ())
            for r in runs:
                total = total + compare(episodes(maps[r.name], d), detectors[r.name], scope)
            out.append((name, value, total))
    return out


def table(rows: list[tuple[str, float, Agreement]], base: Definition | None = None) -> str:
    """The curve as a Markdown table; the default setting of each parameter in bold."""
    base = base or Definition()
    lines = ["| parameter | setting | truth | detectors | both | truth only | detectors only | agreement | "
             "lag (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, value, a in rows:
        setting = f"{value:g}" if name != "few_columns" else f"1/{round(1 / value)}"
        if getattr(base, name) == value:
            setting = f"**{setting}**"
        lag = f"{sorted(a.lags)[len(a.lags) // 2]:+d}" if a.lags else "-"
        lines.append(f"| {name} | {setting} | {a.truth} | {a.detectors} | {a.both} | {a.truth_only} | "
                     f"{a.detectors_only} | {a.agreement:.2f} | {lag} |")
    return "\n".join(lines)


def figure(rows: list[tuple[str, float, Agreement]], path: Path, base: Definition | None = None) -> None:
    """One panel per parameter: the share of the truth's onsets the detectors have, of the detectors' the truth
    has (none drawn where that side has none), and the agreement, against the setting (the default marked)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = base or Definition()
    names = list(dict.fromkeys(name for name, _, _ in rows))
    columns = 3
    fig = Figure(figsize=(11, 3.3 * -(-len(names) // columns)))
    FigureCanvasAgg(fig)
    for i, name in enumerate(names):
        ax = fig.add_subplot(-(-len(names) // columns), columns, i + 1)
        mine = [(v, a) for n, v, a in rows if n == name]
        xs = [v for v, _ in mine]
        ax.plot(xs, [a.agreement for _, a in mine], "k^-", lw=2, label="agreement", zorder=1)
        ax.plot(xs, [a.both / a.truth if a.truth else math.nan for _, a in mine], "o--", label="truth's onsets matched")
        ax.plot(xs, [a.both / a.detectors if a.detectors else math.nan for _, a in mine], "s:",
                label="detectors' onsets matched")
        ax.axvline(getattr(base, name), color="#888888", ls=":", lw=1)
        if name in ("few_columns", "window"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"1/{round(1 / v)}" if name == "few_columns" else f"{v:g}" for v in xs])
            ax.minorticks_off()
        ax.set(xlabel=name, ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
        if i % columns == 0:
            ax.set_ylabel("share of layers' onsets")
        if i == 0:
            ax.legend(fontsize="x-small", loc="lower right")
    fig.suptitle("malignant onsets per layer: the ground truth (full attention maps) against the detectors, one "
                 "parameter at a time (dotted: the truth's default)", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
        return f"{self.run} {self.where} {self.state}: replica {side(self.ours)} | detectors {side(self.theirs)}"


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
    """The replica's differences from the detectors on every run recorded at every step (the others skipped)."""
    from diag.detectors.config import StatesConfig
    from diag.detectors.states import episodes_of
    from evaluation.replica import episodes as replica

    out = []
    for run in runs:
        if run.spec.every == 1:
            out += differences(run.name, replica(run.obs), episodes_of(run.obs, StatesConfig()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--set", choices=sorted(SETS), help="only the runs of this set (default: every run found)")
    parser.add_argument("--only", action="append", default=[], help="only runs whose name contains this")
    parser.add_argument("--figure", type=Path, help="draw the curve into this PNG")
    parser.add_argument("--scope", choices=("layer", "head"), default="layer", help="compare layers' onsets or heads'")
    parser.add_argument("--replica", action="store_true", help="list the replica's differences from the detectors")
    args = parser.parse_args()
    runs = [r for r in load_runs(args.runs, SETS[args.set] if args.set else None)
            if all(part in r.name for part in args.only)]
    every_step = [r for r in runs if r.spec.every == 1]
    if args.replica:
        found = agree(every_step)
        for d in found:
            print(d.line())
        print(f"{len(every_step)} runs recorded at every step ({len(runs) - len(every_step)} others skipped): "
              f"{len(found)} differences on {len({d.run for d in found})} runs")
        sys.exit(1 if found else 0)
    mapped = [r for r in every_step if (r.path / MAPS).exists()]
    rows = curve(mapped, sweep=SWEEP, scope=args.scope)
    print(table(rows))
    print(f"\n{len(mapped)} runs with their attention maps ({len(runs) - len(mapped)} others skipped: "
          f"{', '.join(r.name for r in runs if r not in mapped) or 'none'})")
    if args.figure:
        figure(rows, args.figure)


if __name__ == "__main__":
    main()
