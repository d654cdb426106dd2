"""The mutation check: each of four broken detectors makes a small subset of the test suite fail.

Each mutant (``tests/support/mutants.py``: a constant risk model, a ``malignant_collapse`` that never fires, a
plateau that never fires, a damage record at every sample of a malignant layer) is applied to a pytest session of
its own, run in a subprocess over :data:`SUBSET`; the session must fail on a test (exit status 1, not an error of
the session), and the same subset must pass with no mutant. A mutant that the subset does not kill is a broken
detector the tests would let ship.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.mutants import ENV, MUTANTS

ROOT = Path(__file__).resolve().parents[1]

# behavioural tests, a few seconds in all, that between them kill every mutant
SUBSET = (
    # a layer whose heads collapse gets warnings for them and then for the layer (no_malignant)
    "tests/detectors/test_states.py::test_heads_and_then_their_layer_entering_the_malignant_state_are_warnings",
    # a stuck loss with small Q/K gradients is a plateau, then a moment (no_plateau)
    "tests/detectors/test_alerts.py::test_plateau_then_eureka_moment",
    # a collapse while the loss keeps falling is no damage (damage_always)
    "tests/detectors/test_damage.py::test_a_collapse_while_the_loss_keeps_falling_is_no_damage",
    # the shipped risk model ranks a layer running up to a collapse above a steady one (constant_risk)
    "tests/detectors/test_risk_trend.py::test_the_risk_of_a_layer_running_up_to_a_collapse_rises_above_a_steady_layers"
    "[1.2-10]",
)


def _start(mutant: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if mutant is not None:
        env[ENV] = mutant
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "tests.support.mutants",
               *SUBSET]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def sessions() -> dict[str | None, tuple[int, str, str]]:
    """(exit status, stdout, stderr) of the subset's session with no mutant and with each, run side by side."""
    running = {mutant: _start(mutant) for mutant in (None, *MUTANTS)}
    out = {}
    for mutant, process in running.items():
        stdout, stderr = process.communicate(timeout=600)
        out[mutant] = (process.returncode, stdout, stderr)
    return out


def test_the_subset_passes_without_a_mutant(sessions):
    code, stdout, stderr = sessions[None]
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "mutant applied" not in stderr


@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_mutant_fails_the_subset(sessions, mutant):
    code, stdout, stderr = sessions[mutant]
    assert f"mutant applied: {mutant}" in stderr, stderr[-3000:]
    assert code == 1, f"mutant {mutant} survived the subset (exit {code}):\n" + stdout[-3000:] + stderr[-3000:]
