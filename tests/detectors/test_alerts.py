"""Detectors driven by scripted observations: exact alerts at exact steps; the channels."""

from __future__ import annotations

import json
import logging
import re
import warnings

import numpy as np
import pytest

from diag.detectors import Alert, AlertConfig, Detectors, Observation, TrainingHalted
from diag.errors import ConfigError
from diag.outputs.alert_sink import AlertSink
from diag.outputs.sinks import FanOut, MemorySink

# the spectra and attention of a softmax plateau: sigma_1(Wq^T Wk) still under updates of 1%, attention at 0.9 of
# uniform's entropy (a missing signal is missing: a plateau is flagged only on what it claims)
STILL = {"qk_sigma1": np.array([1.0]), "attn_entropy": np.array([2.7]), "attn_entropy_uniform": np.array([3.0]),
         "update_ratio_q": np.array([0.01]), "update_ratio_k": np.array([0.01])}
QK_RATIO = {"grad_ratio_qk_v": np.array([0.1])}


def attn(entropy, rank, rows=64.0, uniform=3.5):
    return {"attn_entropy": np.array(entropy, float), "attn_rank": np.array(rank, float),
            "attn_rows": np.array([rows]), "attn_entropy_uniform": np.array([uniform])}


def kinds(alerts):
    return [(a.step, a.kind, a.where) for a in alerts]


def firing(alerts):
    """The alerts that start an episode (not the "resolved" records that end one)."""
    return [a for a in alerts if a.status == "firing"]


def test_malignant_collapse_fires_once_after_persisting():
    # One normal sample at 40 does not end the episode (the exit dwell), so step 60 raises no second alert.
    # One head of a two-head layer is a warning (head scope); the layer is not collapsed.
    det = Detectors(AlertConfig(collapse_persist=2))
    script = [attn([2.0, 2.0], [40, 40]), attn([0.1, 2.0], [2, 40]), attn([0.1, 2.0], [2, 40]),
              attn([0.1, 2.0], [2, 40]), attn([2.0, 2.0], [40, 40]), attn([0.1, 2.0], [2, 40]),
              attn([0.1, 2.0], [2, 40])]
    out = []
    for i, m in enumerate(script):
        out += det.observe(Observation(i * 10, None, {"L00": m}))
    assert kinds(out) == [(20, "malignant_collapse", "L00/H00")]
    assert all(a.level == "warning" for a in out) and out[0].since == 10


def test_benign_and_uniform_are_reported_as_info_on_entry():
    det = Detectors()
    out = []
    for i, m in enumerate([attn([0.1, 3.0], [60, 1.2]), attn([0.1, 3.0], [60, 1.2]), attn([2.0, 2.0], [40, 40])]):
        out += det.observe(Observation(i, None, {"L01": m}))
    assert kinds(out) == [(0, "benign_collapse", "L01/H00"), (0, "uniform_attention", "L01/H01")]
    assert {a.level for a in out} == {"info"}


def test_large_first_updates_are_an_info_note_not_a_warning():
    det = Detectors()
    out = det.observe(Observation(0, None, {"L00": {"update_ratio_q": np.array([0.9]), "update_ratio_k": [0.8]}}))
    out += det.observe(Observation(10, None, {"L00": {"update_ratio_q": np.array([0.5])}}))  # once per run
    assert kinds(out) == [(0, "large_early_updates", "")] and out[0].level == "info"
    assert "warmup" in out[0].message and "does not predict" in out[0].message
    late = Detectors().observe(Observation(500, None, {"L00": {"update_ratio_q": np.array([0.9])}}))
    assert late == []  # after note_horizon steps a large update is not about warmup


def _plateau_run(det, losses, ratio):
    out = []
    for i, loss in enumerate(losses):
        layers = {"L00": {**STILL, "grad_ratio_qk_v": np.array([ratio])}}
        out += det.observe(Observation(i, loss, layers))
    return out


