"""The detectors' definition written a second time (evaluation/replica.py) on hand-labelled sequences: each case
is a small series of one layer's samples whose episodes are worked out by hand from the definition, at
StatesConfig's defaults, and asserted exactly.

The samples below use 64 rows: the low-rank line is 1 + 0.1 * 63 = 7.3 (exit 10.95), the sparse line 0.5 nats
(exit 0.75), uniform attention's entropy 3.5 nats (uniform from 2.8, exit below 2.45)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diag.detectors import Observation
from diag.detectors.config import StatesConfig
from evaluation.groundtruth import Episode
from evaluation.replica import episodes, layer_needs, series_of

IN = (0.1, 2.0)  # malignant entry: sparse and low-rank
OUT = (2.0, 40.0)  # beyond both exit lines: normal attention
BETWEEN = (0.6, 2.0)  # entropy between the sparse line (0.5) and its exit line (0.75): passes neither test
NAN = (math.nan, 2.0)


def sample(heads, sink=None, rows=64.0, uniform=3.5) -> dict:
    m = {"attn_entropy": np.array([e for e, _ in heads]), "attn_rank": np.array([r for _, r in heads]),
         "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}
    if sink is not None:
        m["attn_sink"] = np.array(sink, float)
    return m


def run(script, steps, **kw) -> list[Observation]:
    """``script(step)`` -> the heads' (entropy, rank) at that step (or (heads, sink shares)); one layer, L00."""
    out = []
    for s in steps:
        got = script(s)
        heads, sink = got if isinstance(got, tuple) and isinstance(got[0], list) else (got, None)
        out.append(Observation(s, 3.0, {"L00": sample(heads, sink, **kw)}))
    return out


def found(obs, state="malignant") -> list[tuple]:
    return [(e.where, e.since, e.opened, e.until, e.baseline) for e in episodes(obs) if e.state == state]


def test_a_head_enters_after_two_samples_spanning_ten_steps_and_leaves_after_fifty():
    """In at 20-39: the entry run begins at 20 and spans 10 steps at 30 (established, since 20); out from 40:
    the exit run spans 50 steps at 90 (it ends, until 40). One head: the layer needs 1 and follows it."""
    obs = run(lambda s: [IN if 20 <= s < 40 else OUT], range(150))
    assert found(obs) == [("L00", 20, 30, 40, False), ("L00/H00", 20, 30, 40, False)]
    assert [e.state for e in episodes(obs)] == ["malignant", "malignant"]  # nothing benign, uniform or sink


def test_an_entry_run_shorter_than_the_dwell_establishes_nothing():
    """In at 20-28: 9 samples spanning 8 steps."""
    assert found(run(lambda s: [IN if 20 <= s < 29 else OUT], range(100))) == []


def test_samples_between_the_lines_do_not_break_the_entry_run_and_one_beyond_the_exit_line_does():
    """In at 20, between the lines 21-29, in at 30: two inside samples spanning 10 steps, established at 30
    since 20. With one sample beyond the exit line at 25 the run starts again at 30 and is established at 40."""
    between = run(lambda s: [IN if s in (20, 30) or s >= 30 else BETWEEN if 20 < s < 30 else OUT], range(60))
    broken = run(lambda s: [IN if s in (20, 30) or s >= 30 else OUT if s == 25 else BETWEEN if 20 < s < 30
                            else OUT], range(60))
    assert found(between) == [("L00", 20, 30, None, False), ("L00/H00", 20, 30, None, False)]
    assert found(broken) == [("L00", 30, 40, None, False), ("L00/H00", 30, 40, None, False)]


def test_sparse_samples_count_samples_and_steps():
    """Samples every 10 steps: in at 10 and 20 (2 samples spanning 10 steps): established at 20, since 10."""
    assert found(run(lambda s: [IN if s >= 10 else OUT], range(0, 100, 10)))[1] == ("L00/H00", 10, 20, None, False)


