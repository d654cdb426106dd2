"""What a sampled step measures, and the update ratios measured at the step after one.

A sample takes the attention the capture saw in the step's forward, reads the weight side
(:mod:`hooks.monitor.weightside`), gathers the heads of every tensor-parallel rank (under FSDP2 alone, takes
each layer's attention from the rank that owns it: :func:`hooks.parallel.owners.share_attention`), takes the mean
loss since the last loss sample (:mod:`hooks.monitor.lossmean`) and brings all of it to the host in
one transfer: a :class:`~diag.outputs.sinks.Record` for the sinks and the per-layer arrays the
detectors read. A layer whose layout was refused gives nothing; a faulty part is reported once and
the rest of the sample goes on. Which non-finite values are worth a warning, and what an fp16
gradient overflow is, :mod:`diag.detectors.nonfinite` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from diag.catalog.metrics import family_metrics
from diag.catalog.tags import layer_tag
from diag.detectors import Observation
from diag.detectors.nonfinite import overflowed, unreported
from diag.errors import ConfigError
from diag.math.attention import AttentionStats
from diag.outputs.records import LayerArrays, attention_metrics, build_record, host_arrays
from diag.outputs.sinks import Record
from hooks.capture.capture import ENTROPY_ROWS
from hooks.capture.compiled import EagerCapture
from hooks.layout.book import LayoutBook
from hooks.layout.discover import AttentionLayer
from hooks.monitor.lossmean import LossMean
from hooks.monitor.weightside import WeightSide
from hooks.parallel.headgather import HeadGather
from hooks.parallel.owners import owned_layers, share_attention

__all__ = ["Sample", "Sampler"]

SPECTRAL_METRICS = family_metrics("spectra")
GRAD_METRICS = family_metrics("grads")
Warn = Callable[[str, str], None]  # (kind, message): reported once per kind


@dataclass
class Sample:
    """One sampled step, measured. ``arrays[label][metric]``: what the detectors read, (H,) per head or (1,) per
    layer; ``maps[label]``: the captured attention probabilities (H, R, C) of the layer's first sequence, or None;
    ``overflow``: the gradients overflowed under fp16 loss scaling (their metrics are not in ``arrays``)."""

    record: Record
    arrays: LayerArrays
    loss: float | None
    loss_mean: float | None
    maps: dict[str, Tensor | None]
    overflow: bool

    @property
    def observation(self) -> Observation:
        return Observation(self.record.step, self.loss, self.arrays, self.loss_mean)


class Sampler:
    """Measures the Monitor's layers at a sampled step; sets up the parts that measure them (the Monitor
    coordinates the capture, the weight side and the kept losses between samples)."""

    def __init__(self, model: nn.Module, layers: Sequence[AttentionLayer], signals: frozenset[str], *, sec_top: int,
                 attn_seqs: int, attn_rank_rows: int, per_head: bool, warn: Warn,
                 attn_entropy_rows: int | None = ENTROPY_ROWS,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        for name, value in (("sec_top", sec_top), ("attn_seqs", attn_seqs), ("attn_rank_rows", attn_rank_rows)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Monitor({name}={value!r}): expected an integer >= 1")
        if attn_entropy_rows is not None and (not isinstance(attn_entropy_rows, int) or attn_entropy_rows < 2):
            raise ConfigError(f"Monitor(attn_entropy_rows={attn_entropy_rows!r}): expected an integer >= 2, or None "
                              "for every query row")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "is_enabled", None)):
            raise ConfigError(f"Monitor(grad_scaler=...): expected a torch.amp.GradScaler, got "
                              f"{type(grad_scaler).__name__}")
        self.layers, self.per_head, self._warn_once, self.grad_scaler = list(layers), per_head, warn, grad_scaler
        # tensor parallelism: each rank measures its own heads, one gather of their scalars (docs/distributed.md)
        self._heads = HeadGather(self.layers) if any(layer.block is not None for layer in self.layers) else None
        self.weights = WeightSide(self.layers, signals, sec_top, warn, heads=self._heads)
        # the layers' layouts, decided in one place: only a captured forward confirms a layout proposed from names;
        # under tensor parallelism each rank's kernel computes its own block of heads, which the book checks
        local = [layer.on_this_rank() for layer in self.layers]
        self.layouts = LayoutBook(local, watching="attention" in signals)
        self.capture = EagerCapture(local, attn_seqs, attn_rank_rows, model=model, layouts=self.layouts,
                                    entropy_rows=attn_entropy_rows)
        # FSDP2 alone on several ranks: each rank captures the layers it owns, one all-reduce shares them
        self._owned = owned_layers(self.layers) if "attention" in signals else None
        self.capture.only = self._owned
        self.loss_mean = LossMean()  # every step's loss, for the mean of those between two loss samples

    @property
    def refused(self) -> Mapping[int, str]:
        """Layers whose layout the computation refused: none of their metrics is measured."""
        return self.layouts.refused

    def measure(self, step: int, loss: Tensor | float | None, due: frozenset[str]) -> Sample:
        """The families ``due`` at ``step`` (``loss``: the step's, read when the loss is due)."""
        loss = loss if "loss" in due else None
        results, per_layer, spectra_failed = self._read(step, due)
        with torch.no_grad():
            record, arrays, loss_value, mean_value = self._host(step, per_layer, loss,
                                                                self._mean() if loss is not None else None)
        # under tensor parallelism rank 0's kernel saw its own block of heads: the first, numbered as in one process
        maps = {layer.label: _maps(results.get(layer.index)) for layer in self.layers
                if layer.block is None or layer.block.index == 0}
        if spectra_failed:  # NaN from a failed solver, already reported: not a sign of NaN weights
            arrays = _without(arrays, lambda metric: metric in SPECTRAL_METRICS)
        overflow = self.grad_scaler is not None and self.grad_scaler.is_enabled() and overflowed(arrays)
        skip = (SPECTRAL_METRICS if spectra_failed else ()) + (GRAD_METRICS if overflow else ())
        warning = unreported(step, record.scalars, skip)
        if warning is not None:
            self._warn_once("nonfinite", warning)
        if overflow:  # the scaler skips this update: its gradients are not the model's
            arrays = _without(arrays, lambda metric: metric.startswith("grad_"))
        return Sample(record, arrays, loss_value, mean_value, maps, overflow)

    def updates(self) -> tuple[Record, LayerArrays]:
        """The update ratios of the last update sample (one host read): their record and the detectors' arrays,
        ``arrays[label][metric]`` of shape (1,)."""
        with torch.no_grad():
            step, measured = self.weights.measure()  # layer index -> {metric: 0-d tensor}
        kept = [(layer, measured[layer.index]) for layer in self.layers
                if layer.index in measured and layer.index not in self.refused]
        names = [(layer.label, metric) for layer, m in kept for metric in m]
        values = torch.stack([v.double() for _, m in kept for v in m.values()]).tolist() if names else []  # one sync
        record, arrays = Record(step), {}
        for (label, metric), value in zip(names, values):
            record.scalars[layer_tag(metric, label)] = value
            arrays.setdefault(label, {})[metric] = np.array([value])
        return record, arrays

    def _read(self, step: int, due: frozenset[str]) -> tuple[dict[int, AttentionStats], list[dict[str, Tensor]], bool]:
        """On the device: the captured attention by layer index, each layer's metrics (``{metric: (H,) or (1,)}``,
        empty for a refused layer) in layer order, and whether the spectra failed."""
        if "attention" in due and not self.capture.armed:
            self._warn_once("unarmed", f"diag: step {step} is sampled but step {step - 1} was not "
                            "reported, so its attention was not captured; call monitor.step for every "
                            "training step with consecutive step numbers")
        results, problems = self.capture.take() if "attention" in due else ({}, {})
        with torch.no_grad():
            by_index, spectra_failed = self.weights.sample(step, due)  # layer index -> {metric: (H,) or (1,)}
            if self._owned is not None and "attention" in due:  # every layer's values as its owner measured them
                results, problems = self._share_attention(results, problems)
            for layer in self.layers:
                self._attention(layer, by_index[layer.index], results, problems)
            if self._heads is not None and due & {"grads", "spectra", "attention"}:  # every rank, every such step
                spectra_failed = self._gather_heads(by_index, results, due, spectra_failed)
        per_layer = [by_index[layer.index] for layer in self.layers]
        for layer, values in zip(self.layers, per_layer):
            if layer.index in self.refused:
                values.clear()  # its weights are still snapshotted: the update is dropped when measured
        return results, per_layer, spectra_failed

    def _share_attention(self, results: dict[int, AttentionStats],
                         problems: dict[int, str]) -> tuple[dict[int, AttentionStats], dict[int, str]]:
        """FSDP2 alone: every layer's attention from its owner rank (:func:`share_attention`); a layer its owner did
        not measure is reported here too (this rank's own reason where it captured the layer)."""
        shared, absent = share_attention(self.layers, results, self._owned)
        problems = {i: why for i, why in problems.items() if i in absent}
        for i, owner in absent.items():
            problems.setdefault(i, f"its owner, rank {owner} (layer position % world), did not measure it "
                                   "(that rank's warning says why)")
        return shared, problems

    def _mean(self) -> Tensor | float | None:
        try:  # losses of several shapes or devices: the detectors read the step's loss
            return self.loss_mean.take()
        except Exception as err:  # noqa: BLE001 - the sample goes on
            self._warn_once("loss mean", f"diag: the mean loss since the last sample failed ({err!r}); "
                            "the plateau detector reads the sampled step's loss")
            return None

    def _attention(self, layer: AttentionLayer, values: dict, results: dict, problems: dict) -> None:
        if layer.index in self.refused:  # every metric of the layer is dropped: say so, once
            self._warn_once(f"attn-{layer.index}", f"diag: {layer.label} {layer.name} not measured at all (no "
                            "spectra, gradient norms, update ratios or attention statistics for this layer): "
                            f"the head split is suspect: {self.refused[layer.index]}")
        elif layer.index in problems:
            self._warn_once(f"attn-{layer.index}", f"diag: attention of {layer.name} not measured: "
                            f"{problems[layer.index]}")
        note = self.capture.notes.get(layer.index)
        if note is not None:
            self._warn_once(f"attn-note-{layer.index}", f"diag: attention of {layer.name}: {note}")
        stats = results.get(layer.index)
        if stats is not None and layer.block is None:  # under tensor parallelism: gathered with every rank's heads
            values.update(attention_metrics(stats))

    def _gather_heads(self, by_index: dict, results: dict, due: frozenset[str], spectra_failed: bool) -> bool:
        """Tensor parallelism: every rank's heads into whole layers (in ``by_index``); a layer refused on any rank is
        refused on all. Returns whether any rank's spectra failed."""
        refused = {i for i in self.refused if i in self._heads.blocks}
        whole, refused_any, failed = self._heads.gather(by_index, results, refused, due, spectra_failed)
        for layer in self._heads.layers:
            by_index[layer.index] = whole[layer.index]
            if layer.index in refused_any and layer.index not in self.refused:
                self.layouts.refuse(layer, f"{layer.name}: another tensor-parallel rank found its heads disagree "
                                    "with the layout (its warning says how)")
        return failed

    def _host(self, step: int, per_layer: list[dict], loss: Tensor | float | None,
              mean: Tensor | float | None) -> tuple[Record, LayerArrays, float | None, float | None]:
        """The record and the detectors' arrays, the loss and the mean loss since the last loss sample as floats:
        loss tensors travel to the host in the same transfer as every metric (one host sync per sampled step on
        an accelerator). The mean goes to the detectors, not to the record: the ``loss`` tag is the step's."""
        rows = [(layer.label, values) for layer, values in zip(self.layers, per_layer)]
        scalars = {name: value.detach().reshape(1) for name, value in (("loss", loss), ("loss_mean", mean))
                   if isinstance(value, Tensor)}  # (1,) each: a loss has one element, as float(loss) requires
        if scalars:
            rows.append(("", scalars))
        arrays = host_arrays(rows)
        host = arrays.pop("", {})
        loss_value, mean_value = (float(host[name][0]) if name in host else None if value is None else float(value)
                                  for name, value in (("loss", loss), ("loss_mean", mean)))
        record = build_record(step, arrays, self.per_head)
        if loss_value is not None:
            record.scalars["loss"] = loss_value
        return record, arrays, loss_value, mean_value


def _maps(stats: AttentionStats | None) -> Tensor | None:
    return None if stats is None else stats.maps


def _without(arrays: LayerArrays, drop: Callable[[str], bool]) -> LayerArrays:
    """``arrays`` less the metrics ``drop`` names."""
    return {label: {m: v for m, v in values.items() if not drop(m)} for label, values in arrays.items()}