def test_plateau_then_eureka_moment():
    # The moment needs two samples below the plateau's trend (one noisy batch is no moment); it is reported at
    # the second (9) with ``since`` the first (8), and it ends the plateau.
    # eureka_span=1: the moment reads each sample's loss (the median over a span is tested in test_plateau.py)
    det = Detectors(AlertConfig(plateau_window=6, plateau_rel=0.02, plateau_qk_ratio=0.3, eureka_drop=0.3,
                                eureka_depth=0.0, eureka_span=1))
    losses = [2.3, 2.3, 2.3, 2.3, 2.3, 2.3, 2.3, 2.29, 1.2, 0.5]
    out = _plateau_run(det, losses, ratio=0.05)
    assert kinds(firing(out)) == [(5, "eureka_plateau", ""), (9, "eureka_moment", "")]
    assert firing(out)[1].since == 8
    resolved = [a for a in out if a.status == "resolved"]
    assert kinds(resolved) == [(9, "eureka_plateau", "")] and resolved[0].values["duration_steps"] == 8


def test_no_plateau_when_qk_gradients_are_healthy_or_loss_falls():
    det = Detectors(AlertConfig(plateau_window=6))
    assert _plateau_run(det, [2.3] * 12, ratio=0.9) == []
    det = Detectors(AlertConfig(plateau_window=6))
    assert _plateau_run(det, [3.0 * 0.9**i for i in range(12)], ratio=0.05) == []


def test_slowly_sinking_plateau_is_flagged():
    # the Eureka reproduction's plateau: the loss still sinks ~0.3% per sample while the indicator is not read;
    # halves of the 20-sample window then differ by ~3% (<= plateau_rel 0.05); Q/K gradients at 0.35x of V's
    losses = [2.3, 2.0, 1.7] + [1.4 * 0.997**i for i in range(30)] + [1.0, 0.8, 0.5]
    # Windows are in steps (20 samples at every=1 = plateau_window=20); the level is the trend's value, not a
    # half-window mean; the moment needs 2 samples 25% below the trend (34 and 35: 1.0 at 33 is only 22% below),
    # so it is reported at 35 and marked at 34.
    # Pinned to the thresholds this test was written for (plateau_rel 0.05, plateau_qk_ratio 0.4, eureka_drop 0.25,
    # one sample per moment test, no depth line); the tuned defaults are evaluated on recorded runs
    # (docs/alerts.md#evaluation).
    cfg = AlertConfig(plateau_window=20, plateau_rel=0.05, plateau_qk_ratio=0.4, eureka_drop=0.25, eureka_span=1,
                      eureka_depth=0.0)
    assert _plateau_run(Detectors(cfg), losses, ratio=0.45) == []  # a slow healthy run (the demo's warmup twin)
    out = firing(_plateau_run(Detectors(cfg), losses, ratio=0.35))
    assert kinds(out) == [(21, "eureka_plateau", ""), (35, "eureka_moment", "")]
    a, b = np.polyfit(np.arange(2, 22), losses[2:22], 1)[::-1]
    assert out[0].values["loss"] == pytest.approx(a + b * 21) and out[1].since == 34


def _two_layers(ratios, uniformities):
    """Two layers of 2 heads: each layer's Q/K:V gradient ratio and its heads' attention entropy as fractions of
    uniform's (3.0 nats over the same keys)."""
    return {f"L0{i}": {**STILL, "grad_ratio_qk_v": np.array([r]), "attn_entropy": 3.0 * np.array(u)}
            for i, (r, u) in enumerate(zip(ratios, uniformities))}


