"""collapse_risk: dimensionless features, a missing signal is missing (never stale), a calibrated model read
from its shipped file, the closer look it asks for (and no alert), and its state across a resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diag.detectors import AlertConfig, Detectors, Observation
from diag.detectors.config import RiskConfig, StatesConfig
from diag.detectors.risk import (
    FEATURES,
    MODEL_FILE,
    TAU,
    CollapseRisk,
    HeadTrend,
    RiskModel,
    layer_features,
    layer_logit,
)
from diag.detectors.states import AttentionStates

F = {name: i for i, name in enumerate(FEATURES)}


def sample(sigma, sec, entropy, rank, logit, rows=128.0, keys=4.0, update=None):
    m = {"qk_sigma1": np.array(sigma, float), "qk_sec": np.array(sec, float),
         "attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
         "attn_max_logit": np.array(logit, float), "attn_rows": np.array([rows]),
         "attn_entropy_uniform": np.array([keys])}
    if update is not None:
        m["update_ratio_q"], m["update_ratio_k"] = np.array([update]), np.array([0.5 * update])
    return m


def features(samples, window=20, fresh=20):
    trend = HeadTrend(window)
    x = None
    for step, m in samples:
        trend.add(step, m)
        x = layer_features(trend, step, m, fresh)
    return x


def test_features_are_dimensionless():
    """Scaling every sigma_1 by c (another width, another init) and every logit and ln(keys) by the same factor
    (longer sequences) leaves the features as they are."""
    base = [(0, sample([0.1, 0.2], [0.3, 0.4], [3.0, 3.5], [40, 60], [2.0, 1.0], update=0.05)),
            (10, sample([0.4, 0.3], [0.6, 0.45], [2.0, 3.4], [20, 58], [8.0, 1.5])),
            (20, sample([1.6, 0.4], [0.8, 0.5], [1.0, 3.3], [8, 55], [20.0, 2.0]))]
    x = features(base)
    c = 7.0
    scaled = [(s, {**m, "qk_sigma1": c * m["qk_sigma1"], "attn_max_logit": 2 * m["attn_max_logit"],
                   "attn_entropy": 2 * m["attn_entropy"], "attn_entropy_uniform": 2 * m["attn_entropy_uniform"]})
              for s, m in base]
    np.testing.assert_allclose(features(scaled), x, rtol=1e-12)
    # by hand: head 0 grew 16x over 20 steps; entropy fell from 0.75 to 0.25 of uniform; SEC rose 0.5
    assert x[0, F["growth"]] == pytest.approx(math.log(16.0))
    assert x[0, F["entropy_frac"]] == pytest.approx(0.25) and x[0, F["entropy_slope"]] == pytest.approx(-0.5)
    assert x[0, F["sec_rise"]] == pytest.approx(0.5) and x[0, F["logit_frac"]] == pytest.approx(5.0)
    assert x[0, F["rank_frac"]] == pytest.approx(7 / 127)


def test_growth_is_per_window_at_any_sampling_interval():
    """sigma_1 doubling every 10 steps: ln 4 per 20-step window, whether sampled every 2 or every 10 steps."""
    def run(every):
        return features([(s, sample([2 ** (s / 10)], [0.5], [2.0], [20], [3.0])) for s in range(0, 41, every)])
    assert run(2)[0, F["growth"]] == pytest.approx(math.log(4.0))
    assert run(10)[0, F["growth"]] == pytest.approx(math.log(4.0))


def test_an_update_ratio_older_than_update_fresh_is_missing_not_stale():
    """The update ratio of step 0 (sampled every 100 steps) does not stand in for the steps after it."""
    seq = [(0, sample([0.1], [0.3], [3.0], [40], [2.0], update=0.8))] + \
          [(s, sample([0.1 * (1 + s / 10)], [0.3], [3.0], [40], [2.0])) for s in range(10, 41, 10)]
    fresh = features(seq[:2])
    assert fresh[0, F["update_missing"]] == 0.0 and fresh[0, F["log_update"]] == pytest.approx(math.log(0.8 / TAU))
    stale = features(seq)
    assert stale[0, F["update_missing"]] == 1.0 and stale[0, F["log_update"]] == 0.0


def test_no_features_without_spectra_and_attention_at_the_sample():
    m = sample([0.1], [0.3], [3.0], [40], [2.0])
    spectra_only = {k: v for k, v in m.items() if k.startswith("qk_")}
    assert features([(0, m), (10, spectra_only)]) is None
    attention_only = {k: v for k, v in m.items() if k.startswith("attn_")}
    assert features([(0, m), (10, attention_only)]) is None


def toy_model(weight: float = 4.0) -> RiskModel:
    """A model whose head logit is ``weight`` times the standardised drop of the entropy fraction."""
    w = np.zeros(len(FEATURES))
    w[F["entropy_frac"]] = -weight
    return RiskModel(np.full(len(FEATURES), 0.0), np.ones(len(FEATURES)), w, 1.0, 1.0, 0.0, 50)


def test_layer_probability_needs_its_share_of_heads():
    """Two risky heads of four make a layer's probability (layer_needs: 2); one does not."""
    model = toy_model()
    one = np.zeros((4, len(FEATURES)))
    one[0, F["entropy_frac"]] = -1.0
    two = one.copy()
    two[1, F["entropy_frac"]] = -1.0
    assert model.layer_probability(two, 2) > 0.99 > 0.75 > model.layer_probability(one, 2)


