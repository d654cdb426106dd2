"""One checkpoint of a series, one layer at a time: its spectra and the update from the checkpoint before it.

For each attention layer in turn: the layer's Q/K/V/O of the checkpoint before are read, copied into the
update's snapshot (float32, stacked by shape) and dropped; the layer of this checkpoint is read, its
spectra and the update computed, and everything dropped before the next layer. Peak memory is about two
layers' attention weights (one of them in float32) plus a constant, whatever the model's depth: never a
whole checkpoint, never the previous checkpoint's matrices across layers.

A unit is a pure function of its two checkpoints and their layers: computed in any process, at any time, it
gives the same bits (each layer's sigma_1 estimates start cold, from the estimator's fixed start), so a
series spread over processes (``--jobs``) or resumed from stored units equals one computed in one go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from diag.errors import DiagError
from diag.layouts.statedict import StateDictLayer
from diag.layouts.vocab import QKVLayout, split_projections, split_qkv
from diag.math.metrics import layer_spectra
from diag.math.updates import UpdateTracker
from diag.offline.checkpoint import Checkpoint, open_checkpoint
from diag.offline.plan import Planned
from diag.outputs.records import LayerArrays, host_arrays

__all__ = ["ProbeFn", "UnitResult", "compute_unit"]

# ``--probe``: attention arrays per layer label of a checkpoint (see hooks/checkpoint/probe.py).
ProbeFn = Callable[[Checkpoint, list[StateDictLayer]], LayerArrays]
READ_ERRORS = (RuntimeError, OSError, ValueError)  # a tensor that cannot be read or split


@dataclass
class UnitResult:
    """A checkpoint's arrays (``{label: {metric: float64 array}}``), or why it failed."""

    spectra: LayerArrays = field(default_factory=dict)
    updates: LayerArrays | None = None  # the update from the checkpoint before to this one
    probe: LayerArrays | None = None
    probe_error: str | None = None
    error: str | None = None  # this checkpoint failed: nothing else is set
    previous_failed: bool = False  # the checkpoint before could not be read: computed again against another

    def to_json(self) -> dict[str, Any]:
        arrays = {name: _lists(getattr(self, name)) for name in ("spectra", "updates", "probe")}
        return {**arrays, "probe_error": self.probe_error, "error": self.error}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UnitResult:
        arrays = {name: _arrays(data[name]) for name in ("spectra", "updates", "probe")}
        return cls(arrays["spectra"] or {}, arrays["updates"], arrays["probe"], data["probe_error"], data["error"])


def _lists(arrays: LayerArrays | None) -> dict | None:
    """float64 arrays as lists of Python floats: JSON writes each as its shortest round-trip repr (exact)."""
    if arrays is None:
        return None
    return {label: {m: [float(x) for x in v] for m, v in metrics.items()} for label, metrics in arrays.items()}


def _arrays(data: dict | None) -> LayerArrays | None:
    if data is None:
        return None
    return {label: {m: np.asarray(v, dtype=np.float64) for m, v in metrics.items()} for label, metrics in data.items()}


class _PreviousFailed(Exception):
    """The checkpoint before cannot be read: the unit is computed again against the one before it."""


def _query_key(weights: dict[str, Tensor], layout: QKVLayout, mats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Q (H, D, E) and K, as the live Monitor pairs them: K row h is query head h's key head where the layout
    has an explicit query-to-KV-head map; else K (G, D, E), query head h with key head h // (H/G)."""
    if layout.kv_map is not None:
        q, k, _ = split_qkv(weights, layout, paired=True)
        return q, k
    return mats["q"], mats["k"]


def _weights(ckpt: Checkpoint, layer: StateDictLayer) -> dict[str, Tensor]:
    keys = layer.keys()
    read = ckpt.tensors.read(keys.values())
    return {rel: read[key] for rel, key in keys.items()}


def _layer(ckpt: Checkpoint, before: Checkpoint | None, layer: StateDictLayer, sec_top: int
           ) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """One layer's spectra (this checkpoint) and update (from ``before``); only one layer held at a time."""
    tracker, snapshot = UpdateTracker(), None
    if before is not None:
        try:
            old = split_projections(_weights(before, layer), layer.layout)
            snapshot = tracker.snapshot([old])  # float32 copies; the weights read are dropped here
        except (DiagError, *READ_ERRORS) as err:
            raise _PreviousFailed from err
        del old
    weights = _weights(ckpt, layer)
    mats = split_projections(weights, layer.layout)
    spectra = layer_spectra([_query_key(weights, layer.layout, mats)], sec_top)[0]
    update = None if snapshot is None else tracker.measure(snapshot, [mats])[0]
    return spectra, update


def _layers(ckpt: Checkpoint, before: Checkpoint | None, layers: tuple[StateDictLayer, ...], sec_top: int
            ) -> tuple[LayerArrays, LayerArrays | None]:
    spectra: LayerArrays = {}
    updates: LayerArrays | None = None if before is None else {}
    with torch.no_grad():
        for layer in layers:
            values, update = _layer(ckpt, before, layer, sec_top)
            spectra.update(host_arrays([(layer.label, values)]))
            if updates is not None and update is not None:
                updates.update(host_arrays([(layer.label, update)]))
    return spectra, updates


def _probe(probe: ProbeFn, ckpt: Checkpoint, layers: tuple[StateDictLayer, ...]) -> tuple[LayerArrays | None,
                                                                                        str | None]:
    """Attention arrays from the probe; a probe failure leaves the weights' metrics."""
    try:
        return probe(ckpt, list(layers)), None
    except DiagError as err:
        message = str(err).removeprefix(f"{ckpt.path}: ")
        return None, f"{ckpt.path}: probe: {message}"


def compute_unit(entry: Planned, previous: Planned | None, sec_top: int, probe: ProbeFn | None = None
                 ) -> UnitResult:
    """The arrays of ``entry`` (its layers planned), with the update from ``previous`` (None: the first)."""
    path = entry.path
    assert entry.layers is not None
    try:
        ckpt = open_checkpoint(path)
        before = None if previous is None else _open_previous(previous)
        spectra, updates = _layers(ckpt, before, entry.layers, sec_top)
    except _PreviousFailed:
        return UnitResult(previous_failed=True)
    except DiagError as err:
        return UnitResult(error=str(err) if str(path) in str(err) else f"{path}: {err}")
    except READ_ERRORS as err:
        return UnitResult(error=f"{path}: failed while reading its attention weights ({err}); the file is corrupt "
                          "or its shapes do not fit the layout")
    result = UnitResult(spectra, updates)
    if probe is not None:
        result.probe, result.probe_error = _probe(probe, ckpt, entry.layers)
    return result


def _open_previous(previous: Planned) -> Checkpoint:
    try:
        return open_checkpoint(previous.path)
    except (DiagError, *READ_ERRORS) as err:
        raise _PreviousFailed from err