def test_a_plateau_is_recognised_by_a_stuck_layer_wherever_the_loss_sits():
    """A flat loss is a plateau when a layer is stuck (small Q/K gradients, every head near uniform attention), at
    any level against the first loss: at 35% of it (a model that still chooses between two candidates, about
    ln 2 of ln 10) as at 48%; beside a layer that learned to select, the stuck one is named. A run whose loss is
    as flat but whose layers all hold a head that selects (one head at 0.5 of uniform), or whose Q/K gradients
    are large, is not stuck (plateau_window=20: 20 samples at every=1)."""
    cfg = AlertConfig(plateau_window=20)

    def flagged(losses, ratios, uniformities):
        det, out = Detectors(cfg), []
        for i, loss in enumerate(losses):
            out += det.observe(Observation(i, loss, _two_layers(ratios, uniformities)))
        return [a for a in out if a.kind == "eureka_plateau" and a.status == "firing"]

    low, high = [2.3, 1.5, 0.9] + [0.8] * 30, [2.3, 1.5] + [1.1] * 30
    stuck = ([0.2, 0.3], [[0.95, 0.9], [0.9, 0.85]])
    assert [a.step for a in flagged(low, *stuck)] == [20] and [a.step for a in flagged(high, *stuck)] == [20]
    beside = flagged(low, [1.2, 0.3], [[0.4, 0.5], [0.9, 0.85]])  # L00 learned, L01 is stuck
    assert len(beside) == 1 and "attention in L01 has not learned" in beside[0].message
    assert beside[0].values["grad_ratio_qk_v"] == pytest.approx(0.3)
    assert beside[0].values["attn_uniformity"] == pytest.approx(0.85)  # the stuck layer's least uniform head
    assert flagged(low, [0.2, 0.3], [[0.95, 0.5], [0.9, 0.5]]) == []  # a head of each layer selects
    assert flagged(low, [0.7, 0.8], [[0.95, 0.9], [0.9, 0.85]]) == []  # Q/K gradients as large as V's
    assert flagged([2.3, 1.0, 0.3] + [0.1] * 30, [0.2, 0.3], [[0.5, 0.4], [0.45, 0.5]]) == []  # converged


def test_nonfinite_fires_on_entry_only():
    det = Detectors()
    seq = [1.0, float("nan"), float("nan"), 1.0, float("inf")]
    out = []
    for i, loss in enumerate(seq):
        out += det.observe(Observation(i, loss, {}))
    assert kinds(firing(out)) == [(1, "nonfinite_loss", ""), (4, "nonfinite_loss", "")]
    assert [(a.step, a.since) for a in out if a.status == "resolved"] == [(3, 1)]  # one record ends each episode
    out = det.observe(Observation(5, 1.0, {"L00": {"qk_sigma1": np.array([np.nan])}}))
    assert kinds(firing(out)) == [(5, "nonfinite_weights", "")]
    # an observation that shows neither loss nor weights (the update ratios) changes nothing
    shown = det.observe(Observation(5, None, {"L00": {"update_ratio_q": np.array([0.1])}}))
    assert [a for a in shown if a.kind.startswith("nonfinite")] == []  # (0.1 at step 5 is an early-update note)
    assert det.observe(Observation(6, 1.0, {"L00": {"qk_sigma1": np.array([np.nan])}})) == []


def test_loss_spike():
    det = Detectors(AlertConfig(spike_warmup=5, spike_sigma=6.0))
    rng = np.random.default_rng(0)
    losses = list(2.0 + 0.01 * rng.standard_normal(30)) + [5.0] + [2.0] * 3
    out = []
    for i, loss in enumerate(losses):
        out += [a for a in det.observe(Observation(i, float(loss), {})) if a.kind == "loss_spike"]
    assert kinds(firing(out)) == [(30, "loss_spike", "")]
    assert [(a.step, a.status) for a in out] == [(30, "firing"), (31, "resolved")]


def test_loss_spike_looks_back_in_steps_at_any_every():
    """A loss that starts to climb 0.05 per step at step 200 (after 200 flat noisy steps) is a spike within one
    10-step interval at every 1, 2, 5 and 10 alike: the running mean forgets per step, not per sample (one that
    forgot 10% per sample would, at every=1, follow the climb and never see a spike)."""
    rng = np.random.default_rng(0)
    losses = list(2.0 + 0.01 * rng.standard_normal(200)) + [2.0 + 0.05 * k + 0.01 * rng.standard_normal()
                                                            for k in range(100)]
    for every in (1, 2, 5, 10):
        det = Detectors(AlertConfig())
        out = [a for i, loss in enumerate(losses) if i % every == 0
               for a in det.observe(Observation(i, float(loss), {})) if a.kind == "loss_spike"]
        starts = [a.step for a in firing(out)]
        assert starts and 200 < starts[0] <= 210 and len(starts) == 1, (every, starts)


