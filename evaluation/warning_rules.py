"""What a collapse warning read off ``collapse_risk`` would do: the figures behind docs/alerts.md#collapse_risk's
account of why the risk raises no alert.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.warning_rules RUNS_DIR [RUNS_DIR ...] --set users3 users2

Each run of the sets found under the folders is replayed once at the Monitor's default cadence (the closer look as
the detectors ask for it; a run recorded at that cadence, as recorded), keeping every (step, layer, risk, layer
collapsed) the risk judged (:func:`risk_sequence`). A :class:`Rule` is read off that sequence per layer as an
episode (:class:`diag.detectors.episodes.Episodes`): it opens at a sample from ``start`` on where the risk is
``value`` or more at ``samples`` of the layer's judged samples in a row while the layer is not collapsed, and
ends once the risk was under ``value`` at ``clear`` samples in a row spanning ``clear_steps`` steps, or when the
layer collapsed; at most two openings per layer, as for any alert (:class:`~diag.detectors.episodes.Recurrence`).

A run with a layer collapse, away from the boundary learning rate, is *warned* when every collapsed layer opened
one within ``risk_horizon`` steps before its onset (:func:`judge`); a run without one (QK-norm twins, runs of the
sweeps that did not collapse, healthy runs, sink fine-tunes) that opened any has a *false warning*. A warning
would have kept the closer look on while open, which adds samples: the sequence holds none of them, so a rule's
first opening is read exactly and a later one off fewer samples than it would have had.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from diag.detectors import AlertConfig, Detectors
from diag.detectors.episodes import Dwell, Episodes, Opened, Recurrence
from diag.detectors.risk import CollapseRisk
from evaluation import detectors as replaying
from evaluation.seeds import BOUNDARY_LR, SETS
from evaluation.truth import Run, load_runs, onsets

__all__ = ["Rule", "judge", "openings", "risk_sequence", "rules_table"]

Sequence = list[tuple[int, str, float, bool]]  # (step, layer, collapse_risk, the layer collapsed)
HORIZON = AlertConfig().risk.risk_horizon


@dataclass(frozen=True)
class Rule:
    value: float  # the risk at which a warning would open ...
    samples: int = 1  # ... at this many of the layer's judged samples in a row
    clear: int = 2  # it ends once the risk was under value at this many samples in a row ...
    clear_steps: int = 0  # ... spanning this many steps
    start: int = 0  # no warning before this step

    def __str__(self) -> str:
        return (f"| {self.value:g} | {self.samples} | {self.clear} spanning {self.clear_steps} steps | "
                f"{self.start} |")


def risk_sequence(run: Run) -> Sequence:
    """Every risk the detectors judged on ``run`` at the Monitor's default cadence (a run recorded at it: as
    recorded), with whether the layer was collapsed then (its risk is not logged: no forecast)."""
    det = Detectors(AlertConfig())
    risk = next(d for d in det.detectors if isinstance(d, CollapseRisk))
    if run.spec.every == 0:
        means = replaying.LossMeans(run.obs, run.losses)
        fed = ((o, det.observe(means.given(o))) for o in run.obs)
    else:
        fed = replaying.at_default_cadence(run.obs, det, run.losses)
    out = []
    for o, _ in fed:
        out += [(o.step, label, p, label not in risk.fresh) for label, (step, p) in risk.risk.items()
                if step == o.step and "attn_entropy" in o.layers.get(label, {})]
    return out


def openings(sequence: Sequence, rule: Rule) -> list[tuple[str, int]]:
    """The (layer, step) at which ``rule`` opens a warning on ``sequence``."""
    episodes = Episodes(Dwell(rule.samples, 0), Dwell(rule.clear, rule.clear_steps))
    recurrence, out = Recurrence(), []
    for step, label, p, collapsed in sequence:
        if step < rule.start:
            continue
        inside = p >= rule.value and not collapsed
        event = episodes.update(label, step, inside, collapsed or not inside)
        if event is not None and recurrence.announce(label, event) is not None and isinstance(event, Opened):
            out.append((label, step))
    return out


def judge(layer_onsets: dict[str, int], opened: list[tuple[str, int]], horizon: int = HORIZON) -> bool:
    """A run with collapsed layers (``layer_onsets``: each one's first onset): every one warned within ``horizon``
    steps before its onset. A run without: no warning at all (True: quiet)."""
    if not layer_onsets:
        return not opened
    return all(any(w == layer and onset - horizon <= step < onset for w, step in opened)
               for layer, onset in layer_onsets.items())


def rules_table(runs: dict[str, tuple[dict[str, int], Sequence]], rules: list[Rule],
                horizon: int = HORIZON) -> list[str]:
    """Per rule: the runs with a layer collapse warned, the runs without one warned (false), and of all its
    warnings those that their own layer's onset followed within ``horizon`` steps."""
    collapsed = sorted(n for n, (o, _) in runs.items() if o)
    quiet = sorted(n for n, (o, _) in runs.items() if not o)
    out = ["| warn at risk | samples in a row | ends after | from step | collapse runs warned | runs without a "
           "collapse warned (false) | warnings followed by their layer's onset | the false ones |",
           "|---|---|---|---|---|---|---|---|"]
    for rule in rules:
        fired = {n: openings(seq, rule) for n, (_, seq) in runs.items()}
        warned = sum(judge(runs[n][0], fired[n]) for n in collapsed)
        false = [n for n in quiet if not judge({}, fired[n])]
        every = [(runs[n][0].get(layer), step) for n in runs for layer, step in fired[n]]
        right = sum(onset is not None and step < onset <= step + horizon for onset, step in every)
        out.append(f"{rule} {warned}/{len(collapsed)} | {len(false)}/{len(quiet)} | {right}/{len(every)} | "
                   f"{', '.join(false) or '-'} |")
    return out


RULES = [Rule(v, n, 2, steps, start) for v in (0.1, 0.15, 0.2, 0.3, 0.4, 0.5) for n in (1, 2, 3)
         for steps in (0, 50) for start in (0, 20, 40, 60)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="folders holding the runs (a run in several: the first)")
    parser.add_argument("--set", nargs="+", default=["users3"], choices=sorted(SETS))
    args = parser.parse_args()
    found: dict[str, Run] = {}
    for root in args.runs:
        for name in args.set:
            for r in load_runs(root, SETS[name]):
                found.setdefault(r.name, r)
    judged = {r.name: ({k: v[0].opened for k, v in onsets(r).items()}, risk_sequence(r)) for r in found.values()
              if r.spec.purpose in ("collapse", "healthy", "sinks") and r.spec.twin != "normsoftmax"
              and not (r.spec.purpose == "collapse" and r.spec.lr == BOUNDARY_LR)}
    print(f"{' and '.join(args.set)}: {len(judged)} runs ({sum(bool(o) for o, _ in judged.values())} with a layer "
          f"collapse), away from the boundary learning rate {BOUNDARY_LR:g}\n")
    print("\n".join(rules_table(judged, [Rule(0.2, 3, 2, 50)] + RULES)))


if __name__ == "__main__":
    main()
