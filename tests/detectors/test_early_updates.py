"""``large_early_updates`` over a gap of k optimizer steps: the note states the gap and compares the ratio with
the bound of k steps, (1 + tau)^k - 1, or says that it cannot (a gap not known); the bound itself holds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from diag.detectors import Detectors, Observation
from diag.detectors.risk import TAU

NOTE = 0.25  # EarlyUpdatesConfig.note_ratio: a per-step ratio


def _note(ratio: float, steps: int | None, step: int = 0):
    layers = {"L00": {"update_ratio_q": np.array([ratio]), "update_ratio_k": np.array([ratio / 2])}}
    return Detectors().observe(Observation(step, None, layers, update_steps=steps))


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(1, 60), ratio=st.floats(1e-3, 1e3))
def test_the_note_states_the_gap_and_the_bound_of_that_many_steps(steps, ratio):
    least = (1 + ratio) ** (1 / steps) - 1  # the largest step's ratio is at least this (see the test below)
    assume(abs(least - NOTE) > 1e-9 * NOTE)
    out = _note(ratio, steps)
    assert bool(out) == (least >= NOTE)
    if not out:
        return
    (alert,) = out
    bound = (1 + TAU) ** steps - 1
    said = "over one optimizer step" if steps == 1 else f"over these {steps} optimizer steps"
    assert said in alert.message, alert.message
    assert f"{bound:.3g}" in alert.message and f"{ratio:.3g}" in alert.message, alert.message
    assert alert.values["update_steps"] == steps and alert.values["bound"] == pytest.approx(bound, rel=1e-12)
    if steps > 1:
        assert f"step 0 to step {steps}" in alert.message and f"{least:.3g} or more" in alert.message


def test_a_gap_not_known_is_said_and_compared_with_no_bound():
    (alert,) = _note(0.9, None, step=2)
    assert "cannot be compared" in alert.message and "do not tell" in alert.message, alert.message
    assert "update_steps" not in alert.values and "bound" not in alert.values
    assert _note(0.2, None) == []  # under the note's line even as one step
    (one,) = _note(0.9, 1)  # the Monitor's (one step, the default of an observation)
    assert "over one optimizer step" in one.message and "cannot" not in one.message
    (default,) = Detectors().observe(Observation(0, None, {"L00": {"update_ratio_q": np.array([0.9])}}))
    assert default.values["update_steps"] == 1 and "over one optimizer step" in default.message


@settings(max_examples=50, deadline=None)
@given(steps=st.integers(1, 40), tau=st.floats(1e-4, 0.3), seed=st.integers(0, 2**31 - 1),
       aligned=st.booleans())
def test_k_steps_each_within_tau_move_the_weights_by_at_most_the_bound(steps, tau, seed, aligned):
    """sigma_1(W_k - W_0) <= ((1 + tau)^k - 1) sigma_1(W_0) when every step has sigma_1(dW_j) <= tau sigma_1(W_j):
    the triangle inequality over the k updates, with sigma_1(W_j) <= (1 + tau)^j sigma_1(W_0). Updates along W
    itself (dW_j = tau W_j) reach it."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((6, 5))
    w = w0.copy()
    for _ in range(steps):
        d = w if aligned else rng.standard_normal(w.shape)
        w = w + tau * np.linalg.norm(w, 2) / np.linalg.norm(d, 2) * d
    ratio = np.linalg.norm(w - w0, 2) / np.linalg.norm(w0, 2)
    bound = math.expm1(steps * math.log1p(tau))
    assert ratio <= bound * (1 + 1e-9)
    if aligned:
        assert ratio == pytest.approx(bound, rel=1e-9)