def test_state_dict_round_trip_continues_identically():
    # plateau_entropy_gap: this head's attention is collapsed (0.03 of uniform), which the plateau test would refuse
    cfg = AlertConfig(plateau_window=6, collapse_persist=3, eureka_span=1, plateau_entropy_gap=float("inf"))
    script = [(2.3, attn([0.1], [2])) for _ in range(10)] + [(1.0, attn([0.1], [2]))] * 2  # a moment needs 2
    whole, first = Detectors(cfg), Detectors(cfg)
    out_whole = [a for i, (loss, m) in enumerate(script)
                 for a in whole.observe(Observation(i, loss, {"L00": {**STILL, **m, **QK_RATIO}}))]
    out_split = [a for i, (loss, m) in enumerate(script[:4])
                 for a in first.observe(Observation(i, loss, {"L00": {**STILL, **m, **QK_RATIO}}))]
    state = json.loads(json.dumps(first.state_dict()))  # must be plain JSON
    resumed = Detectors(cfg)
    resumed.load_state_dict(state)
    out_split += [a for i, (loss, m) in enumerate(script[4:], start=4)
                  for a in resumed.observe(Observation(i, loss, {"L00": {**STILL, **m, **QK_RATIO}}))]
    assert kinds(out_whole) == kinds(out_split)
    assert {k for _, k, _ in kinds(out_whole)} == {"malignant_collapse", "eureka_plateau", "eureka_moment"}


def test_config_checks_itself():
    with pytest.raises(ConfigError, match="sparse_entropy"):
        AlertConfig(sparse_entropy=-1)
    with pytest.raises(ConfigError, match="plateau_window"):
        AlertConfig(plateau_window=0)
    with pytest.raises(ConfigError, match="plateau_entropy_gap=-1.*positive"):
        AlertConfig(plateau_entropy_gap=-1)
    with pytest.raises(ConfigError, match="plateau_qk_motion=-0.5.*positive"):
        AlertConfig(plateau_qk_motion=-0.5)
    for depth in (42.5, 1.0, -0.1):  # 42.5: a percentage, no loss could ever reach the line
        with pytest.raises(ConfigError, match=f"eureka_depth={depth}.*in \\[0, 1\\)"):
            AlertConfig(eureka_depth=depth)
    with pytest.raises(ConfigError, match="eureka_drop=25.*in \\(0, 1\\)"):
        AlertConfig(eureka_drop=25)
    AlertConfig(plateau_entropy_gap=float("inf"), plateau_qk_motion=float("inf"))  # both entry tests off