def test_a_head_already_collapsed_counts_as_collapsed_and_the_layer_waits_for_the_next():
    """A layer of 4 that needs 2: with head 0 established, its (extrapolated, safe-looking) logit does not
    decide; the layer's probability is that of the likeliest other head, the k-th of the rest. With 2 held
    the layer has collapsed: 1."""
    model = toy_model()
    x = np.zeros((4, len(FEATURES)))
    x[0, F["entropy_frac"]] = 2.0  # the collapsed head: features outside the fit make a low logit
    x[2, F["entropy_frac"]] = -1.0  # the next head on its way
    none = np.zeros(4, bool)
    first = none.copy()
    first[0] = True
    assert model.layer_probability(x, 2) < 0.75  # its 2nd largest logit: a quiet head
    assert math.isclose(model.layer_probability(x, 2, first), model.layer_probability(x[2:3], 1), rel_tol=1e-12)
    assert model.layer_probability(x, 2, first) > 0.99
    assert layer_logit(np.array([3.0, 1.0, 2.0]), 2) == 2.0
    assert layer_logit(np.array([3.0, 1.0, 2.0]), 2, np.array([True, False, False])) == 2.0
    assert layer_logit(np.array([3.0, 1.0, 2.0]), 2, np.array([False, False, True])) == 3.0
    both = first.copy()
    both[2] = True
    assert layer_logit(x[:, 0], 2, both) is None and model.layer_probability(x, 2, both) == 1.0


def test_the_live_risk_reads_which_heads_the_states_hold():
    """The detector passes the heads the attention states hold established: a head of L00 in a malignant state
    (its dwell met) makes the layer's risk that of its other head alone."""
    cfg = StatesConfig(collapse_persist=1)
    states = AttentionStates(cfg)
    risk = CollapseRisk(RiskConfig(), states, toy_model())
    m = sample([0.1, 0.1], [0.3, 0.3], [0.9 * 4.0] * 2, [60, 60], [2.0, 2.0])
    states.observe(Observation(0, None, {"L00": m}))
    risk.observe(Observation(0, None, {"L00": m}))
    m = sample([0.1, 0.1], [0.3, 0.3], [0.5 * 4.0] * 2, [60, 60], [2.0, 2.0])
    m["attn_entropy"] = np.array([0.1, 0.5 * 4.0])  # head 0 sparse ...
    m["attn_rank"] = np.array([1.0, 30.0])  # ... and low-rank: malignant at once (collapse_persist=1)
    obs = Observation(10, None, {"L00": m})
    states.observe(obs)
    risk.observe(obs)
    assert states.holds("malignant", "L00/H00") and not states.holds("malignant", "L00/H01")
    x = layer_features(risk.trends["L00"], 10, m, 20)
    assert risk.fresh["L00"] == risk.model.layer_probability(x[1:], 1)


