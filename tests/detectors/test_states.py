"""The attention states, defined once: lines per sample, dwell per head, share per layer, the baseline; the live
detector and episodes_of (the states of a whole recorded run) are the same machine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diag.detectors import AlertConfig, Detectors, Observation
from diag.detectors.config import StatesConfig
from diag.detectors.states import STATES, AttentionStates, episodes_of, layer_needs, lines
from diag.detectors.states import tests as state_tests


def attention_state(entropy, rank, rows, cfg, uniform_entropy=math.inf, share=0.0):
    """One sample's state by the definition's entry tests ('normal' when it passes none)."""
    return next((s for s in STATES if state_tests(s, entropy, rank, rows, uniform_entropy, cfg, share)[0]), "normal")


def attn(entropy, rank, rows=64.0, uniform=3.5, sink=None):
    m = {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
         "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}
    if sink is not None:
        m["attn_sink"] = np.array(sink, float)
        m["attn_sink_pos"] = np.zeros(len(m["attn_entropy"]))
    return m


def normal(n):
    """A sample of n heads far from every line."""
    return attn([3.0] * n, [40.0] * n)


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


def run(script, cfg=None, every=1, baseline=False):
    """Observations of one layer, one per step; returns (alerts of the live detector, episodes_of). Unless
    ``baseline``, a sample far from every line comes first, one step before the script: the script's states begin
    during the run, not when monitoring began."""
    obs = [Observation(step, None, {"L00": m}) for step, m in script if step % every == 0]
    if not baseline:
        first, m = obs[0].step, obs[0].layers["L00"]
        obs.insert(0, Observation(first - 1, None, {"L00": normal(len(m["attn_entropy"]))}))
    det = AttentionStates(cfg or StatesConfig())
    return [a for o in obs for a in det.observe(o)], episodes_of(obs, cfg or StatesConfig())


def test_heads_and_then_their_layer_entering_the_malignant_state_are_warnings():
    """Head 0 collapses at step 0 and stays; head 1 at step 30: a head record (warning) each, and the layer's
    record (warning) once both are in (the second head's dwell met at step 40). The critical record is the
    damage's (diag.detectors.damage), not the state's."""
    script = [(s, attn([0.1, 0.1 if s >= 30 else 2.0], [2.0, 2.0 if s >= 30 else 40.0])) for s in range(0, 61)]
    alerts, episodes = run(script)
    firing = [(a.step, a.kind, a.level, a.where, a.since) for a in alerts if a.status == "firing"]
    assert firing == [(10, "malignant_collapse", "warning", "L00/H00", 0),
                      (40, "malignant_collapse", "warning", "L00/H01", 30),
                      (40, "malignant_collapse", "warning", "L00", 30)]
    layer = next(a for a in alerts if a.where == "L00")
    assert layer.heads == ("L00/H00", "L00/H01") and "2 of 2 heads" in layer.message
    assert [(e.where, e.since, e.opened, e.until, e.baseline) for e in episodes if e.state == "malignant"] == [
        ("L00/H00", 0, 10, None, False), ("L00", 30, 40, None, False), ("L00/H01", 30, 40, None, False)]


def test_a_layer_whose_single_head_collapses_gets_no_layer_record():
    """One head of two malignant is a head-level record only."""
    script = [(s, attn([0.1, 2.0], [2.0, 40.0])) for s in range(0, 200, 5)]
    alerts, episodes = run(script)
    assert {(a.level, a.where) for a in alerts} == {("warning", "L00/H00")}
    assert all("/" in e.where for e in episodes)


def test_states_present_when_monitoring_began_are_the_baseline_and_info():
    """The same heads, in the state from the first sample on: a pretrained model's heads as they came. Every
    record is info and says so; the episodes are the baseline's. A head that enters later is news again."""
    script = [(s, attn([0.1, 0.1, 0.1 if s >= 30 else 2.0], [2.0, 2.0, 2.0 if s >= 30 else 40.0]))
              for s in range(0, 61)]
    alerts, episodes = run(script, baseline=True)
    firing = [(a.step, a.level, a.where) for a in alerts if a.status == "firing"]
    assert firing == [(10, "info", "L00/H00+H01"), (10, "info", "L00"), (40, "warning", "L00/H02")]
    assert all("when monitoring began" in a.message for a in alerts if a.level == "info")
    assert {(e.where, e.baseline) for e in episodes} == {("L00/H00", True), ("L00/H01", True),
                                                         ("L00", True), ("L00/H02", False)}


def test_a_sink_is_its_own_state_and_never_malignant():
    """Most of every query's mass on one shared key (attn_sink 0.95): a sink (info, once it held for the entry
    dwell, as a malignant head must), not a malignant collapse, even when it appears during the run. The same
    entropy and rank with the mass spread over a few keys that differ between sequences (attn_sink 0.3) is malignant."""
    cfg = StatesConfig()
    assert attention_state(0.1, 1.1, 64, cfg, share=0.95) == "sink"
    assert attention_state(0.1, 1.1, 64, cfg, share=0.3) == "malignant"
    # a built-in sink after a fine-tune: 0.93 of the mass still on position 0, the rest spread differently by
    # each query (effective rank 4.5 of 256 rows): still a sink; and a sparse sink is never benign either
    assert attention_state(0.4, 4.5, 256, cfg, share=0.93) == "sink"
    assert attention_state(0.4, 30.0, 64, cfg, share=0.9) == "sink"
    script = [(s, attn([0.1, 0.1], [1.1, 1.1], sink=[0.95, 0.3])) for s in range(0, 30)]
    alerts, episodes = run(script)
    assert [(a.step, a.kind, a.level, a.where) for a in alerts if a.status == "firing"] == [
        (10, "attention_sink", "info", "L00/H00"), (10, "malignant_collapse", "warning", "L00/H01")]
    sink = next(a for a in alerts if a.kind == "attention_sink")
    assert "key position 0 holds 0.95" in sink.message and sink.values["attn_sink"] == 0.95
    assert {e.state for e in episodes} == {"sink", "malignant"}


def test_a_collapsed_head_over_the_sink_line_for_a_sample_is_malignant_and_stays_near():
    """A collapsed head whose share on one shared position wanders around the sink line (0.3, then 0.6 at one
    sample, then 0.3 again) is no sink: the sample over the line refuses the malignant test there, the sink's
    entry dwell is not met, and the head stays near the lines (attention at every step) until its malignant
    dwell is met. A sink must hold for the entry dwell."""
    det = AttentionStates(StatesConfig())
    shares = {20: 0.3, 21: 0.6, 22: 0.3, 23: 0.3}
    alerts = []
    for s in range(0, 40):
        share = shares.get(s, 0.3) if s >= 20 else 0.05
        ent, rank = (0.1, 1.1) if s >= 20 else (3.0, 40.0)
        alerts += det.observe(Observation(s, None, {"L00": attn([ent, 3.0], [rank, 40.0], sink=[share, 0.05])}))
        if s == 21:
            assert det.near() is not None  # over the sink line, not yet a sink: still looked at closely
    firing = [(a.step, a.kind, a.where) for a in alerts if a.status == "firing"]
    assert firing == [(30, "malignant_collapse", "L00/H00")]
    # the same head holding 0.6 for the dwell is a sink, and no longer near
    det = AttentionStates(StatesConfig())
    for s in range(0, 40):
        share, ent, rank = (0.6, 0.1, 1.1) if s >= 20 else (0.05, 3.0, 40.0)
        det.observe(Observation(s, None, {"L00": attn([ent, 3.0], [rank, 40.0], sink=[share, 0.05])}))
    assert det.holds("sink", "L00/H00") and not det.holds("malignant", "L00/H00") and det.near() is None


def test_the_records_announce_each_episode_of_the_machine_on_a_noisy_run():
    """Random walks around the lines: the records the detector fed every step raises open exactly the episodes
    episodes_of finds (its first two per key: the second announced as recurring, then held)."""
    rng = np.random.default_rng(0)
    e = np.clip(0.6 + np.cumsum(rng.normal(0, 0.08, (400, 3)), 0), 0.01, 4.0)
    r = np.clip(8.0 + np.cumsum(rng.normal(0, 0.8, (400, 3)), 0), 1.0, 64.0)
    script = [(s, attn(e[s], r[s])) for s in range(400)]
    alerts, episodes = run(script)
    opened = sorted((a.where, a.since, a.step) for a in alerts if a.status == "firing" and "+" not in a.where)
    announced = [ep for ep in episodes
                 if [e for e in episodes if (e.where, e.state) == (ep.where, ep.state)].index(ep) < 2]
    assert opened == sorted((ep.where, ep.since, ep.opened) for ep in announced)
    assert len(episodes) >= 4  # the walk does cross the lines


@pytest.mark.parametrize("seed", range(6))
def test_the_detector_and_the_evaluations_second_implementation_find_the_same_episodes(seed):
    """The same definition written twice (diag.detectors.states, a stream, and evaluation.replica, vectorised
    over the whole series): random walks of 4 heads' entropy, rank and sink share around every line, at
    every step and at every 3rd, give the same episodes (state, where, since, opened, until, baseline)."""
    from evaluation import replica

    rng = np.random.default_rng(seed)
    e = np.clip(0.6 + np.cumsum(rng.normal(0, 0.1, (500, 4)), 0), 0.01, 4.0)
    r = np.clip(6.0 + np.cumsum(rng.normal(0, 0.9, (500, 4)), 0), 1.0, 64.0)
    share = np.clip(0.4 + np.cumsum(rng.normal(0, 0.05, (500, 4)), 0), 0.0, 1.0)
    for every in (1, 3):
        obs = [Observation(s, None, {"L00": attn(e[s], r[s], sink=share[s])}) for s in range(0, 500, every)]
        mine = {(x.state, x.where, x.since, x.opened, x.until, x.baseline) for x in episodes_of(obs, StatesConfig())}
        theirs = {(x.state, x.where, x.since, x.opened, x.until, x.baseline) for x in replica.episodes(obs)}
        assert mine == theirs and len(mine) >= 3


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
    whole, _ = run(script, baseline=True)
    first = AttentionStates(StatesConfig())
    out = [a for s, m in script[:60] for a in first.observe(Observation(s, None, {"L00": m}))]
    second = AttentionStates(StatesConfig())
    second.load_state_dict(first.state_dict())
    out += [a for s, m in script[60:] for a in second.observe(Observation(s, None, {"L00": m}))]
    assert out == whole and len(whole) == 6  # the head's three records and the one-head layer's three


def test_a_head_near_the_lines_asks_for_attention_at_every_step_for_twice_the_dwell():
    """A head inside or between the malignant lines, not a sink, of a layer not collapsed, asks for attention at
    every step (``near``) for twice the dwell from its first sample there (long enough to establish the head and
    its layer); not beyond the exit lines, as a sink, in a collapsed layer, or after hovering that long."""
    det = AttentionStates(StatesConfig())
    det.observe(Observation(90, None, {"L00": normal(3)}))
    assert det.near() is None
    det.observe(Observation(100, None, {"L00": attn([0.1, 2.0, 2.0], [2.0, 40.0, 40.0])}))
    assert det.near() == "L00/H00 came near the malignant lines at step 100"
    det.observe(Observation(110, None, {"L00": attn([0.1, 2.0, 2.0], [2.0, 40.0, 40.0])}))  # established
    assert det.holds("malignant", "L00/H00") and det.near() is not None  # its layer waits for a second head
    det.observe(Observation(120, None, {"L00": attn([0.1, 2.0, 2.0], [2.0, 40.0, 40.0])}))
    assert det.near() is None  # twice the dwell: back to the cadence
    det.observe(Observation(121, None, {"L01": attn([0.1, 2.0], [2.0, 40.0])}))
    det.observe(Observation(122, None, {"L01": attn([2.0, 2.0], [40.0, 40.0])}))  # beyond the exit line: cleared
    assert det.near() is None
    det.observe(Observation(130, None, {"L02": attn([0.6, 0.1], [5.0, 1.1], sink=[0.1, 0.9])}))  # between; a sink
    assert det.near() == "L02/H00 came near the malignant lines at step 130"
    det.observe(Observation(150, None, {"L02": attn([0.6, 0.1], [5.0, 1.1], sink=[0.1, 0.9])}))
    assert det.near() is None and det.nearing == {"L00/H00": 100, "L02/H00": 130}  # hovering, noted
    for step in (200, 201, 210, 211):  # both heads of L03 collapse: the layer is in the state, nothing near
        det.observe(Observation(step, None, {"L03": attn([0.1, 0.1], [2.0, 2.0]) if step > 200 else normal(2)}))
    assert det.layer_in("malignant", "L03") and not [k for k in det.nearing if k.startswith("L03")]


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
                                                          ("malignant_collapse", "L00", "warning")]


