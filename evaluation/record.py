"""What the detectors saw, recorded for offline replay: the recorder and its reader.

:class:`Recorder` wraps a Monitor's detectors and appends every :class:`~diag.detectors.Observation` they are
given to ``observations.jsonl`` (:mod:`evaluation.runs` records every run this way, at ``every=1``; whoever opens
a recorder closes it after ``Monitor.close``, which judges the last update sample);
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

from diag.detectors import Alert, Detector, DetectorWrapper, Observation


class Recorder(DetectorWrapper):
    """Wraps the Monitor's detectors: every observation is appended to a JSONL file, then judged."""

    def __init__(self, inner: Detector, path: Path) -> None:
        super().__init__(inner)
        self.path = path
        self.file = path.open("w")

    def observe(self, obs: Observation) -> list[Alert]:
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

    def observe_updates(self, obs: Observation) -> list[Alert]:
        """The update ratios of a step after a sample: recorded too."""
        self._write(obs)
        return self.inner.observe_updates(obs)

    def close(self) -> None:
        """Close the file: after ``Monitor.close``."""
        self.file.close()


def load_observations(path: Path) -> list[Observation]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        layers = {label: {k: np.array([math.nan if x is None else x for x in v], float) for k, v in m.items()}
                  for label, m in r["layers"].items()}
        out.append(Observation(r["step"], r["loss"], layers, r.get("loss_mean")))
    return out