def test_the_risk_is_logged_and_asks_for_a_closer_look_but_raises_no_alert():
    """A layer whose heads focus over three samples: its risk rises past watch_risk, is logged at every sample and
    makes the Monitor look closer (at_risk); no alert comes of it, and the look ends when the risk is back under
    watch_risk."""
    risk = CollapseRisk(RiskConfig(), AttentionStates(StatesConfig()), toy_model())
    logged, reasons, alerts = [], [], []
    for step, e in ((0, 0.9), (10, 0.5), (20, 0.1), (30, 0.9)):
        m = sample([0.1, 0.1], [0.3, 0.3], [e * 4.0] * 2, [60, 60], [2.0, 2.0])
        alerts += risk.observe(Observation(step, None, {"L00": m}))
        logged.append(risk.scalars()["collapse_risk"]["L00"])
        reasons.append(risk.at_risk())
    assert alerts == []
    assert logged[0] < RiskConfig().watch_risk < logged[1] < logged[2] and logged[3] < RiskConfig().watch_risk
    assert reasons[0] is None and reasons[3] is None
    assert reasons[2] == f"collapse risk {logged[2]:.2f} in L00"


def test_the_shipped_model_reads_and_the_detectors_log_the_risk():
    model = RiskModel.shipped()
    assert model.weights.shape == (len(FEATURES),) and model.horizon == RiskConfig().risk_horizon
    assert RiskModel.from_dict(json.loads(json.dumps(model.to_dict()))).to_dict() == model.to_dict()
    det = Detectors(AlertConfig())
    for step in (0, 10):
        det.observe(Observation(step, None, {"L00": sample([0.1, 0.12], [0.3, 0.3], [3.0, 3.0], [60, 60],
                                                           [2.0, 2.0])}))
    p = det.scalars()["collapse_risk"]["L00"]
    # by hand, from the file: each head's logit on its standardised features, the layer's from the smaller (both
    # heads needed), its sigmoid, then the isotonic map
    shipped = json.loads(MODEL_FILE.read_text())
    trend = HeadTrend(RiskConfig().risk_window)
    for step in (0, 10):
        m = sample([0.1, 0.12], [0.3, 0.3], [3.0, 3.0], [60, 60], [2.0, 2.0])
        trend.add(step, m)
    x = layer_features(trend, 10, m, RiskConfig().update_fresh)
    z = ((x - np.array(shipped["mean"])) / np.array(shipped["scale"])) @ np.array(shipped["weights"]) + shipped["bias"]
    raw = 1.0 / (1.0 + math.exp(-(shipped["layer_scale"] * z.min() + shipped["layer_bias"])))
    assert p == pytest.approx(float(np.interp(raw, *shipped["calibration"])), rel=1e-12)
    assert 0.0 < p < RiskConfig().watch_risk  # two heads far from every line, sigma_1 grown 1.2x: no closer look


def test_risk_resumes_from_its_state():
    seq = [(s, sample([0.1 * 1.5 ** (s / 10)] * 2, [0.3 + s / 100] * 2, [3.0 - s / 20] * 2, [60 - s] * 2,
                      [2.0 + s] * 2, update=0.3 if s == 0 else None)) for s in range(0, 50, 10)]
    whole = Detectors()
    expected = []
    for s, m in seq:
        whole.observe(Observation(s, None, {"L00": m}))
        expected.append(whole.scalars().get("collapse_risk", {}).get("L00"))
    first = Detectors()
    got = []
    for s, m in seq[:2]:
        first.observe(Observation(s, None, {"L00": m}))
        got.append(first.scalars().get("collapse_risk", {}).get("L00"))
    second = Detectors()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for s, m in seq[2:]:
        second.observe(Observation(s, None, {"L00": m}))
        got.append(second.scalars().get("collapse_risk", {}).get("L00"))
    assert got == expected


def test_recalibration_recovers_a_known_distortion_and_maps_the_layer_probability():
    """Outcomes drawn from sigmoid(2 logit p - 0.5): the isotonic map found on them is monotone and within 0.05
    of that function where forecasts are dense, and the model's layer probability goes through it."""
    from evaluation.risk import recalibrate

    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, 40000)

    def truth(q):
        return 1 / (1 + np.exp(-(2.0 * np.log(q / (1 - q)) - 0.5)))

    y = (rng.uniform(size=p.size) < truth(p)).astype(int)
    model = toy_model()
    x = np.zeros((4, len(FEATURES)))
    x[:2, F["entropy_frac"]] = -0.3
    before = model.layer_probability(x, 2)
    recalibrate(model, p, y)
    xs, ys = (np.array(v) for v in model.calibration)
    assert np.all(np.diff(ys) >= 0) and xs[0] == 0.0 and xs[-1] == 1.0
    inner = (xs > 0.1) & (xs < 0.9)
    assert np.max(np.abs(ys[inner] - truth(xs[inner]))) < 0.05
    assert math.isclose(model.layer_probability(x, 2), float(np.interp(before, xs, ys)), rel_tol=1e-12)
    again = RiskModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.layer_probability(x, 2) == model.layer_probability(x, 2)


