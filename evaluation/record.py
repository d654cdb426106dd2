"""What the detectors saw, recorded for offline replay: the recorder and its reader.

:class:`Recorder` wraps a Monitor's detectors and appends every :class:`~diag.detectors.Observation` they are
given to ``observations.jsonl`` (:mod:`evaluation.runs` records every run this way, at ``every=1``);
:mod:`evaluation.detectors` replays the detectors over these files for any threshold choice and any coarser
sampling interval (keep the observations whose step is a multiple of ``k``: exactly what a Monitor at
``every=k`` would have passed them, since each sample measures the step it samples and the update ratio of the
step right after it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from diag.detectors import Observation


class Recorder:
    """Wraps the Monitor's detectors: every observation is appended to a JSONL file, then judged."""

    def __init__(self, inner, path: Path) -> None:
        self.inner, self.path = inner, path
        self.file = path.open("w")

    def observe(self, obs: Observation) -> list:
        self._write(obs)
        return self.inner.observe(obs)

    def _write(self, obs: Observation) -> None:
        layers = {label: {k: [None if not math.isfinite(x) else x for x in np.asarray(v, float).tolist()]
                          for k, v in m.items()} for label, m in obs.layers.items()}
        row = {"step": obs.step, "loss": obs.loss, "layers": layers}
        if obs.loss_mean is not None:  # the mean loss since the last loss sample (a run recorded at every > 1)
            row["loss_mean"] = obs.loss_mean
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def observe_updates(self, obs: Observation) -> list:
        """The update ratios of a step after a sample (the Monitor's shared, collective-free path): recorded too."""
        self._write(obs)
        return getattr(self.inner, "observe_updates", self.inner.observe)(obs)

    def close(self) -> None:
        """Close the file (``Monitor.close`` calls it, after writing the pending update sample)."""
        self.file.close()

    def __getattr__(self, name: str):  # the rest of the detectors' interface (cfg, wants_attention, ...)
        if name.startswith("__") or name == "inner":  # copy/pickle look these up before __init__ has run
            raise AttributeError(name)
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def load_observations(path: Path) -> list[Observation]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        layers = {label: {k: np.array([math.nan if x is None else x for x in v], float) for k, v in m.items()}
                  for label, m in r["layers"].items()}
        out.append(Observation(r["step"], r["loss"], layers, r.get("loss_mean")))
    return out
