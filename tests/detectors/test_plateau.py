"""Plateau and Eureka-moment in steps: no moment from one noisy batch, the trend of a sinking plateau."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from diag.detectors import AlertConfig, Detectors, Observation
from diag.detectors.plateau import Plateau

# the spectra and attention of a softmax plateau: sigma_1(Wq^T Wk) still under updates of 1%, attention at 0.9 of
# uniform's entropy (a missing signal is missing: a plateau is flagged only on what it claims)
STILL = {"qk_sigma1": np.array([1.0]), "attn_entropy": np.array([2.7]), "attn_entropy_uniform": np.array([3.0]),
         "update_ratio_q": np.array([0.01]), "update_ratio_k": np.array([0.01])}


def run(losses, every=1, ratio=0.2, cfg=None, ratio_after=None):
    det, out = Detectors(cfg or AlertConfig(plateau_window=100, eureka_drop=0.1, eureka_noise=4.0,
                                           eureka_depth=0.0)), []
    for step in range(0, len(losses), every):
        r = ratio if ratio_after is None or step < ratio_after[0] else ratio_after[1]
        out += det.observe(Observation(step, float(losses[step]), {"L00": {**STILL, "grad_ratio_qk_v": np.array([r])}}))
    return out


def test_one_noisy_batch_is_no_moment_and_a_real_drop_is_one_at_any_interval():
    rng = np.random.default_rng(0)
    losses = 1.4 - 0.0002 * np.arange(600) + 0.03 * rng.standard_normal(600)  # a slowly sinking plateau
    losses[300] = 0.9  # one noisy batch
    losses[450:] = np.linspace(1.2, 0.3, 150)  # the Eureka-moment at 450
    for every in (1, 2, 5, 10, 20):
        out = run(losses, every, ratio_after=(440, 0.5))
        moments = [a for a in out if a.kind == "eureka_moment"]
        assert len(moments) == 1, every
        # the median of the last eureka_span=20 steps is 10% below the trend ~20 steps after the drop starts
        assert 450 <= moments[0].since <= 450 + max(2 * every, 25), (every, moments[0].since)
        plateau = [a for a in out if a.kind == "eureka_plateau"]
        assert [a.status for a in plateau] == ["firing", "resolved"]
        assert plateau[0].step <= 100 + every  # windows in steps: flagged as soon as 100 steps are seen


def test_plateau_window_is_in_steps_not_samples():
    losses = np.full(400, 1.3)
    for every in (2, 10, 20):
        (first,) = [a for a in run(losses, every) if a.kind == "eureka_plateau"]
        assert 99 <= first.step <= 100 + every, (every, first.step)


def test_healthy_qk_gradients_give_no_plateau():
    assert run(np.full(400, 1.3), ratio=0.8) == []


def _layers(step, ratio, sigma, uniformity, update=0.01, uniform=3.0):
    """One layer of 2 heads: Q/K:V gradient ratio, sigma_1(Wq^T Wk) per head, Q/K update ratios ``update``,
    attention at ``uniformity`` of uniform's entropy (``uniform`` nats over the same keys)."""
    return {"L00": {**STILL, "grad_ratio_qk_v": np.array([ratio]), "qk_sigma1": np.array(sigma, float),
                    "update_ratio_q": np.array([update]), "update_ratio_k": np.array([update]),
                    "attn_entropy": np.array([uniform * uniformity] * 2), "attn_rank": np.array([20.0] * 2),
                    "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([uniform])}}


def _flat_run(sigma_of_step, uniformity, cfg=None, update=0.01, uniform=3.0):
    """A flat loss, Q/K gradients at 0.3x of V's, every family every 10 steps for 500 steps."""
    det, out = Detectors(cfg or AlertConfig()), []
    for step in range(0, 500, 10):
        out += det.observe(Observation(step, 1.3, _layers(step, 0.3, sigma_of_step(step), uniformity, update,
                                                          uniform)))
    return [a for a in out if a.kind == "eureka_plateau"]


@settings(max_examples=40, deadline=None)
@given(keys=st.integers(2, 8192), spread=st.floats(0.05, 1.0))
def test_a_stuck_layer_is_one_whose_heads_spread_over_the_same_share_of_the_keys_at_any_context(keys, spread):
    """Whether a layer has learned where to look is read as the share of the keys its least uniform head spreads
    over (perplexity against uniform's, ``exp(-gap)``), the same at 17 keys and at 8,192: a head over 30% of 4,096
    keys (1.2 nats under uniform's 8.3: 86% of its entropy) has learned as much as one over 30% of 17 keys (1.2
    nats under 2.8: 58% of it); neither is stuck at the default gap of 1 nat (37% of the keys)."""
    uniform = math.log(keys)
    gap = -math.log(spread)
    assume(gap < uniform)  # a head over fewer keys than one
    flagged = _flat_run(lambda s: [1.0, 2.0], (uniform - gap) / uniform, uniform=uniform)
    assert bool(flagged) == (gap <= 1.0 + 1e-9) or abs(gap - 1.0) < 1e-6, (keys, spread, flagged)


def test_a_plateau_needs_query_key_weights_that_do_not_move_and_diffuse_attention():
    """The alert says the model is stuck because attention learns slowly (Hoffmann et al.): sigma_1(Wq^T Wk)
    must move little per unit of the Q/K updates applied (ln growth / (steps x update ratio) <=
    plateau_qk_motion: schedule-free, where a growth per window would be confounded by a decaying learning
    rate); a flat loss with attention already focused (LLaMA's, 0.53-0.62 of uniform) is not that state
    either."""
    still = _flat_run(lambda s: [1.0, 2.0], 0.85)
    assert [(a.step, a.status) for a in still] == [(200, "firing")]  # the window (0, 200]: samples 10..200
    assert still[0].values["qk_motion"] == pytest.approx(0.0) and still[0].values["qk_sigma1_growth"] == 1.0
    assert still[0].values["attn_uniformity"] == pytest.approx(0.85)
    assert "sigma_1(Wq^T Wk) moved 0.00 per unit of the Q/K updates" in still[0].message
    assert still[0].values["attn_entropy_gap"] == pytest.approx(0.45)  # 3 nats of uniform's, 85% of them
    assert "within 0.45 nats of uniform's (at least 85% of it" in still[0].message
    assert "still sinks" not in still[0].message  # a flat loss
    # one head x1, the other x4 per 190 steps until step 300: over the samples t - 190 .. t the heads' mean ln
    # growth is 0.5 ln 4 (490 - t) / 190, per unit of 190 steps x 1% of updates: <= 0.12 from t = 427.5 (a line
    # set below the default 0.25, so that the motion, not the window's growth of at most 1.35x, decides)
    line = AlertConfig(plateau_qk_motion=0.12)
    growing = _flat_run(lambda s: [1.0, 2.0 * 4 ** (min(s, 300) / 190)], 0.85, line)
    assert [a.step for a in growing] == [430]
    # schedule-free: half the updates and half the growth (a decayed learning rate) is the same motion
    slower = _flat_run(lambda s: [1.0, 2.0 * 2 ** (min(s, 300) / 190)], 0.85, line, update=0.005)
    assert [a.step for a in slower] == [430]
    # at the default line 0.25 the motion allows t >= 359.8, the growth (geometric mean over the heads,
    # sqrt(4^((490 - t) / 190)) <= 1.35) t >= 407.7: the first sample after both is 410
    assert [a.step for a in _flat_run(lambda s: [1.0, 2.0 * 4 ** (min(s, 300) / 190)], 0.85)] == [410]
    assert _flat_run(lambda s: [1.0 * 1.004**s, 2.0 * 1.004**s], 0.85) == []  # 0.4% per step for ever: motion 0.4
    assert _flat_run(lambda s: [1.0, 2.0], 0.65) == []  # focused attention: 1.05 nats under uniform's 3
    # the lines are AlertConfig fields
    assert _flat_run(lambda s: [1.0, 2.0], 0.65, AlertConfig(plateau_entropy_gap=1.2))[0].step == 200
    off = AlertConfig(plateau_qk_motion=float("inf"), plateau_max_growth=float("inf"))
    assert _flat_run(lambda s: [s + 1.0, s + 1.0], 0.85, off)[0].step == 200


def test_a_query_key_product_that_grew_much_over_the_window_is_no_plateau_whatever_its_motion():
    """Over a window holding the run's first steps, whose update ratios are as large as the weights, a
    query/key product grown 3-7x is a small motion per unit of them (GPT-2 and BERT of Hugging Face at step
    200 grow 4.0x and 3.2x at motion 0.08 and 0.05). sigma_1 x3 over the first
    100 steps, then still, with updates of 30% (motion ln 3 / (190 x 0.3) = 0.02): refused while the window
    holds most of the growth, flagged once it has rolled past enough: over the samples t - 190 .. t the growth is
    3 ** ((290 - t) / 100), at most 1.35 from t = 262.7."""
    grown = _flat_run(lambda s: [3.0 ** (min(s, 100) / 100)] * 2, 0.85, update=0.3)
    assert [a.step for a in grown] == [270]
    assert grown[0].values["qk_sigma1_growth"] == pytest.approx(3.0 ** 0.2)
    assert _flat_run(lambda s: [3.0 ** (min(s, 100) / 100)] * 2, 0.85, AlertConfig(plateau_max_growth=float("inf")),
                     update=0.3)[0].step == 200


def _decaying_run(update_of_step, cfg=None, start=600, steps=1000):
    """A loss falling 20% per 100 steps until ``start``, flat after it (at 0.33 of the first loss), Q/K still and
    gradients at 0.3x of V's; the Q/K update ratio ``update_of_step(step)``, every 10 steps."""
    det, out = Detectors(cfg or AlertConfig()), []
    for step in range(0, steps, 10):
        loss = 1.3 * 1.2 ** (max(start - step, 0) / 100)  # 20% per 100 steps, then flat
        out += det.observe(Observation(step, loss, _layers(step, 0.3, [1.0, 2.0], 0.85, update_of_step(step))))
    return [a for a in out if a.kind == "eureka_plateau"]


def test_a_loss_flat_under_a_decayed_learning_rate_is_no_plateau():
    """Hugging Face GPT-2 under warmup + cosine goes flat at steps 880-900 of 1,000, where its Q/K update ratios
    are 6-12% of their largest; its NormSoftmax twin is no faster: it has stopped training, it is not stuck. The
    latest Q/K update must be at least plateau_min_update (0.25) of the largest since half a window into the run
    (not before: a run without warmup takes first steps as large as its weights). A constant learning rate is
    flagged once the loss has been flat a window; the same run whose updates decayed to 5% before its loss went
    flat is not; with the test off (0) it is."""
    constant = _decaying_run(lambda s: 0.01)
    assert [a.step for a in constant] == [670]
    cosine = [0.01 if s < 400 else 0.0005 for s in range(0, 1000, 10)]
    assert _decaying_run(lambda s: cosine[s // 10]) == []
    off = AlertConfig(plateau_min_update=0)
    assert [a.step for a in _decaying_run(lambda s: cosine[s // 10], off)] == [670]
    # huge first updates (no warmup) do not count: the largest is taken from half a window (100 steps) on
    first = [0.5 if s < 100 else 0.01 for s in range(0, 1000, 10)]
    assert [a.step for a in _decaying_run(lambda s: first[s // 10])] == [670]
    # the largest window survives a resume: resumed at step 450, the decayed run is still no plateau
    det = Detectors(AlertConfig())
    for step in range(0, 1000, 10):
        if step == 450:
            state = json.loads(json.dumps(det.state_dict()))
            assert state["plateau_peak_update"] == pytest.approx(0.01)  # the largest sample from step 100 on
            det = Detectors(AlertConfig())
            det.load_state_dict(state)
        loss = 1.3 * 1.2 ** (max(600 - step, 0) / 100)
        alerts = det.observe(Observation(step, loss, _layers(step, 0.3, [1.0, 2.0], 0.85, cosine[step // 10])))
        assert not [a for a in alerts if a.kind == "eureka_plateau"], step


def test_a_decay_seen_only_at_the_latest_sparse_update_sample_counts():
    """At the default cadence the update ratios come every 100 steps, after the loss sample of their step: at a
    loss sample the latest is up to 100 steps old. A warmup + cosine run whose losses go flat from step 300 (its
    updates: 0.003 in warmup, 0.03, 0.012, 0.0058, 0.0023 at steps 0-400, as a byte-level GPT-2 of 4 x 8 x 128
    had them) is no plateau: from step 370, where the same losses at a constant rate are flagged, the latest update
    (0.0058, of step 300) is under a quarter of the largest (0.03)."""
    updates = {0: 0.003, 100: 0.03, 200: 0.012, 300: 0.0058, 400: 0.0023}
    det, out = Detectors(), []
    for step in range(0, 500, 10):
        loss = 1.3 * 1.2 ** (max(300 - step, 0) / 100)
        layers = _layers(step, 0.3, [1.0, 2.0], 0.85, updates.get(step, 0.01))
        if step not in updates:  # the update ratios only at their own samples
            layers["L00"] = {k: v for k, v in layers["L00"].items() if not k.startswith("update_")}
        out += det.observe(Observation(step, loss, layers))
    assert [a for a in out if a.kind == "eureka_plateau"] == []
    constant = {s: 0.01 for s in updates}  # the same losses at a constant learning rate: flagged
    det, out = Detectors(), []
    for step in range(0, 500, 10):
        layers = _layers(step, 0.3, [1.0, 2.0], 0.85, constant.get(step, 0.01))
        if step not in constant:
            layers["L00"] = {k: v for k, v in layers["L00"].items() if not k.startswith("update_")}
        out += det.observe(Observation(step, 1.3 * 1.2 ** (max(300 - step, 0) / 100), layers))
    assert [a.step for a in out if a.kind == "eureka_plateau"][:1] == [370]


def test_a_plateau_without_spectra_or_attention_is_not_flagged():
    """A window without the spectra or the attention does not pass the entry tests (unknown is no pass): a
    plateau is flagged only on the evidence it states."""
    det, out = Detectors(), []
    for step in range(0, 400, 10):
        out += det.observe(Observation(step, 1.3, {"L00": {"grad_ratio_qk_v": np.array([0.3])}}))
    assert out == []
    assert [a.step for a in run(np.full(400, 1.3))][:1] == [99]  # with them
    # a loss still sinking 2% per 100 steps is flat enough (halves 2% apart) and the message says it sinks
    (first,) = [a for a in run(1.3 * (1 - 0.0002 * np.arange(400))) if a.kind == "eureka_plateau"]
    assert "The loss still sinks 2.0% per 100 steps" in first.message


def test_a_rising_loss_is_no_plateau():
    """A loss that rises, even by less than plateau_rel, is not flat."""
    assert run(1.3 * (1 + 0.0005 * np.arange(400))) == []  # +10% per 200 steps
    assert [a.step for a in run(np.full(400, 1.3))][:1] == [99]


def test_a_state_without_the_windows_signals_resumes():
    """Points of the plateau window saved as [step, ratio, entropy] without the window's signals load with
    ln sigma_1 and the uniformity unknown; the resumed detector flags the plateau as the saved one would have."""
    det = Detectors(AlertConfig())
    for step in range(0, 150, 10):
        det.observe(Observation(step, 1.3, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
    state = det.state_dict()
    assert len(state["loss_points"][0]) == 3  # the points keep three fields; the signals are saved apart
    del state["loss_signals"]
    resumed = Detectors(AlertConfig())
    resumed.load_state_dict(state)
    out = [a for step in range(150, 250, 10)
           for a in resumed.observe(Observation(step, 1.3, _layers(step, 0.3, [1.0, 2.0], 0.85)))]
    assert [(a.kind, a.step) for a in out] == [("eureka_plateau", 200)]


def test_the_entry_tests_signals_survive_a_resume():
    """The window's sigma_1, update ratios and uniformity are saved: a run resumed at step 200 flags the plateau
    at the step the uninterrupted run does. Early on sigma_1 still grows x4 and attention is focused, so a resumed
    window that forgot those samples would flag it earlier."""
    def obs(step):
        sigma = 4 ** (min(step, 100) / 100)
        return Observation(step, 1.3, _layers(step, 0.3, [sigma, 2 * sigma], 0.5 if step < 100 else 0.9))

    steps = range(0, 500, 10)
    whole = Detectors(AlertConfig())
    expected = [(a.kind, a.step) for t in steps for a in whole.observe(obs(t))]
    assert expected and expected[0][0] == "eureka_plateau" and expected[0][1] > 200
    first = Detectors(AlertConfig())
    got = [(a.kind, a.step) for t in steps if t <= 200 for a in first.observe(obs(t))]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Detectors(AlertConfig())
    resumed.load_state_dict(state)
    got += [(a.kind, a.step) for t in steps if t > 200 for a in resumed.observe(obs(t))]
    assert got == expected
    forgetful = Detectors(AlertConfig())
    del state["loss_signals"]
    forgetful.load_state_dict(state)
    early = [(a.kind, a.step) for t in steps if t > 200 for a in forgetful.observe(obs(t))]
    assert early and early[0][1] < expected[0][1]  # the test above can fail


def _flat_plateau(every):
    """A Plateau on a flat loss of 1.3 with a deterministic +-0.03 scatter, flagged; returns it and the next step."""
    det = Plateau(AlertConfig(plateau_window=100))
    step = 0
    while det.plateau is None:
        loss = 1.3 + 0.03 * (-1) ** (step // every)
        det.observe(Observation(step, loss, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
        step += every
    return det, step


def test_the_trend_leaves_out_one_sample_far_under_it_but_not_the_plateaus_own_scatter():
    """The refit rule (docs/alerts.md#eureka_plateau): at every=1 the median of 20 samples hides one sample 5
    noise deviations down, which must not join the trend's window (the first samples of a drop); at every=10 (a
    median of 2 samples) a pair 0.6 deviations down is the plateau's own scatter and joins it (a line of half a
    deviation at any cadence would take the outlier and leave the scatter out)."""
    det, step = _flat_plateau(1)
    noise = det.plateau["noise"]
    expected = det.plateau["a"] + det.plateau["b"] * step
    det.observe(Observation(step, expected - 5 * noise, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
    assert det.plateau is not None and step not in [p[0] for p in det.losses]
    det, step = _flat_plateau(10)
    noise = det.plateau["noise"]
    for t in (step, step + 10):
        low = det.plateau["a"] + det.plateau["b"] * t - 0.6 * noise
        det.observe(Observation(t, low, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
    assert det.plateau is not None and step + 10 in [p[0] for p in det.losses]


# the moment's line of the tests below, whose samples are worked out for it: 0.575 x the plateau's level (the
# default's line is tested in test_the_moment_is_marked_where_the_loss_is_deep_under_the_plateaus_level)
AT_0575 = AlertConfig(eureka_depth=0.425)


def _moments(losses, every=10, cfg=None):
    """The Eureka-moments and the plateau's records on a loss curve sampled every ``every`` steps; Q/K
    gradients at 0.3x of V's, rising to 0.6x from step 500 (the share rises with the moment: the loss decides)."""
    det, out = Detectors(cfg or AT_0575), []
    for step in range(0, len(losses), every):
        ratio = np.array([0.3 if step < 500 else 0.6])
        out += det.observe(Observation(step, float(losses[step]), {"L00": {**STILL, "grad_ratio_qk_v": ratio}}))
    return [a for a in out if a.kind == "eureka_moment"], [a for a in out if a.kind == "eureka_plateau"]


def test_the_moment_is_marked_where_the_loss_is_deep_under_the_plateaus_level():
    """Held-out accuracy (docs/alerts.md#eureka_plateau) passes halfway when the loss is about 0.6
    of the plateau's level, so the moment needs the loss ``eureka_depth`` (38.5%) under the level the plateau was
    flagged at, not only 25% under its trend. A drop from the plateau's 1.4 that stops 3 points short of the line
    is no moment; the same run going on to 0.4 is marked where the loss crosses (1 - 0.385) x 1.4 = 0.861, at
    every cadence."""
    depth = AlertConfig().plateau.eureka_depth
    assert depth == 0.385  # the default line (docs/alerts.md#defaults)
    steps = np.arange(1200)
    shallow = np.where(steps < 500, 1.4, np.maximum((1 - depth + 0.03) * 1.4, 1.4 - 0.005 * (steps - 500)))
    moments, plateau = _moments(shallow, cfg=AlertConfig())
    assert moments == [] and [a.status for a in plateau] == ["firing"]
    deep = np.where(steps < 500, 1.4, np.maximum(0.4, 1.4 - 0.005 * (steps - 500)))[:850]  # no plateau at 0.4
    cross = 500 + depth * 1.4 / 0.005  # 607.8: the raw loss; the 20-step median lags ~10 steps
    for every in (1, 2, 5, 10, 20):
        moments, plateau = _moments(deep, every, AlertConfig())
        assert len(moments) == 1 and [a.status for a in plateau] == ["firing", "resolved"], every
        assert cross <= moments[0].since <= cross + 10 + every, (every, moments[0].since)
        assert moments[0].values["plateau_level"] == pytest.approx(1.4)
        assert "under its level 1.4 when flagged" in moments[0].message
    # with no depth line (eureka_depth=0) the moment is where the loss is 25% under the trend: 580, 80 steps
    # after the drop starts and 30 before the depth line's 618
    (early,), _ = _moments(deep, 10, AlertConfig(eureka_depth=0.0))
    assert early.since < cross - 20


def test_one_noisy_sample_back_over_the_line_does_not_delay_the_moment_but_two_do():
    """Sampled every 20 steps, the median of the last 20 steps is one batch: on held-out Eureka seed 22 the loss
    crosses the depth line at 520 and one noisy batch at 540 is back over it (the accuracy jumps at 500). One
    sample just over the line (nearer to it than to the plateau's trend) between two under it does not reset the
    count; two in a row do, and so does one back near the trend."""
    plateau = [1.4] * 25  # steps 0-480, sampled every 20; the line is 0.575 x 1.4 = 0.805, halfway to it 1.10
    moments, _ = _moments(np.repeat(plateau + [0.78, 0.83, 0.76, 0.70, 0.6, 0.5], 20), every=20)
    assert [m.since for m in moments] == [500]  # not 540: the sample at 540 is one noisy batch
    # two samples over the line in a row: the count starts again at 560
    moments, _ = _moments(np.repeat(plateau + [0.78, 0.83, 0.84, 0.76, 0.70, 0.6], 20), every=20)
    assert [m.since for m in moments] == [560]
    # one sample back near the trend (1.2: over halfway from the line to 1.4), or on it: the count starts again
    for back in (1.2, 1.4):
        moments, _ = _moments(np.repeat(plateau + [0.78, back, 0.76, 0.70, 0.6], 20), every=20)
        assert [m.since for m in moments] == [540], back


def test_samples_alternating_around_the_line_never_reach_far_back():
    """Under, over, under, over, ... while neither the Q/K share rises nor entropy falls: each pair across a gap
    is the sample before it and the one after, so when the share finally rises (at 680, after 660 and 680
    under the line) the moment is marked at the last pair across a gap, 620 and 660, not at the first sample
    under the line, 500, 9 intervals before the alert."""
    det, out = Detectors(AT_0575), []
    losses = [1.4] * 25 + [0.78, 0.83] * 4 + [0.78, 0.76]  # steps 0-480, then 500-660, then 680
    for i, loss in enumerate(losses):
        step = 20 * i
        ratio = np.array([0.25 if step < 680 else 0.5])  # the share rises only at 680 (0.25: exact means)
        out += det.observe(Observation(step, loss, {"L00": {**STILL, "grad_ratio_qk_v": ratio}}))
    (moment,) = [a for a in out if a.kind == "eureka_moment"]
    assert moment.step == 680 and moment.since == 620


def test_a_sample_over_the_moments_line_between_two_under_it_survives_a_resume():
    det = Detectors(AT_0575)
    for step, loss in zip(range(0, 560, 20), [1.4] * 25 + [0.78, 0.83]):
        assert not [a for a in det.observe(Observation(step, loss, {"L00": {**STILL, "grad_ratio_qk_v": np.array(
            [0.3 if step < 500 else 0.6])}})) if a.kind == "eureka_moment"]
    state = json.loads(json.dumps(det.state_dict()))
    assert state["below_gap"] == 1 and len(state["below"]) == 1
    resumed = Detectors(AT_0575)
    resumed.load_state_dict(state)
    out = resumed.observe(Observation(540, 0.76, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.6])}}))
    assert [a.since for a in out if a.kind == "eureka_moment"] == [500]


def test_a_plateau_that_sinks_slowly_to_the_depth_line_is_no_moment():
    """A loss that keeps sinking slowly and smoothly past the depth line (1.4 falling 0.3% per 10 steps crosses
    0.575 x its level near step 2000) is no moment: the plateau's trend follows it (the refit), and the loss must
    leave that trend too, so a line under the level alone would call this a moment. With batch noise on such a
    sink the trend can come loose and a moment can follow at the depth line (docs/alerts.md#eureka_plateau)."""
    losses = 1.4 * 0.9997 ** np.arange(3000)
    moments, plateau = _moments(losses)
    assert plateau and plateau[0].status == "firing" and losses[-1] < 0.575 * plateau[0].values["loss"]
    assert moments == []


def test_a_plateau_saved_without_its_level_takes_it_at_the_resume():
    """A plateau saved without its level takes the trend's value at the first step after the resume as its
    level: 0.9 (36% under it) is no moment, 0.6 is."""
    det = Detectors(AT_0575)
    for step in range(0, 400, 10):
        det.observe(Observation(step, 1.4, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
    state = json.loads(json.dumps(det.state_dict()))
    del state["plateau"]["level"]
    resumed = Detectors(AT_0575)
    resumed.load_state_dict(state)
    out = []
    for step in range(400, 600, 10):
        loss = 1.4 if step < 450 else 0.9 if step < 500 else 0.6
        out += resumed.observe(Observation(step, loss, {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}))
        if step == 490:
            assert out == [] and resumed.state_dict()["plateau"]["level"] == pytest.approx(1.4)
    (moment,) = [a for a in out if a.kind == "eureka_moment"]
    assert moment.since == 500  # the median of 490 and 500 is 0.75, under 0.575 x 1.4 = 0.805


def test_a_plateau_that_still_sinks_six_percent_per_100_steps_is_flagged():
    """Eureka seed 44's plateau sinks ~6% per 100 steps up to its moment: sampled every 2 steps its window's
    halves are 5.8-6.3% apart at steps 360-420, so a `plateau_rel` of 5% flags it at one cadence and not at
    another. With the entry tests judging the attention, the halves may differ by 12.5% (docs/alerts.md#defaults);
    a loss falling 15% per 100 steps is still learning, not on a plateau."""
    sinking = run(1.4 * (1 - 0.0006 * np.arange(400)), every=10, cfg=AlertConfig())
    (flag,) = [a for a in sinking if a.kind == "eureka_plateau"]
    assert flag.step == 200 and "still sinks" in flag.message
    assert run(1.4 * (1 - 0.0006 * np.arange(400)), every=10, cfg=AlertConfig(plateau_rel=0.05)) == []
    assert run(1.4 * 0.9984 ** np.arange(400), every=10, cfg=AlertConfig()) == []  # 15% per 100 steps


def test_the_plateau_begins_where_the_loss_came_down_into_its_band():
    """A window flat to 12.5% can still hold the end of the fall before the plateau: ``since`` is the first
    sample inside the plateau's band (its level x 1.125), and the message's sinking rate is measured from there.
    The window's first step would be too early (80 on Eureka seed 1, where the loss is still at 1.75), and a
    rate fitted over the fall's tail too would read 14% per 100 steps for a plateau sinking 3%."""
    steps = np.arange(400)
    losses = np.where(steps < 150, 2.3 - 0.006 * steps, 1.4 - 0.0002 * (steps - 150))
    (flag,) = [a for a in run(losses, every=10, cfg=AlertConfig()) if a.kind == "eureka_plateau"]
    level = flag.values["loss"]
    assert flag.step < 340 and 70 < flag.since <= 150  # flagged while the window still holds the fall
    assert losses[flag.since] <= 1.125 * level < losses[flag.since - 10]
    assert flag.values["loss_sink_per_100"] == pytest.approx(0.02 / 1.4, rel=0.2)
    assert f"since step {flag.since}" in flag.message


def test_the_plateau_reads_the_mean_loss_between_samples_where_the_monitor_gives_it():
    """Observation.loss_mean (the mean of the steps since the last loss sample, from the Monitor) is the plateau's
    loss where given; a non-finite mean is no sample, whatever the step's own loss; without it, the step's loss."""
    det = Plateau(AlertConfig().plateau)
    layers = {"L00": {**STILL, "grad_ratio_qk_v": np.array([0.3])}}
    det.observe(Observation(0, 5.0, layers, 2.0))
    assert det.losses[-1][1] == 2.0
    det.observe(Observation(10, 1.5, layers, float("nan")))
    assert len(det.losses) == 1
    det.observe(Observation(20, 1.5, layers))
    assert det.losses[-1][:2] == [20.0, 1.5]
