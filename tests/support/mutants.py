"""Mutants of the detectors, applied for a whole pytest session: the mutation check of ``tests/test_mutants.py``.

    ATTNSCOPE_MUTANT=constant_risk python -m pytest -p tests.support.mutants tests/...

A mutant is a broken detector as a user would get it, applied at a seam that the detectors' internals do not
move: the records every detector returns (``observe`` and ``observe_updates`` of every ``Detector`` class of
``diag.detectors``), and the risk model's shipped file (``diag.detectors.risk.MODEL_FILE``). One per name:

* ``constant_risk``: the shipped risk model with its weights zeroed and its bias set so that every layer's
  probability is ``CONSTANT_RISK`` (a model that knows nothing);
* ``no_malignant``: no ``malignant_collapse`` record, ever;
* ``no_plateau``: no ``eureka_plateau`` record, ever;
* ``damage_always``: a critical ``collapse_damage`` record at every sample of a layer in a malignant episode
  (as the attention states hold it), beside what the damage detector says.

Without ``ATTNSCOPE_MUTANT`` this plugin does nothing. A mutant it cannot apply (a seam gone) stops the session
with a usage error that names the seam, so that the check says the mutant is stale instead of passing.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import pkgutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ENV = "ATTNSCOPE_MUTANT"
CONSTANT_RISK = 0.07
MUTANTS = ("constant_risk", "no_malignant", "no_plateau", "damage_always")


def _detector_classes() -> list[type]:
    """Every class of ``diag.detectors``'s modules that implements the Detector protocol's ``observe``."""
    import diag.detectors as package
    from diag.detectors.base import Detector

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    out, todo = [], [Detector]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("diag.detectors") and ("observe" in vars(cls) or "observe_updates" in vars(cls)):
            out.append(cls)
    return out


def _wrap_records(cls: type, change: Callable, names: tuple[str, ...] = ("observe", "observe_updates")) -> None:
    """``cls.observe`` and ``cls.observe_updates`` (those of ``names`` it defines) return ``change(self, obs,
    records)``."""
    for name in names:
        if name not in vars(cls):
            continue
        original = vars(cls)[name]

        @functools.wraps(original)
        def wrapped(self, obs, _original=original):
            return change(self, obs, _original(self, obs))
        setattr(cls, name, wrapped)


def _without(kind: str) -> None:
    for cls in _detector_classes():
        _wrap_records(cls, lambda self, obs, records: [r for r in records if r.kind != kind])


def _constant_risk() -> None:
    from diag.detectors import risk

    d = json.loads(risk.MODEL_FILE.read_text())
    d["weights"] = [0.0] * len(d["weights"])
    lo, hi = -60.0, 60.0  # the bias that makes every layer's probability CONSTANT_RISK (monotone in it)
    for _ in range(200):
        d["bias"] = (lo + hi) / 2
        p = risk.RiskModel.from_dict(d).layer_probability(np.zeros((1, len(d["weights"]))), 1)
        lo, hi = (d["bias"], hi) if p < CONSTANT_RISK else (lo, d["bias"])
    if not math.isclose(p, CONSTANT_RISK, abs_tol=1e-6):
        raise pytest.UsageError(f"mutant constant_risk: no bias gives p={CONSTANT_RISK} (got {p})")
    path = Path(tempfile.mkdtemp(prefix="attnscope-mutant-")) / "risk_model.json"
    path.write_text(json.dumps(d))
    risk.MODEL_FILE = path


def _damage_always() -> None:
    from diag.detectors import damage
    from diag.detectors.base import Alert

    classes = [c for c in _detector_classes() if c.__module__ == damage.__name__]
    if not classes:
        raise pytest.UsageError("mutant damage_always: no Detector class in diag.detectors.damage")

    def change(self, obs, records):
        states = getattr(self, "states", None)
        if states is None or not hasattr(states, "layer_in"):
            raise RuntimeError(f"mutant damage_always: {type(self).__name__} holds no attention states (.states)")
        added = [Alert(obs.step, "collapse_damage", "critical", label, "mutant: damage at every sample", {},
                       "firing", states.layer_since("malignant", label))
                 for label in obs.layers if states.layer_in("malignant", label)
                 and not any(r.kind == "collapse_damage" and r.level == "critical" and r.where == label
                             for r in records)]
        return list(records) + added

    for cls in classes:
        _wrap_records(cls, change, ("observe",))


APPLY = {"constant_risk": _constant_risk, "no_malignant": lambda: _without("malignant_collapse"),
         "no_plateau": lambda: _without("eureka_plateau"), "damage_always": _damage_always}


def pytest_configure(config: pytest.Config) -> None:
    name = os.environ.get(ENV)
    if not name:
        return
    if name not in APPLY:
        raise pytest.UsageError(f"{ENV}={name!r}: no such mutant; one of {', '.join(MUTANTS)}")
    APPLY[name]()
    sys.stderr.write(f"mutant applied: {name}\n")