def test_an_inside_sample_resets_the_exit_run():
    """Established at 30 (since 20); out 40-69, back inside at 70, out again from 71: the exit run starts over at
    71 and ends at 121 (until 71), not at 90."""
    obs = run(lambda s: [IN if 20 <= s < 40 or s == 70 else OUT], range(200))
    assert found(obs)[1] == ("L00/H00", 20, 30, 71, False)


def test_samples_between_the_lines_do_not_break_the_exit_run():
    """Out at 40, between the lines 41-89, out at 90: two outside samples spanning 50 steps (until 40)."""
    obs = run(lambda s: [IN if 20 <= s < 40 else BETWEEN if 40 < s < 90 else OUT], range(120))
    assert found(obs)[1] == ("L00/H00", 20, 30, 40, False)


def test_a_layer_of_four_heads_needs_two_and_ends_when_one_of_them_has_left():
    """H0 in from 10 (opened 20), H1 in from 50 (opened 60): the layer enters at 60, since the second smallest
    since (50). H0 leaves: out from 150 (on its way out: the layer holds, both still in the state), gone at 200:
    the layer's episode ends at H0's until, 150. H2 is inside for 6 steps only; H3 never."""
    def heads(s):
        return [IN if 10 <= s < 150 else OUT, IN if s >= 50 else OUT, IN if 100 <= s < 106 else OUT, OUT]
    obs = run(heads, range(250))
    assert layer_needs(4, StatesConfig()) == 2
    assert found(obs) == [("L00/H00", 10, 20, 150, False), ("L00", 50, 60, 150, False),
                          ("L00/H01", 50, 60, None, False)]


def test_a_head_on_its_way_out_does_not_open_a_layer():
    """H0 in 10-99 (opened 20), out from 100 (its exit run under way until it ends at 150); H1 in from 120
    (opened 130): at 130 only H1 holds the state, so the layer of 4 heads (needing 2) never enters it."""
    obs = run(lambda s: [IN if 10 <= s < 100 else OUT, IN if s >= 120 else OUT, OUT, OUT], range(200))
    assert found(obs) == [("L00/H00", 10, 20, 100, False), ("L00/H01", 120, 130, None, False)]


def test_a_layer_of_eight_heads_needs_four():
    """Heads 0-3 in from 10, 20, 30 and 40 (opened 20, 30, 40, 50): the layer enters at 50 with the fourth
    since, 40; three heads (the same series without head 3) never make the layer."""
    def heads(count):
        return lambda s: [IN if h < count and s >= 10 * (h + 1) else OUT for h in range(8)]
    assert layer_needs(8, StatesConfig()) == 4
    four, three = found(run(heads(4), range(100))), found(run(heads(3), range(100)))
    assert [e for e in four if "/" not in e[0]] == [("L00", 40, 50, None, False)]
    assert [e for e in three if "/" not in e[0]] == []
    assert [e[1:3] for e in four if "/" in e[0]] == [(10, 20), (20, 30), (30, 40), (40, 50)]


def test_an_episode_from_the_layers_first_sample_is_a_baseline_episode():
    """Inside from the layer's first sample (step 5): since 5 is the first sample, a baseline episode; the
    head's second episode (in again from 200) is not."""
    obs = run(lambda s: [IN if s < 40 or s >= 200 else OUT], range(5, 260))
    assert found(obs) == [("L00", 5, 15, 40, True), ("L00/H00", 5, 15, 40, True),
                          ("L00", 200, 210, None, False), ("L00/H00", 200, 210, None, False)]


