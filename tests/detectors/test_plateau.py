"""Plateau and Eureka-moment in steps: no moment from one noisy batch, the trend of a sinking plateau."""

from __future__ import annotations

import numpy as np

from diag.detectors import AlertConfig, Detectors, Observation


def run(losses, every=1, ratio=0.2, cfg=None, ratio_after=None):
    det, out = Detectors(cfg or AlertConfig(plateau_window=100, eureka_drop=0.1, eureka_noise=4.0)), []
    for step in range(0, len(losses), every):
        r = ratio if ratio_after is None or step < ratio_after[0] else ratio_after[1]
        out += det.observe(Observation(step, float(losses[step]), {"L00": {"grad_ratio_qk_v": np.array([r])}}))
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
