"""The container: every detector's state across a resume, format 1 states, the protocol checked and its
optional hooks answered by default."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from diag.detectors import AlertConfig, Detector, Detectors, Observation
from diag.errors import ConfigError


def script():
    """Every detector busy: a head going malignant, sigma_1 growing, large first updates, a plateau, a spike."""
    rng = np.random.default_rng(1)
    for step in range(0, 400, 5):
        collapse = 100 <= step < 250
        e, r = (0.2, 3.0) if collapse else (max(3.5 - 0.03 * max(step - 60, 0), 0.4), max(30 - step / 5, 3.0))
        loss = 5.0 if step == 200 else (2.0 + 0.01 * rng.standard_normal() if step < 300 else 0.8)
        # both heads of the layer head for collapse (the second a little behind): the layer's risk rises
        layers = {"L00": {"attn_entropy": np.array([e, 1.1 * e]), "attn_rank": np.array([r, 1.1 * r]),
                          "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([4.1]),
                          "qk_sigma1": 0.1 * np.array([1.08**step, 1.07**step]), "qk_sec": np.array([0.9, 0.85]),
                          "attn_max_logit": np.array([min(0.2 * 1.08**step, 60.0), min(0.2 * 1.07**step, 60.0)]),
                          "grad_ratio_qk_v": np.array([0.1 if step < 290 else 0.6])}}
        yield Observation(step, loss, layers)
        yield Observation(step, None, {"L00": {"update_ratio_q": np.array([0.5 if step == 0 else 0.02])}})


def test_resume_at_any_point_continues_identically():
    # plateau_qk_motion, plateau_max_growth and plateau_entropy_gap off: the script's collapsing head grows and
    # focuses all along, which the plateau test would refuse (the plateau's entry is tested in test_plateau.py)
    cfg = AlertConfig(plateau_window=100, plateau_qk_motion=float("inf"), plateau_max_growth=float("inf"),
                      plateau_entropy_gap=float("inf"))
    observations = list(script())
    whole = Detectors(cfg)
    expected = [(a.step, a.kind, a.status, a.where, a.since) for o in observations for a in whole.observe(o)]
    assert {k for _, k, s, _, _ in expected if s == "firing"} >= {
        "malignant_collapse", "large_early_updates", "eureka_plateau", "eureka_moment", "loss_spike"}
    for cut in (7, 41, 95):
        first = Detectors(cfg)
        got = [(a.step, a.kind, a.status, a.where, a.since) for o in observations[:cut] for a in first.observe(o)]
        resumed = Detectors(cfg)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += [(a.step, a.kind, a.status, a.where, a.since) for o in observations[cut:] for a in resumed.observe(o)]
        assert got == expected, cut


def test_format_1_state_loads_what_carries_over(caplog):
    old = {"sigma_prev": {"L00": [10, [1.0]]}, "update_ratio": {"L00": 0.02}, "malignant_run": {}, "head_state": {},
           "warned_layers": ["L00"], "losses": [2.0, 2.1], "qk_ratios": [0.1, 0.1], "plateau_level": None,
           "first_loss": 2.3, "ema": 2.0, "emvar": 0.01, "n_loss": 12, "nonfinite": ["loss"]}
    det = Detectors()
    with caplog.at_level(logging.WARNING, logger="diag"):
        det.load_state_dict(old)
    assert "format 1" in caplog.text
    state = det.state_dict()
    assert state["version"] == 3 and state["ema"] == 2.0 and "first_loss" not in state
    assert "sigma_prev" not in state and state["losses"] == []  # the collapse risk starts afresh
    out = det.observe(Observation(20, 1.0, {}))  # the loss was non-finite before the resume: now it ends
    assert [(a.kind, a.status) for a in out] == [("nonfinite_loss", "resolved")]
    with pytest.raises(ConfigError, match="version 4"):
        Detectors().load_state_dict({"version": 4})


class Counter(Detector):
    def __init__(self, key="seen"):
        self.key, self.n = key, 0

    def observe(self, obs):
        self.n += 1
        return []

    def state_dict(self):
        return {self.key: self.n}

    def load_state_dict(self, state):
        self.n = state.get(self.key, 0)


def test_extra_detectors_join_the_fan_out_and_must_not_share_state_keys():
    det = Detectors(extra=[Counter()])
    det.observe(Observation(0, 1.0, {}))
    assert det.state_dict()["seen"] == 1
    with pytest.raises(ConfigError, match="'losses'"):
        Detectors(extra=[Counter("losses")])
    with pytest.raises(ConfigError, match="protocol"):
        Detectors(extra=[object()])


def test_a_detector_declares_only_what_it_judges_and_the_hooks_it_leaves_out_answer_nothing():
    counter = Counter()
    assert counter.scalars() == {} and counter.near() is None and counter.at_risk() is None
    assert counter.observe_updates(Observation(0, None, {})) == [] and counter.n == 1  # judged as any observation
    det = Detectors(extra=[counter])
    assert det.near() is None and det.at_risk() is None
    det.observe_updates(Observation(1, None, {"L00": {"update_ratio_q": np.array([0.01])}}))
    assert counter.n == 2

    class Forgetful(Detector):  # no state_dict / load_state_dict
        def observe(self, obs):
            return []

    with pytest.raises(TypeError, match="state_dict"):
        Forgetful()