def test_malignant_message_says_where_since_what_to_do_and_not_the_location_twice():
    det = Detectors(AlertConfig(collapse_persist=2))
    out = []
    for step in (0, 10, 20, 30):
        e = [0.1 if step else 2.0, 2.0]
        m = {"attn_entropy": np.array(e), "attn_rank": np.array([2.0, 40.0]), "attn_rows": np.array([64.0])}
        out += det.observe(Observation(step, None, {"L02": m}))
    (a,) = out
    assert (a.step, a.since, a.where, a.anchor) == (20, 10, "L02/H00", "docs/alerts.md#malignant_collapse")
    assert "since step 10" in a.message and "What to do:" in a.message and "L02" not in a.message
    assert "pointer head" in a.message


def test_states_resume_from_a_saved_state_identically():
    script = [(s, attn([0.1, 0.1 if s >= 30 else 2.0], [2.0, 2.0 if s >= 30 else 40.0])) for s in range(0, 80, 2)]
    whole, _ = run(script, baseline=True)
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
    script = [(s, attn([0.1, 0.1], [2.0, 2.0]) if s else normal(2)) for s in range(0, 100, 10)]
    first = AttentionStates(StatesConfig())
    before = [a for s, m in script[:5] for a in first.observe(Observation(s, None, {"L00": m}))]
    assert ("warning", "L00") in {(a.level, a.where) for a in before}
    saved = first.state_dict()
    old = {"attention_episodes": saved["attention_states"]["heads"]}
    second = AttentionStates(StatesConfig())
    second.load_state_dict(old)
    after = [a for s, m in script[5:] for a in second.observe(Observation(s, None, {"L00": m}))]
    assert after == []


