"""collapse_risk, as it ships, tells a layer on its way to a malignant collapse from a steady one.

A layer whose heads' attention entropy and rank fall towards the malignant lines while sigma_1(Wq^T Wk), its
spectral concentration and the largest logit grow (the run-up the papers describe), against the same layer
holding still at its first sample's values: read by the Detectors as a Monitor feeds them, at several cadences
and rates of growth. The shipped model's risk at the end of the run-up is several times the steady layer's, and
several times its own at the start."""

from __future__ import annotations

import numpy as np
import pytest

from diag.detectors import AlertConfig, Detectors, Observation

STEPS = 120
UNIFORM = 4.85  # nats: uniform attention's entropy over the sampled keys


def layer(f: float, sigma: float) -> dict[str, np.ndarray]:
    """Two heads a fraction ``f`` of the way from spread attention (3.5 nats, effective rank 60 of 128 rows) to
    just outside the malignant lines (0.7 nats, rank 15), sigma_1 at ``sigma``."""
    e, r = 3.5 * (1 - f) + 0.7 * f, 60 * (1 - f) + 15 * f
    return {"qk_sigma1": np.array([sigma, 0.9 * sigma]), "qk_sec": np.array([0.3 + 0.6 * f] * 2),
            "attn_entropy": np.array([e, 1.05 * e]), "attn_rank": np.array([r, 1.1 * r]),
            "attn_max_logit": np.array([3 + 40 * f] * 2), "attn_rows": np.array([128.0]),
            "attn_entropy_uniform": np.array([UNIFORM])}


def risks(trending: bool, every: int, growth: float) -> list[float]:
    """The layer's collapse_risk at each sample, with the update ratios a Monitor adds after each."""
    det = Detectors(AlertConfig())
    out = []
    for s in range(0, STEPS, every):
        f = s / STEPS if trending else 0.0
        det.observe(Observation(s, 3.0, {"L00": layer(f, growth ** (s / 10) if trending else 1.0)}))
        out.append(det.scalars()["collapse_risk"]["L00"])
        ratio = 0.02 if trending else 0.002
        det.observe_updates(Observation(s, None, {"L00": {"update_ratio_q": np.array([ratio]),
                                                          "update_ratio_k": np.array([ratio / 2])}}))
    return out


@pytest.mark.parametrize("every", [1, 5, 10])
@pytest.mark.parametrize("growth", [1.2, 1.6])
def test_the_risk_of_a_layer_running_up_to_a_collapse_rises_above_a_steady_layers(every, growth):
    up, steady = risks(True, every, growth), risks(False, every, growth)
    assert up[-1] > 3 * steady[-1]
    assert up[-1] > 3 * up[2]