def test_the_calibration_interval_resamples_runs_not_forecasts():
    """Fifty runs whose forecasts share their run's fate: the interval with the run as the unit is as wide as
    fifty trials allow (and the Jeffreys interval of 5,000 'independent' forecasts far narrower); with one forecast
    per run both agree."""
    from evaluation.forecasts import Forecast
    from evaluation.report import interval90, run_interval90

    def runs(per_run: int) -> list[Forecast]:
        return [Forecast(f"r{i}", 1e-3, 0, "", "lm", t, "layer0", 0.3, int(i % 10 < 3))
                for i in range(50) for t in range(per_run)]

    many = runs(100)
    mask = np.ones(len(many), bool)
    lo, hi = run_interval90(many, mask)
    jlo, jhi = interval90(sum(f.y for f in many), len(many))
    assert lo < 0.3 < hi and 0.15 < hi - lo < 0.3  # about 2 x 1.645 x sqrt(0.21 / 50) = 0.21
    assert jhi - jlo < 0.03
    one = runs(1)
    lo1, hi1 = run_interval90(one, np.ones(len(one), bool))
    jlo1, jhi1 = interval90(15, 50)
    assert abs((hi1 - lo1) - (jhi1 - jlo1)) < 0.05


def test_the_configuration_baseline_says_when_it_could_not_be_fitted():
    """With no design or tuning runs under RUNS the baseline is the set's own overall frequency, and its row
    says so instead of "fitted on the tuning runs"."""
    from evaluation.forecasts import Forecast
    from evaluation.report import risk_tables

    fs = [Forecast(f"r{i}", lr, 0, "", "lm", t, "layer0", 0.3, int(lr > 4e-3 and t > 5))
          for i, lr in enumerate((2e-3, 5e-3, 1e-2)) for t in range(10)]
    assert any("not fitted" in line for line in risk_tables(fs, [], "tuning"))
    fitted = risk_tables(fs, fs, "tuning")
    assert any("fitted on the tuning runs" in line for line in fitted)
    assert not any("not fitted" in line for line in fitted)


def test_a_collapsed_layers_risk_is_no_forecast_and_is_not_logged():
    """With its share of heads established (2 of 2), the layer's state is a collapse, not a forecast of one:
    ``collapse_risk`` is not logged for it (the evaluation scores what is logged) and asks for no closer look,
    and the risk is logged again once the layer's state has ended."""
    states = AttentionStates(StatesConfig(collapse_persist=1))
    risk = CollapseRisk(RiskConfig(), states, toy_model())
    steps = {0: 3.0, 10: 1.0, 20: 1.0, 30: 0.1, 40: 0.1, 100: 3.0, 110: 3.0, 170: 3.0}
    logged, judged, reasons = {}, {}, {}
    for step, e in steps.items():
        m = sample([0.1, 0.1], [0.3, 0.3], [e, e], [2.0 if e < 0.5 else 60.0] * 2, [2.0, 2.0], keys=4.0)
        obs = Observation(step, None, {"L00": m})
        states.observe(obs)
        assert risk.observe(obs) == []
        logged[step], judged[step], reasons[step] = risk.fresh.get("L00"), risk.risk["L00"][1], risk.at_risk()
    assert states.layer_in("malignant", "L00") is False  # ended: outside from 100 for 50 steps
    assert logged[30] is None and logged[40] is None and judged[30] == judged[40] == 1.0
    assert reasons[20] is not None and reasons[30] is None and reasons[40] is None
    assert all(logged[s] is not None for s in (0, 10, 20, 170))


def band_script(hover=range(50, 80), steps=150):
    """Two heads that hover at the malignant entropy line from step 50: inside it between samples 10 steps
    apart, just above it (between the lines) at each multiple of 10; before and after beyond the exit line,
    focused enough for the toy model's risk to be high (0.46: the closer look samples every 10 steps)."""
    def att(s):
        if s in hover:
            return (0.6, 5.0) if s % 10 == 0 else (0.1, 2.0)
        return (1.0, 40.0)
    script = []
    for s in range(steps):
        e, r = att(s)
        m = sample([1.0, 1.0], [0.3, 0.3], [e, e], [r, r], [2.0, 2.0], rows=64.0, keys=3.5)
        script.append(Observation(s, 3.0, {"L00": m}))
    return script