def test_a_collapse_a_sampled_step_shows_near_the_lines_is_counted_from_where_it_began_at_the_default_cadence():
    """Head 1 comes between the lines at step 130 and inside them from 134 to 148; the sample at 130 (a loss step of
    the default cadence with a close look on for the layer's risk) shows it near the lines, attention follows at
    every step, and the head's record comes where the ground truth has it established (144), since 134. Replayed
    as the evaluation replays (evaluation.detectors.at_default_cadence)."""
    from evaluation import detectors as evaluate_detectors

    def head1(s):
        return 0.1 if 134 <= s < 148 else 0.6 if 130 <= s < 134 else 2.0

    steps = [Observation(s, 3.0, {"L00": attn([2.0, head1(s)], [40.0, 2.0 if head1(s) < 1 else 40.0])})
             for s in range(0, 200)]
    truth = [(e.where, e.since, e.opened) for e in episodes_of(steps, StatesConfig()) if e.state == "malignant"]
    assert truth == [("L00/H01", 134, 144)]

    class AtRisk(Detectors):  # a layer at risk from step 100: the close look samples attention with every loss
        def at_risk(self):
            return "at risk" if self.step >= 100 else None

        def observe(self, obs):
            self.step = obs.step
            return super().observe(obs)

    det = AtRisk(AlertConfig())
    det.step = -1
    alerts = [a for _, out in evaluate_detectors.at_default_cadence(steps, det) for a in out]
    assert [(a.step, a.since, a.where) for a in alerts if a.kind == "malignant_collapse"
            and a.status == "firing"] == [(144, 134, "L00/H01")]
