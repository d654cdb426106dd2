"""evaluation.warning_rules: the warnings a rule would read off collapse_risk, each layer an episode as the detectors
keep them, judged per collapsed layer within the risk's horizon; the risks it reads are the ones the Monitor
logs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from diag.detectors import Detectors, Observation
from evaluation import detectors as replaying
from evaluation.spec import RunSpec
from evaluation.truth import Run
from evaluation.warning_rules import Rule, judge, openings, risk_sequence


def reference(sequence, rule: Rule) -> list[tuple[str, int]]:
    """The openings by their definition, one layer at a time over its own samples from ``rule.start``: closed, a
    warning opens at the sample that ends ``samples`` inside samples in a row (the risk at ``value`` or more, the
    layer not collapsed); open, it ends at the sample that ends ``clear`` outside samples in a row spanning
    ``clear_steps`` steps (one sample: at once, as a Dwell of one sample); the first two openings of a layer are
    reported."""
    out = []
    for layer in dict.fromkeys(label for _, label, _, _ in sequence):
        mine = [(s, p >= rule.value and not c) for s, label, p, c in sequence if label == layer and s >= rule.start]
        is_open, run_from, opened = False, 0, 0
        for i, (step, inside) in enumerate(mine):
            if i > 0 and mine[i - 1][1] != inside:
                run_from = i  # a run of inside (or outside) samples starts here
            if not is_open and inside and i - run_from + 1 >= rule.samples:
                is_open, opened = True, opened + 1
                if opened <= 2:
                    out.append((layer, step))
            elif is_open and not inside and i - run_from + 1 >= rule.clear and (
                    rule.clear == 1 or step - mine[run_from][0] >= rule.clear_steps):
                is_open = False
                run_from = i + 1  # a count that ended an episode starts afresh
    return sorted(out, key=lambda x: (x[1], x[0]))


@settings(max_examples=200, deadline=None)
@given(risks=st.lists(st.tuples(st.sampled_from(["L00", "L01"]), st.floats(0.0, 1.0), st.booleans()),
                      min_size=1, max_size=40),
       value=st.sampled_from([0.1, 0.2, 0.5]), samples=st.integers(1, 3), clear=st.integers(1, 3),
       clear_steps=st.sampled_from([0, 20, 50]), start=st.sampled_from([0, 30]))
def test_openings_follow_their_definition(risks, value, samples, clear, clear_steps, start):
    """Any sequence of two layers' risks, sampled every 10 steps, some samples of a collapsed layer: the openings
    are those of the definition (:func:`reference`)."""
    sequence = [(10 * i, layer, p, collapsed) for i, (layer, p, collapsed) in enumerate(risks)]
    rule = Rule(value, samples, clear, clear_steps, start)
    got = sorted(openings(sequence, rule), key=lambda x: (x[1], x[0]))
    assert got == reference(sequence, rule)


def test_a_spike_warns_at_one_sample_in_a_row_not_at_two_and_never_before_the_start():
    sequence = [(s, "L00", p, False) for s, p in ((0, 0.05), (10, 0.6), (20, 0.05), (30, 0.05), (40, 0.3))]
    assert openings(sequence, Rule(0.2)) == [("L00", 10), ("L00", 40)]
    assert openings(sequence, Rule(0.2, samples=2)) == []
    assert openings(sequence, Rule(0.2, start=20)) == [("L00", 40)]
    # an episode that must stay under the line for 50 steps is still open at 40: one warning
    assert openings(sequence, Rule(0.2, clear_steps=50)) == [("L00", 10)]
    # a collapsed layer's risk (1.0, no forecast) opens nothing
    assert openings([(0, "L00", 1.0, True), (10, "L00", 1.0, True)], Rule(0.2)) == []


def test_a_collapsed_layer_counts_as_warned_only_within_the_horizon_before_its_onset():
    onsets = {"L00": 100, "L02": 250}
    assert judge(onsets, [("L00", 50), ("L02", 249)])
    assert not judge(onsets, [("L00", 49), ("L02", 249)])  # 51 steps ahead: outside the 50-step horizon
    assert not judge(onsets, [("L00", 100), ("L02", 249)])  # at the onset: no warning
    assert not judge(onsets, [("L01", 80), ("L02", 249)])  # another layer's warning says nothing of L00
    assert judge({}, []) and not judge({}, [("L03", 10)])  # a run without a collapse: any warning is false


def test_the_risks_read_are_the_ones_the_monitor_logs_at_its_default_cadence():
    """A layer drifting in and out of focus over 300 steps, with update-ratio observations of their own (as the
    recordings hold them): the sequence holds one entry per judged sample, the same risks the detectors log
    (collapse_risk) when fed as the Monitor at its default cadence feeds them."""
    script = []
    for s in range(300):
        e = 0.55 + 0.45 * math.sin(s / 9.0) * math.cos(s / 23.0)
        m = {"qk_sigma1": np.array([2.0 ** (s / 10), 1.0]), "qk_sec": np.array([0.3, 0.3]),
             "attn_entropy": np.array([4.0 * e, 4.0 * e]), "attn_rank": np.array([60.0, 60.0]),
             "attn_max_logit": np.array([2.0, 2.0]), "attn_rows": np.array([64.0]),
             "attn_entropy_uniform": np.array([4.0])}
        script.append(Observation(s, 3.0, {"L00": m}))
        script.append(Observation(s, None, {"L00": {"update_ratio_q": np.array([0.01]),
                                                    "update_ratio_k": np.array([0.01])}}))
    run = Run(RunSpec("lm", 0, 1e-2, 300), Path("."), {"losses": [3.0] * 300}, script)
    det = Detectors()
    logged = []
    for o, _ in replaying.at_default_cadence(script, det, run.losses):
        logged += [(o.step, p) for p in det.scalars().get("collapse_risk", {}).values()]  # what the Monitor logs
    sequence = risk_sequence(run)
    assert [(s, p) for s, _, p, collapsed in sequence if not collapsed] == logged
    steps = [s for s, _, _, _ in sequence]
    assert len(steps) == len(set(steps)) > 10  # one entry per judged sample, never a repeat at an update's step