def replay_with(script, model):
    from evaluation import detectors as evaluate_detectors

    det = Detectors(AlertConfig())
    risk = next(d for d in det.detectors if isinstance(d, CollapseRisk))
    risk.model = model
    seen, alerts = [], []  # the steps that sampled attention, and the alerts
    for o, out in evaluate_detectors.at_default_cadence(script, det):
        seen += [o.step] if "attn_entropy" in o.layers.get("L00", {}) else []
        alerts += out
    return alerts, seen, risk


def test_a_head_hovering_at_the_line_is_sampled_at_every_step_from_the_sample_that_shows_it_near():
    """Both heads of a layer sit inside the malignant lines between the samples of the closer look (every 10
    steps, the layer at risk) and just above the entropy line at each of them. The ground truth (every step)
    establishes the layer at 61; the live detector, replayed as the Monitor samples
    (evaluation.detectors.at_default_cadence), sees it because the sample at 50 shows the heads near the lines and
    attention follows at every step from there."""
    from diag.detectors.states import episodes_of

    script = band_script()
    truth = [(e.since, e.opened) for e in episodes_of(script, StatesConfig())
             if e.state == "malignant" and e.where == "L00"]
    assert truth == [(51, 61)]
    alerts, seen, risk = replay_with(script, toy_model())
    layer = [(a.step, a.since) for a in alerts if (a.kind, a.where, a.status) == ("malignant_collapse", "L00",
                                                                                  "firing")]
    assert layer == [(61, 51)]
    assert set(range(50, 62)) <= set(seen)  # every step while the heads are near, up to their establishment


def test_a_head_hovering_at_the_line_is_sampled_closely_at_any_risk():
    """The same hovering heads under a model whose risk stays at 0.05, so no look at risk is on and attention is
    sampled every 50 steps: the sample at 50 finds both heads between the lines, attention follows at every step
    from there, and the collapse is established where the ground truth has it (61)."""
    model = toy_model(weight=0.0)
    model.layer_bias = -3.0  # p = sigmoid(-3) = 0.047 at every sample, under watch_risk
    alerts, seen, risk = replay_with(band_script(), model)
    assert max(p for _, p in risk.risk.values()) < RiskConfig().watch_risk
    layer = [(a.step, a.since) for a in alerts if (a.kind, a.where, a.status) == ("malignant_collapse", "L00",
                                                                                  "firing")]
    assert layer == [(61, 51)]
    assert set(range(50, 62)) <= set(seen) and not set(range(41, 50)) & set(seen)


def test_a_head_that_hovers_long_is_sampled_closely_for_twice_the_dwell_then_at_the_cadence():
    """Heads between the lines from 40 to 400 that never enter (a ViT's heads after its Eureka moment can hover
    for thousands of steps): every step for 20 steps from the sample that shows them, then the cadence's."""
    script = []
    for s in range(400):
        e, r = (0.6, 5.0) if s >= 40 else (1.0, 40.0)
        script.append(Observation(s, 3.0, {"L00": sample([1.0, 1.0], [0.3, 0.3], [e, e], [r, r], [2.0, 2.0],
                                                         rows=64.0, keys=3.5)}))
    model = toy_model(weight=0.0)
    model.layer_bias = -3.0
    alerts, seen, risk = replay_with(script, model)
    assert set(range(50, 71)) <= set(seen)  # the sample at 50 shows them near: 20 steps, and the one they ask for
    assert [s for s in seen if s > 70] == [100, 150, 200, 250, 300, 350]
    assert not [a for a in alerts if a.level in ("warning", "critical")]


