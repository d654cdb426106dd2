"""Tiny fake runs of the evaluation (tests/evaluation): a run folder as evaluation.runs records one
(``observations.jsonl``, then ``run.json``), written from hand-made observations."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from evaluation.spec import RunSpec


def write_run(root: Path, spec: RunSpec, observations: list, recorded: dict | None = None) -> Path:
    """A run folder under ``root`` holding ``observations`` (Observation objects) and a run.json with the
    observations' losses and ``recorded`` (the recording's commit and times)."""
    out = root / spec.name
    out.mkdir(parents=True)
    with (out / "observations.jsonl").open("w") as f:
        for o in observations:
            layers = {label: {k: np.asarray(v, float).tolist() for k, v in m.items()} for label, m in o.layers.items()}
            f.write(json.dumps({"step": o.step, "loss": o.loss, "layers": layers}) + "\n")
    info = {"config": asdict(spec), "lrs": [spec.lr] * spec.steps, "losses": [o.loss for o in observations]}
    if recorded is not None:
        info["recorded"] = recorded
    (out / "run.json").write_text(json.dumps(info))
    return out
