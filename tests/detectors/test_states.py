"""The attention states, defined once: lines per sample, dwell per head, share per layer; the live detector and
the evaluation's ground truth (episodes_of over the attention logged at every step) are the same definition."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from diag.detectors import AlertConfig, Detectors, Observation
from diag.detectors.config import StatesConfig
from diag.detectors.states import STATES, AttentionStates, episodes_of, layer_needs, lines
from diag.detectors.states import tests as state_tests


def attention_state(entropy, rank, rows, cfg, uniform_entropy=math.inf):
    """One sample's state by the definition's entry tests ('normal' when it passes none)."""
    return next((s for s in STATES if state_tests(s, entropy, rank, rows, uniform_entropy, cfg)[0]), "normal")


def attn(entropy, rank, rows=64.0, uniform=3.5):
    return {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
            "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}


def test_low_rank_line_scales_with_rows_so_short_attention_can_be_malignant():
    cfg = StatesConfig()
    # 5 tokens (a small ViT): every query on the same key has effective rank ~1; 10% of 5 rows would be 0.5
    assert lines(5, cfg)[1] == 1.4
    assert attention_state(0.1, 1.05, 5, cfg) == "malignant"
    assert attention_state(0.1, 4.0, 5, cfg) == "benign"
    assert lines(1, cfg)[1] == 1.0 and lines(128, cfg)[1] == 1 + 0.1 * 127
    assert attention_state(3.0, 1.5, 64, cfg, uniform_entropy=3.5) == "uniform"
    assert attention_state(1.0, 1.5, 64, cfg, uniform_entropy=3.5) == "normal"  # low rank, not flat: a sink key
    assert attention_state(3.0, 1.5, 64, cfg) == "normal"  # without the uniform reference: never "uniform"


def test_reference_states_from_an_explicit_attention_matrix():
    """The lines applied to real matrices: entropy and effective rank computed by hand (float64)."""
    def state(a):
        p = a / a.sum(1, keepdims=True)
        entropy = float(np.mean(-(p * np.log(np.where(p > 0, p, 1))).sum(1)))
        s = np.linalg.svd(p, compute_uv=False)
        q = s / s.sum()
        rank = float(np.exp(-(q * np.log(np.where(q > 0, q, 1))).sum()))
        return attention_state(entropy, rank, len(a), StatesConfig(), np.log(len(a)))
    n = 5
    one_key = np.full((n, n), 1e-4)
    one_key[:, 0] = 1.0  # every query on key 0: sparse and rank ~1
    assert state(one_key) == "malignant"
    assert state(np.eye(n) + 1e-4) == "benign"  # each query on its own key: sparse, full rank
    assert state(np.ones((n, n))) == "uniform"


@pytest.mark.parametrize(("heads", "share", "needs"), [(1, 0.5, 1), (2, 0.5, 2), (4, 0.5, 2), (12, 0.5, 6),
                                                        (12, 0.25, 3), (3, 0.5, 2)])
def test_a_layer_needs_its_share_of_heads_and_two_of_them(heads, share, needs):
    assert layer_needs(heads, StatesConfig(layer_share=share)) == needs


def run(script, cfg=None, every=1):
    """Observations of one layer, one per step; returns (alerts of the live detector, episodes_of)."""
    obs = [Observation(step, None, {"L00": m}) for step, m in script if step % every == 0]
    det = AttentionStates(cfg or StatesConfig())
    return [a for o in obs for a in det.observe(o)], episodes_of(obs, cfg or StatesConfig())


def test_one_head_is_a_warning_and_the_layer_is_critical_when_its_share_of_heads_follows():
    """Head 0 collapses at step 0 and stays; head 1 at step 30: a head record (warning) each, and the layer's
    critical record once both are in (the second head's dwell met at step 40)."""
    script = [(s, attn([0.1, 0.1 if s >= 30 else 2.0], [2.0, 2.0 if s >= 30 else 40.0])) for s in range(0, 61)]
    alerts, episodes = run(script)
    firing = [(a.step, a.kind, a.level, a.where, a.since) for a in alerts if a.status == "firing"]
    assert firing == [(10, "malignant_collapse", "warning", "L00/H00", 0),
                      (40, "malignant_collapse", "warning", "L00/H01", 30),
                      (40, "malignant_collapse", "critical", "L00", 30)]
    layer = next(a for a in alerts if a.level == "critical")
    assert layer.heads == ("L00/H00", "L00/H01") and "2 of 2 heads" in layer.message
    assert [(e.where, e.since, e.opened, e.until) for e in episodes if e.state == "malignant"] == [
        ("L00/H00", 0, 10, None), ("L00", 30, 40, None), ("L00/H01", 30, 40, None)]


def test_a_layer_whose_single_head_collapses_gets_no_critical_record():
    """One head of two malignant is a head-level record only, never a critical layer record."""
    script = [(s, attn([0.1, 2.0], [2.0, 40.0])) for s in range(0, 200, 5)]
    alerts, episodes = run(script)
    assert {(a.level, a.where) for a in alerts} == {("warning", "L00/H00")}
    assert all("/" in e.where for e in episodes)


def test_live_detector_and_ground_truth_agree_on_a_noisy_run_at_every_step():
    """Random walks around the lines: the detector fed every step opens and closes exactly the episodes
    that episodes_of finds (one definition, not two)."""
    rng = np.random.default_rng(0)
    e = np.clip(0.6 + np.cumsum(rng.normal(0, 0.08, (400, 3)), 0), 0.01, 4.0)
    r = np.clip(8.0 + np.cumsum(rng.normal(0, 0.8, (400, 3)), 0), 1.0, 64.0)
    script = [(s, attn(e[s], r[s])) for s in range(400)]
    alerts, episodes = run(script)
    opened = sorted((a.where, a.since, a.step) for a in alerts if a.status == "firing" and "+" not in a.where)
    # the records announce each key's first two episodes (the second as recurring, then held)
    announced = [ep for ep in episodes
                 if [e for e in episodes if (e.where, e.state) == (ep.where, ep.state)].index(ep) < 2]
    assert opened == sorted((ep.where, ep.since, ep.opened) for ep in announced)
    assert len(episodes) >= 4  # the walk does cross the lines


def test_a_head_that_keeps_returning_gets_three_records_and_its_scalars_the_rest():
    """Four malignant episodes on one head (in for 20 steps, out for 60, over and over): its first episode is
    an alert and a resolved record, the second an alert that says it recurs; its end and the later episodes are
    held back. The ground truth still has all four."""
    script = [(s, attn([0.1 if s % 80 < 20 else 2.0, 2.0], [2.0 if s % 80 < 20 else 40.0, 40.0]))
              for s in range(0, 320, 2)]
    alerts, episodes = run(script)
    mine = [(a.step, a.status) for a in alerts if a.where == "L00/H00"]
    assert mine == [(10, "firing"), (70, "resolved"), (90, "firing")]
    assert "second episode" in alerts[-1].message and "not announced" in alerts[-1].message
    assert "second episode" not in alerts[0].message
    assert len([e for e in episodes if e.where == "L00/H00"]) == 4


def test_the_held_episodes_survive_a_resume():
    script = [(s, attn([0.1 if s % 80 < 20 else 2.0], [2.0 if s % 80 < 20 else 40.0])) for s in range(0, 320, 2)]
    whole, _ = run(script)
    first = AttentionStates(StatesConfig())
    out = [a for s, m in script[:60] for a in first.observe(Observation(s, None, {"L00": m}))]
    second = AttentionStates(StatesConfig())
    second.load_state_dict(first.state_dict())
    out += [a for s, m in script[60:] for a in second.observe(Observation(s, None, {"L00": m}))]
    assert out == whole and len(whole) == 6  # the head's three records and the one-head layer's three


def test_a_pending_malignant_state_asks_for_close_samples_until_it_is_settled():
    """A head inside the malignant lines at one sample is a candidate: the detectors ask for close attention
    samples for up to twice the dwell from its first sample, and for none once it is established or cleared."""
    det = Detectors(AlertConfig())
    assert det.confirming() == 0
    det.observe(Observation(100, None, {"L00": attn([0.1, 2.0], [2.0, 40.0])}))
    assert det.confirming() == 20
    det.observe(Observation(104, None, {"L00": attn([0.1, 2.0], [2.0, 40.0])}))
    assert det.confirming() == 16
    det.observe(Observation(110, None, {"L00": attn([0.1, 2.0], [2.0, 40.0])}))  # established: 2 samples, 10 steps
    assert det.confirming() == 0
    det.observe(Observation(120, None, {"L01": attn([0.1, 2.0], [2.0, 40.0])}))
    det.observe(Observation(122, None, {"L01": attn([2.0, 2.0], [40.0, 40.0])}))  # beyond the exit line: cleared
    assert det.confirming() == 0


def test_flapping_inside_the_exit_line_is_one_episode():
    cfg = StatesConfig()
    # between the entry line (0.5 nats) and the exit line (0.75): changes nothing
    script = [(s, attn([0.1 if s % 20 < 10 else 0.6], [2.0])) for s in range(0, 200)]
    alerts, _ = run(script, cfg)
    assert [(a.status, a.where) for a in alerts] == [("firing", "L00/H00"), ("firing", "L00")]  # a 1-head layer


def test_detectors_report_the_states_through_alert_config_fields():
    det = Detectors(AlertConfig(collapse_persist=1, sparse_entropy=0.2))
    out = det.observe(Observation(0, None, {"L00": attn([0.3], [2.0])}))
    assert out == []  # 0.3 nats is over the configured 0.2 line
    out = det.observe(Observation(1, None, {"L00": attn([0.1], [2.0])}))
    assert [(a.kind, a.where, a.level) for a in out] == [("malignant_collapse", "L00/H00", "warning"),
                                                          ("malignant_collapse", "L00", "critical")]


def test_malignant_message_says_where_since_what_to_do_and_not_the_location_twice():
    det = Detectors(AlertConfig(collapse_persist=2))
    out = []
    for step in (0, 10, 20):
        m = {"attn_entropy": np.array([0.1, 2.0]), "attn_rank": np.array([2.0, 40.0]), "attn_rows": np.array([64.0])}
        out += det.observe(Observation(step, None, {"L02": m}))
    (a,) = out
    assert (a.step, a.since, a.where, a.anchor) == (10, 0, "L02/H00", "docs/alerts.md#malignant_collapse")
    assert "since step 0" in a.message and "What to do:" in a.message and "L02" not in a.message
    assert "pointer head" in a.message


def test_states_resume_from_a_saved_state_identically():
    script = [(s, attn([0.1, 0.1 if s >= 30 else 2.0], [2.0, 2.0 if s >= 30 else 40.0])) for s in range(0, 80, 2)]
    whole, _ = run(script)
    first = AttentionStates(StatesConfig())
    out = [a for s, m in script[:12] for a in first.observe(Observation(s, None, {"L00": m}))]
    second = AttentionStates(StatesConfig())
    second.load_state_dict(first.state_dict())
    out += [a for s, m in script[12:] for a in second.observe(Observation(s, None, {"L00": m}))]
    assert out == whole


def test_a_layers_state_ends_where_the_exit_of_the_head_that_left_it_began():
    """Both heads malignant from step 0; head 1 recovers from step 100 (its exit dwell: 100 to 120): the layer's
    resolved record says it ended at 100, as the head's does, not at the step the dwell was met."""
    script = [(s, attn([0.1, 0.1 if s < 100 else 2.0], [2.0, 2.0 if s < 100 else 40.0])) for s in range(0, 200, 10)]
    alerts, episodes = run(script)
    resolved = {a.where: a for a in alerts if a.status == "resolved"}
    assert "ended at step 100" in resolved["L00/H01"].message
    assert "ended at step 100" in resolved["L00"].message
    assert [(e.where, e.until) for e in episodes if e.where == "L00"] == [("L00", 100)]


def test_a_head_on_its_way_out_does_not_open_its_layer_with_a_head_coming_in():
    """Head 0 malignant from 0 to 40, then healthy (its exit dwell: 40 to 90); head 1 malignant from 60 on: the two
    were never in the state together, so the layer is not (before the fix, its episode opened at step 70 and
    "ended" at 40). Once both hold it at once, it is."""
    def e0(s):
        return 0.1 if s < 40 or s >= 150 else 2.0
    script = [(s, attn([e0(s), 0.1 if s >= 60 else 2.0], [2.0 if e0(s) < 1 else 40.0, 2.0 if s >= 60 else 40.0]))
              for s in range(0, 200, 5)]
    alerts, episodes = run(script)
    layer = [(e.since, e.opened, e.until) for e in episodes if e.where == "L00" and e.state == "malignant"]
    assert layer == [(150, 160, None)]
    assert all(e.until is None or e.until >= e.opened for e in episodes)
    assert [(a.step, a.since) for a in alerts if a.where == "L00" and a.status == "firing"] == [(160, 150)]


def test_a_resume_from_head_episodes_only_does_not_announce_the_layer_again():
    """A state that holds the heads only (``attention_episodes``): the layer's state is derived from its heads on
    resume, silently, not fired as news."""
    script = [(s, attn([0.1, 0.1], [2.0, 2.0])) for s in range(0, 100, 10)]
    first = AttentionStates(StatesConfig())
    before = [a for s, m in script[:5] for a in first.observe(Observation(s, None, {"L00": m}))]
    assert ("critical", "L00") in {(a.level, a.where) for a in before}
    saved = first.state_dict()
    old = {"attention_episodes": saved["attention_states"]["heads"]}
    second = AttentionStates(StatesConfig())
    second.load_state_dict(old)
    after = [a for s, m in script[5:] for a in second.observe(Observation(s, None, {"L00": m}))]
    assert after == []


def test_a_layer_one_established_head_short_of_its_state_is_watched():
    """``watching``: a layer with an established malignant head whose next head would make a layer collapse
    (2 of 2 heads here; 5 of 12 at a share of 0.5), and not a layer already collapsed, nor one whose head is only
    pending, nor one two heads short."""
    det = AttentionStates(StatesConfig())
    det.observe(Observation(0, None, {"L00": attn([0.1, 2.0], [2.0, 40.0])}))
    assert det.watching() is None  # pending (its dwell not met): the confirmation's close samples, not this
    det.observe(Observation(10, None, {"L00": attn([0.1, 2.0], [2.0, 40.0])}))
    assert det.watching() == "L00 is one head short of a malignant collapse"
    det.observe(Observation(11, None, {"L00": attn([0.1, 0.1], [2.0, 2.0])}))
    det.observe(Observation(21, None, {"L00": attn([0.1, 0.1], [2.0, 2.0])}))
    assert det.layer_in("malignant", "L00") and det.watching() is None  # collapsed: nothing left to watch
    wide = AttentionStates(StatesConfig())
    for step in (0, 10):
        wide.observe(Observation(step, None, {"L01": attn([0.1] * 4 + [2.0] * 8, [2.0] * 4 + [40.0] * 8)}))
    assert wide.watching() is None  # 4 of 12 established, 6 needed: two heads short
    for step in (20, 30):
        wide.observe(Observation(step, None, {"L01": attn([0.1] * 5 + [2.0] * 7, [2.0] * 5 + [40.0] * 7)}))
    assert wide.watching() == "L01 is one head short of a malignant collapse"


def test_a_short_layer_state_whose_start_fell_between_samples_is_counted_from_its_start_at_the_default_cadence():
    """Head 0 established early, head 1 enters at step 134 and the layer's state ends at 148, 4 steps after the
    ground truth establishes it (144). Close samples every 10 steps would first show head 1 at 140, so the dwell
    counted from there ends after the state; watching the layer every ``watch_every`` steps shows it at 134 and
    the critical record comes at 144, before the state ends. Head 1 entering at an odd step (135), the layer's
    state ending one step after it is established (146): watched every 2 steps head 1 is first seen at 136 and
    the dwell counted from there ends after the state; watched every step (the default) the record comes at 145.
    Replayed as the evaluation replays (evaluation.detectors.at_default_cadence)."""
    import functools

    from evaluation import detectors as evaluate_detectors
    from hooks.monitor.cadence import CloserLook, CloserLookConfig

    def script(enter, leave):
        def head1(s):
            return enter <= s < leave
        return [Observation(s, 3.0, {"L00": attn([0.1, 0.1 if head1(s) else 2.0],
                                                 [2.0, 2.0 if head1(s) else 40.0])}) for s in range(0, 200)]

    def truth(steps):
        return [(e.where, e.since, e.opened, e.until) for e in episodes_of(steps, StatesConfig())
                if e.state == "malignant" and "/" not in e.where]

    def critical(steps, watch_every):
        original = evaluate_detectors.CloserLook
        evaluate_detectors.CloserLook = functools.partial(CloserLook, watch_every=watch_every)
        try:
            det = Detectors(AlertConfig())
            alerts = [a for _, out in evaluate_detectors.at_default_cadence(steps, det) for a in out]
        finally:
            evaluate_detectors.CloserLook = original
        return [(a.step, a.since) for a in alerts if a.level == "critical" and a.status == "firing"]

    assert CloserLookConfig.watch_every == 1
    even, odd = script(134, 148), script(135, 146)
    assert truth(even) == [("L00", 134, 144, 148)] and truth(odd) == [("L00", 135, 145, 146)]
    assert critical(even, CloserLookConfig.watch_every) == critical(even, 2) == [(144, 134)]
    assert critical(even, 10) == []  # no watch: first seen at 140, and the state is over at 148
    assert critical(odd, CloserLookConfig.watch_every) == [(145, 135)]
    assert critical(odd, 2) == []  # first seen at 136: the dwell counted from there ends at 146, with the state


def test_a_head_between_the_malignant_lines_is_noted_from_the_first_sample_of_its_stay():
    """``between``: a head neither inside the malignant entry lines nor beyond the exit lines (entropy 0.5 and
    0.75 nats here, rank 7.3 and 10.95 of 64 rows), in no episode, from the first sample of its stay; it leaves
    the record beyond the exit lines or inside the entry lines, and the record survives a resume."""
    det = AttentionStates(StatesConfig())
    det.observe(Observation(0, None, {"L00": attn([2.0, 2.0], [40.0, 40.0])}))
    assert det.between == {} and det.entered_between("L00") is None
    det.observe(Observation(10, None, {"L00": attn([0.6, 2.0], [5.0, 40.0])}))
    det.observe(Observation(20, None, {"L00": attn([0.7, 0.6], [5.0, 5.0])}))
    assert det.between == {"L00/H00": 10, "L00/H01": 20} and det.entered_between("L00") == 20
    det.observe(Observation(30, None, {"L00": attn([2.0, 0.1], [40.0, 2.0])}))  # out; inside (a candidate)
    assert det.between == {} and det.entered_between("L00") is None
    det.observe(Observation(40, None, {"L00": attn([0.6, 0.1], [5.0, 2.0])}))  # a new stay of head 0
    assert det.between == {"L00/H00": 40}
    det.observe(Observation(45, None, {"L01": attn([float("nan"), 0.6], [5.0, float("inf")])}))
    assert det.between == {"L00/H00": 40}  # a sample that is not finite is not between the lines
    again = AttentionStates(StatesConfig())
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.between == {"L00/H00": 40} and again.entered_between("L00") == 40
