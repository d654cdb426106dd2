"""Attention states whose lines scale with the attention's size; messages that say where, since when, what to do."""

from __future__ import annotations

import numpy as np

from diag.detectors import AlertConfig, Detectors, Observation, attention_state
from diag.detectors.collapse import lines


def test_low_rank_line_scales_with_rows_so_short_attention_can_be_malignant():
    cfg = AlertConfig()
    # 5 tokens (a small ViT): every query on the same key has effective rank ~1; the old line was 0.5
    assert lines(5, cfg)[1] == 1.4
    assert attention_state(0.1, 1.05, 5, cfg) == "malignant"
    assert attention_state(0.1, 4.0, 5, cfg) == "benign"
    assert lines(1, cfg)[1] == 1.0 and lines(128, cfg)[1] == 1 + 0.1 * 127


def test_reference_states_from_an_explicit_attention_matrix():
    """The lines applied to real matrices: entropy and effective rank computed by hand (float64)."""
    def state(a):
        p = a / a.sum(1, keepdims=True)
        entropy = float(np.mean(-(p * np.log(np.where(p > 0, p, 1))).sum(1)))
        s = np.linalg.svd(p, compute_uv=False)
        q = s / s.sum()
        rank = float(np.exp(-(q * np.log(np.where(q > 0, q, 1))).sum()))
        return attention_state(entropy, rank, len(a), AlertConfig(), np.log(len(a)))
    n = 5
    one_key = np.full((n, n), 1e-4)
    one_key[:, 0] = 1.0  # every query on key 0: sparse and rank ~1
    assert state(one_key) == "malignant"
    assert state(np.eye(n) + 1e-4) == "benign"  # each query on its own key: sparse, full rank
    assert state(np.ones((n, n))) == "uniform"


def test_malignant_message_says_where_since_what_to_do_and_not_the_location_twice():
    det = Detectors(AlertConfig(collapse_persist=2))
    out = []
    for step in (0, 10, 20):
        m = {"attn_entropy": np.array([0.1]), "attn_rank": np.array([2.0]), "attn_rows": np.array([64.0])}
        out += det.observe(Observation(step, None, {"L02": m}))
    (a,) = out
    assert (a.step, a.since, a.where, a.anchor) == (10, 0, "L02/H00", "docs/alerts.md#malignant_collapse")
    assert "since step 0" in a.message and "What to do:" in a.message and "L02" not in a.message