def test_sinks_and_the_baseline_are_no_forecast():
    """A layer of 4 heads whose 3 heads are attention sinks from the first sample: no candidate is left for the 2
    heads the layer waits for, so there is no risk and no closer look, however focused the sinks are."""
    states = AttentionStates(StatesConfig())
    risk = CollapseRisk(RiskConfig(), states, toy_model())
    alerts = []
    for step in (0, 10, 20, 30):
        m = sample([1.0] * 4, [0.3] * 4, [0.05, 0.05, 0.05, 3.0], [1.0, 1.0, 1.0, 60.0], [9.0] * 4, keys=4.0)
        m["attn_sink"] = np.array([0.98, 0.98, 0.98, 0.05])
        obs = Observation(step, None, {"L00": m})
        states.observe(obs)
        alerts += risk.observe(obs)
    assert states.holds("sink", "L00/H00") and not states.holds("malignant", "L00/H00")
    assert "L00" not in risk.risk and not alerts and risk.at_risk() is None
    assert layer_logit(np.array([3.0, 2.0, 1.0, 0.5]), 2, excluded=np.array([True, True, True, False])) is None
    assert layer_logit(np.array([3.0, 2.0, 1.0, 0.5]), 2, excluded=np.array([True, False, False, False])) == 1.0


@pytest.mark.parametrize("share", [0.9, 0.05])
def test_heads_with_a_sinks_share_are_no_forecast_before_their_sink_is_established_or_when_not_sparse(share):
    """A pretrained sink over a long context: 0.9 of the queries' mass on one shared position and the rest spread,
    so its entropy (1.2 falling to 0.6) stays over the sparse line and it is never an established sink. Three such
    heads of four leave no candidate for the 2 heads the layer waits for: no risk. The same heads with their mass
    on no shared position (0.05) are forecast."""
    states = AttentionStates(StatesConfig())
    risk = CollapseRisk(RiskConfig(), states, toy_model())
    for step in range(0, 40, 10):
        e = 1.2 - 0.02 * step
        m = sample([1.0] * 4, [0.3] * 4, [e, e, e, 3.0], [3.0, 3.0, 3.0, 60.0], [9.0] * 4, keys=4.0)
        m["attn_sink"] = np.array([share, share, share, 0.05])
        obs = Observation(step, None, {"L00": m})
        states.observe(obs)
        risk.observe(obs)
    assert not states.holds("sink", "L00/H00")
    assert states.on_sink("L00/H00") == (share >= 0.5)
    assert ("L00" in risk.risk) == (share < 0.5)


def focusing(step: int, c: float, keys: float, rows: float, heads: int) -> dict:
    """A layer whose heads head for the malignant state over 40 steps: sigma_1 doubling every 10 steps, SEC
    rising, entropy falling from 0.8 to 0.2 of uniform's, rank from 0.47 to 0.08 of the rows, the largest logit
    from 0.5 to 5.5 times ln(keys)."""
    f = step / 40
    return sample([c * 2 ** (step / 10)] * heads, [0.3 + 0.5 * f] * heads, [keys * (0.8 - 0.6 * f)] * heads,
                  [1 + (rows - 1) * (0.47 - 0.39 * f)] * heads, [keys * (0.5 + 5 * f)] * heads, rows=rows, keys=keys,
                  update=0.05 if step == 0 else None)


def steady(step: int, c: float, keys: float, rows: float, heads: int) -> dict:
    """The same layer learning quietly: sigma_1 grows 1% per 10 steps, attention stays at 0.8 of uniform's."""
    return sample([c * 1.01 ** (step / 10)] * heads, [0.3] * heads, [0.8 * keys] * heads,
                  [1 + 0.47 * (rows - 1)] * heads, [0.5 * keys] * heads, rows=rows, keys=keys,
                  update=0.002 if step == 0 else None)


@settings(max_examples=40, deadline=None)
@given(c=st.floats(1e-3, 10.0), keys=st.floats(3.0, 8.0), rows=st.sampled_from([64.0, 128.0, 512.0]),
       heads=st.sampled_from([2, 4, 8]))
def test_the_shipped_model_tells_a_layer_heading_for_collapse_from_a_steady_one(c, keys, rows, heads):
    """At any scale of sigma_1, any number of keys and rows, any head count: the shipped model's risk for a layer
    whose heads focus rises past watch_risk within 40 steps (the closer look starts), a steady layer's stays under
    a quarter of it. A model that ignored its features (a constant) would give both the same."""
    risks = {}
    for name, layer in (("focusing", focusing), ("steady", steady)):
        det = Detectors()
        for step in range(0, 41, 10):
            det.observe(Observation(step, None, {"L00": layer(step, c, keys, rows, heads)}))
        risks[name] = det.scalars()["collapse_risk"]["L00"]
    watch = RiskConfig().watch_risk
    assert risks["focusing"] > watch > 4 * risks["steady"], risks