def test_a_sink_head_is_not_malignant_and_a_head_without_a_sink_is():
    """From step 20 both heads are sparse with rank 1.5; H0 puts 0.9 of all queries' mass on one key (a sink:
    since 20, established at 30 by the same entry dwell as malignant), H1 0.1 (malignant, since 20, opened 30).
    One head of each: neither layer state (the layer needs 2). Both heads sinks: the layer is a sink since 20."""
    sparse = (0.1, 1.5)

    def script(shares):
        return lambda s: ([sparse, sparse], shares) if s >= 20 else ([OUT, OUT], [0.05, 0.05])
    mixed = run(script([0.9, 0.1]), range(80))
    assert found(mixed, "sink") == [("L00/H00", 20, 30, None, False)]
    assert found(mixed, "malignant") == [("L00/H01", 20, 30, None, False)]
    both = run(script([0.9, 0.8]), range(80))
    assert found(both, "sink") == [("L00", 20, 30, None, False), ("L00/H00", 20, 30, None, False),
                                   ("L00/H01", 20, 30, None, False)]
    assert found(both, "malignant") == []


def test_a_sink_whose_share_falls_between_its_lines_stays_a_sink_and_its_head_becomes_malignant():
    """H0 a sink since 20 (share 0.9, established at 30); from 60 its share is 0.4: under the sink's entry line
    (0.5) and above its exit line (0.5 / 1.5 = 0.33): the sink episode stays open, and the head, no longer
    sink-in, passes the malignant entry test: malignant since 60, opened 70."""
    obs = run(lambda s: ([(0.1, 1.5)], [0.9 if s < 60 else 0.4]) if s >= 20 else ([OUT], [0.0]), range(100))
    assert found(obs, "sink") == [("L00", 20, 30, None, False), ("L00/H00", 20, 30, None, False)]
    assert found(obs, "malignant")[1] == ("L00/H00", 60, 70, None, False)


def test_samples_that_are_not_finite_change_nothing():
    """In at 20, not finite 21-29, in at 30: established at 30 since 20. Out at 100, not finite 101-149 (rank
    not finite at 120), out at 150: the episode ends at 150, until 100."""
    def head(s):
        if s == 20 or 30 <= s < 100:
            return IN
        if 20 < s < 30 or 100 < s < 150:
            return (0.1, math.nan) if s == 120 else NAN
        return OUT
    assert found(run(lambda s: [head(s)], range(200)))[1] == ("L00/H00", 20, 30, 100, False)


def test_a_head_pending_or_open_in_the_malignant_state_is_not_benign():
    """Malignant-in at 20 (pending), then sparse and full rank 21-40 (rank 9: benign-in, between the malignant
    lines): the pending malignant run blocks benign. Rank 12 at 41 (beyond the malignant exit line) ends the
    pending run: benign from 41."""
    obs = run(lambda s: [IN if s == 20 else (0.1, 9.0) if 20 < s <= 40 else (0.1, 12.0) if s > 40 else OUT],
              range(60))
    assert found(obs, "malignant") == []
    assert found(obs, "benign") == [("L00", 41, 41, None, False), ("L00/H00", 41, 41, None, False)]


def test_uniform_attention_and_no_uniform_reference():
    """Entropy 3.0 of uniform's 3.5 at rank 1.5: uniform at once. Without attn_entropy_uniform: never."""
    obs = run(lambda s: [(3.0, 1.5) if s >= 10 else OUT], range(30))
    assert found(obs, "uniform") == [("L00", 10, 10, None, False), ("L00/H00", 10, 10, None, False)]
    for o in obs:
        del o.layers["L00"]["attn_entropy_uniform"]
    assert found(obs, "uniform") == []


def test_series_default_the_missing_statistics_and_refuse_a_layer_whose_heads_change():
    obs = run(lambda s: [IN, OUT], range(3))
    x = series_of(obs)["L00"]
    assert x.sink.tolist() == [[0.0]] * 3 and x.steps.tolist() == [0, 1, 2]
    updates = Observation(3, None, {"L00": {"update_ratio_q": np.array([0.1])}})  # no attention: skipped
    assert series_of([*obs, updates])["L00"].steps.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"layer L00: .*\[1, 2\] heads"):
        series_of([*obs, Observation(3, 1.0, {"L00": sample([IN])})])


def test_episodes_are_episode_records():
    e = episodes(run(lambda s: [IN], range(20)))[0]
    assert e == Episode("malignant", "L00", 0, 10, None, True)