@pytest.mark.parametrize("field, value, says", [
    ("plateau_window", "200", "plateau_window='200': expected a number, got str"),  # from a config file
    ("collapse_persist", None, "collapse_persist=None: expected a number"),
    ("spike_sigma", True, "spike_sigma=True: expected a number, got bool"),
    ("risk_window", 20.5, "risk_window=20.5: expected a whole number of steps"),
    ("exit_dwell", float("inf"), "exit_dwell=inf: expected a whole number of steps"),
    ("exit_factor", 0.9, "exit_factor=0.9: expected a factor of at least 1"),  # the exit line inside the entry
    ("watch_risk", 1.5, "watch_risk=1.5: expected a probability"),
    ("nonsense", 1, "unknown field(s) ['nonsense']"),
    ("uniform_frac", 80, "uniform_frac=80: expected a fraction"),  # a percentage
    ("uniform_frac", 0, "uniform_frac=0: expected a fraction"),
])
def test_config_names_the_field_for_a_wrong_type_or_range(field, value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        AlertConfig(**{field: value})


def test_config_takes_numpy_numbers_and_whole_floats():
    cfg = AlertConfig(spike_warmup=np.int64(3), plateau_window=200.0, sparse_entropy=np.float32(0.4), exit_factor=1)
    assert cfg.spike_warmup == 3 and cfg.plateau_window == 200


def test_alert_channels(tmp_path, caplog):
    mem = MemorySink()
    seen = []
    sink = AlertSink(FanOut([mem]), tmp_path / "alerts.jsonl", seen.append, stop_on_critical=False)
    det = Detectors(AlertConfig(collapse_persist=1))
    det.observe(Observation(6, None, {"L02": attn([3.0], [40.0])}))  # monitoring begins with a normal head
    alerts = det.observe(Observation(7, None, {"L02": attn([0.1], [1.0])}))
    with caplog.at_level(logging.INFO, logger="diag"):
        sink.emit(alerts)
    assert [(a.kind, a.level, a.where) for a in seen] == [("malignant_collapse", "warning", "L02/H00"),
                                                          ("malignant_collapse", "warning", "L02")]
    assert mem.records[0].scalars == {"alerts/malignant_collapse": 2.0}  # the head's record and the layer's
    assert "L02/H00" in mem.records[0].texts["alerts/malignant_collapse"]
    line = json.loads((tmp_path / "alerts.jsonl").read_text().splitlines()[1])
    assert line["kind"] == "malignant_collapse" and line["step"] == 7 and line["where"] == "L02"
    assert any("malignant" in r.message for r in caplog.records)


def test_stop_on_critical_raises_after_writing(tmp_path):
    mem = MemorySink()
    sink = AlertSink(FanOut([mem]), tmp_path / "alerts.jsonl", None, stop_on_critical=True)
    alerts = [Alert(3, "malignant_collapse", "warning", "L00", "a malignant collapse"),
              Alert(3, "collapse_damage", "critical", "L00", "the loss rose after the collapse and stays up")]
    with pytest.raises(TrainingHalted) as info:
        sink.emit(alerts)
    assert info.value.alert.kind == "collapse_damage"
    assert (tmp_path / "alerts.jsonl").exists() and mem.records


def test_failing_callback_does_not_propagate(tmp_path):
    def boom(alert):
        raise RuntimeError("user bug")

    sink = AlertSink(FanOut([]), None, boom)
    sink.emit(Detectors(AlertConfig(collapse_persist=1)).observe(Observation(0, None, {"L00": attn([0.1], [1.0])})))


def test_monitor_raises_nonfinite_alert_once_per_episode(caplog):
    import torch

    from hooks.monitor.monitor import Monitor
    from tests.support import zoo

    case = zoo.nanogpt()
    seen = []
    monitor = Monitor(case.model, every=1, sinks=[MemorySink()], on_alert=seen.append)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="diag"):
        warnings.simplefilter("always")
        for step in range(4):
            loss = case.loss(case.model, case.make_batch(gen))
            loss.backward()
            monitor.step(step, loss=float("nan"))
            case.model.zero_grad()
    monitor.close()
    assert [(a.step, a.kind) for a in seen if a.kind.startswith("nonfinite")] == [(0, "nonfinite_loss")]
    # said once on the console: by the nonfinite_loss alert, not again by a warning of the Monitor's own
    lines = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "non-finite" in line] == [next(line for line in lines if "nonfinite_loss" in
                                                                      line or "non-finite loss" in line)]


def test_skipped_step_numbers_warn_that_attention_was_not_captured():
    import torch

    from hooks.monitor.monitor import Monitor
    from tests.support import zoo

    case = zoo.nanogpt()
    mem = MemorySink()
    monitor = Monitor(case.model, every=10, sinks=[mem])
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(RuntimeWarning, match="not captured"):
        for step in (0, 4, 8, 12, 16, 20):
            case.loss(case.model, case.make_batch(gen)).backward()
            monitor.step(step)
            case.model.zero_grad()
    monitor.close()
    assert any(t.startswith("attn_entropy") for t in mem.records[0].scalars)
    step20 = [r for r in mem.records if r.step == 20 and "qk_sigma1/L00/max" in r.scalars][0]
    assert not any(t.startswith("attn_entropy") for t in step20.scalars)


def test_alerts_jsonl_is_strict_json_when_a_value_is_unknown(tmp_path):
    """A value the detector could not measure (NaN: a signal the cadence did not sample) is written as null."""
    from diag.detectors.base import Alert

    sink = AlertSink(FanOut([MemorySink()]), tmp_path / "alerts.jsonl", None, stop_on_critical=False)
    sink.emit([Alert(5, "eureka_plateau", "warning", "", "m", {"loss": 1.3, "attn_uniformity": float("nan")},
                     "firing", 0)])

    def strict(token):
        raise ValueError(f"non-standard JSON token {token}")

    line = json.loads((tmp_path / "alerts.jsonl").read_text(), parse_constant=strict)
    assert line["values"] == {"loss": 1.3, "attn_uniformity": None}
