"""Post-hoc analysis of one checkpoint or a series: the live Monitor's weight-side signals.

For each checkpoint, in step order: the per-head spectra of Wq_h^T Wk_h
(``qk_sigma1``, ``qk_sec``, ``qk_erank``, ``qk_stable_rank``, ``qk_spectrum``) at
the checkpoint's step; between consecutive checkpoints s < s' the update metrics
(``update_ratio_*``, ``update_fro_*`` of W_Q, W_K, W_V and, where the layout finds
it, W_O) of dW = W(s') - W(s), tagged with step s.
That is the live Monitor's convention: ``update_*`` at step t describe the update
that optimizer step t applied, and a checkpoint of step t holds the weights that
step t's forward saw (nanoGPT saves ``iter_num`` before that step's update). With
a checkpoint every step the numbers equal the Monitor's (``every=1``); with gaps,
the update spans every step in between.

Records go through :mod:`diag.outputs.records` (the Monitor's tag scheme) to any sinks,
and each record's arrays to the detectors. A checkpoint that fails is reported
and the series goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from diag.detectors import Alert, AlertConfig, Detectors, Observation
from diag.errors import ConfigError, DiagError, SpecError
from diag.layouts.statedict import Heads, StateDictLayer
from diag.layouts.vocab import QKVLayout, split_projections, split_qkv
from diag.math.metrics import DEFAULT_SEC_TOP, layer_spectra
from diag.math.updates import UpdateTracker
from diag.offline.checkpoint import Checkpoint, find_checkpoints, open_checkpoint, step_of
from diag.offline.layers import ModelLayoutFn, choose_layers
from diag.offline.layoutfile import LayoutEntry, LayoutFile, read_layout_file
from diag.outputs.alert_sink import AlertSink
from diag.outputs.records import LayerArrays, build_record, host_arrays, per_head_default
from diag.outputs.sinks import FanOut, Record, Sink

__all__ = ["Analysis", "analyze_checkpoints", "order_checkpoints"]

Projections = dict[str, Tensor]  # a layer's matrices: "q", "k", "v" per head, "o" (see split_projections)
# ``--probe``: attention arrays per layer label of a checkpoint (see hooks/checkpoint/probe.py).
ProbeFn = Callable[[Checkpoint, list[StateDictLayer]], LayerArrays]


@dataclass
class Analysis:
    """What a series produced: per-step arrays, the records written, alerts and failures."""

    layers: list[StateDictLayer] = field(default_factory=list)
    heads: Heads | None = None
    analysed: list[tuple[str, int]] = field(default_factory=list)  # (path, step) in step order
    spectra: dict[int, LayerArrays] = field(default_factory=dict)  # step -> {label: {metric: array}}
    updates: dict[int, LayerArrays] = field(default_factory=dict)  # step s -> update from s to the next
    records: list[Record] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (path, one-line message)

    @property
    def steps(self) -> list[int]:
        return [step for _, step in self.analysed]

    def summary(self) -> dict:
        """A JSON-ready summary: checkpoints, layers, final metrics, alerts, failures."""
        return {
            "checkpoints": [{"path": p, "step": s} for p, s in self.analysed],
            "failures": [{"path": p, "error": e} for p, e in self.failures],
            "heads": None if self.heads is None else {"source": self.heads.source, "note": self.heads.note},
            "assumptions": [] if self.heads is None else list(self.heads.assumptions),
            "layers": [{"label": la.label, "module": la.name, "adapter": la.layout.adapter,
                        "heads": la.layout.n_heads, "kv_heads": la.layout.kv_heads,
                        "head_dim": la.layout.head_dim, "packing": la.layout.packing,
                        "kv_map": _kv_map(la.layout), "groups": la.layout.groups,
                        "order": la.layout.order} for la in self.layers],
            "metrics": {str(step): {label: {m: [_num(x) for x in v] for m, v in metrics.items() if m != "qk_spectrum"}
                                    for label, metrics in arrays.items()} for step, arrays in self.spectra.items()},
            "updates": {str(step): {label: {m: _num(v[0]) for m, v in metrics.items()}
                                    for label, metrics in arrays.items()} for step, arrays in self.updates.items()},
            "alerts": [asdict(a) for a in self.alerts],
        }


def _kv_map(layout: QKVLayout) -> list[int] | None:
    """The query-to-KV-head pairing the analysis used (None: one KV head per query head)."""
    g, h = layout.kv_heads, layout.n_heads
    if g == h:
        return None
    explicit = layout.kv_map
    return list(explicit) if explicit is not None else [i // (h // g) for i in range(h)]


def _num(x: float) -> float | None:
    """A JSON number, or None (null) where the value is not finite."""
    return float(x) if math.isfinite(x) else None


def order_checkpoints(paths: Sequence[Path]) -> tuple[list[tuple[Path, int]], list[tuple[str, str]]]:
    """(path, step) sorted by step; a checkpoint whose step cannot be read, or repeats one, fails."""
    ordered, failures = [], []
    for i, path in enumerate(paths):
        try:
            step = step_of(path)
        except DiagError as err:
            failures.append((str(path), str(err)))
            continue
        ordered.append((i, path, i if step is None else step))
    ordered.sort(key=lambda t: (t[2], t[0]))
    kept: list[tuple[Path, int]] = []
    for _, path, step in ordered:
        if kept and kept[-1][1] == step:
            failures.append((str(path), f"{path}: step {step} again (also {kept[-1][0]}); a series needs one "
                             "checkpoint per step: pass one of them"))
        else:
            kept.append((path, step))
    return kept, failures


class _Series:
    """The state carried from one checkpoint to the next."""

    def __init__(self, out: Analysis, heads: int | None, kv_heads: int | None, sec_top: int,
                 sinks: FanOut, alert_sink: AlertSink, detectors: Detectors, probe: ProbeFn | None,
                 layout: LayoutFile | None = None, model_layout: ModelLayoutFn | None = None) -> None:
        self.out, self.n_heads, self.kv_heads, self.sec_top = out, heads, kv_heads, sec_top
        self.probe, self.layout, self.model_layout = probe, layout, model_layout
        self.sinks, self.alert_sink, self.detectors = sinks, alert_sink, detectors
        self.previous: tuple[int, list[Projections]] | None = None
        self.update_tracker = UpdateTracker()  # the live Monitor's computation, warm across the series
        self.per_head = True

    def add(self, path: Path, step: int) -> None:
        ckpt = open_checkpoint(path)
        try:
            layers, heads = choose_layers(ckpt, self.layout, self.n_heads, self.kv_heads, self.model_layout)
        except SpecError as err:
            raise SpecError(f"{path}: {str(err).removeprefix(f'{path}: ')}") from None
        self._check_same(path, layers)
        weights = [_weights(ckpt, layer) for layer in layers]
        mats = [split_projections(w, layer.layout) for w, layer in zip(weights, layers)]
        with torch.no_grad():
            spectra = layer_spectra([_query_key(w, la.layout, m) for w, la, m in zip(weights, layers, mats)],
                                    self.sec_top)
            updates = self._updates(mats)
        if not self.out.layers:
            self.out.layers, self.out.heads = layers, heads
            self.per_head = per_head_default(sum(la.layout.n_heads for la in layers))
        if updates is not None:
            self._emit(self.previous[0], host_arrays(list(zip((la.label for la in layers), updates))), True)
        arrays = host_arrays([(la.label, m) for la, m in zip(layers, spectra)])
        if self.probe is not None:
            self._add_probe(path, ckpt, layers, arrays)
        self._emit(step, arrays, False)
        self.previous = (step, mats)
        self.out.analysed.append((str(path), step))

    def _add_probe(self, path: Path, ckpt: Checkpoint, layers: list[StateDictLayer], arrays: LayerArrays) -> None:
        """Attention arrays from the probe, merged per layer; a probe failure leaves the weights' metrics."""
        try:
            attention = self.probe(ckpt, layers)
        except DiagError as err:
            message = str(err).removeprefix(f"{path}: ")
            self.out.failures.append((str(path), f"{path}: probe: {message}"))
            return
        for label, metrics in attention.items():
            arrays.setdefault(label, {}).update(metrics)

    def _check_same(self, path: Path, layers: list[StateDictLayer]) -> None:
        if self.out.layers and [(la.name, la.layout) for la in layers] != [
            (la.name, la.layout) for la in self.out.layers
        ]:
            first = self.out.analysed[0][0]
            raise SpecError(
                f"{path}: mismatched shapes: its attention layers ({len(layers)}) differ in names or shapes "
                f"from those of {first} ({len(self.out.layers)}); analyse checkpoints of one model per run"
            )

    def _updates(self, mats: list[Projections]) -> list[dict[str, Tensor]] | None:
        if self.previous is None:
            return None
        tracker = self.update_tracker
        return tracker.measure(tracker.snapshot(self.previous[1]), mats)

    def _emit(self, step: int, arrays: LayerArrays, update: bool) -> None:
        (self.out.updates if update else self.out.spectra)[step] = arrays
        record = build_record(step, arrays, self.per_head)
        self.out.records.append(record)
        self.sinks.write(record)
        alerts = self.detectors.observe(Observation(step, None, arrays))
        self.out.alerts += alerts
        self.alert_sink.emit(alerts)


def _query_key(weights: dict[str, Tensor], layout: QKVLayout, mats: Projections) -> tuple[Tensor, Tensor]:
    """Q (H, D, E) and K, as the live Monitor pairs them: K row h is query head h's key head where the layout
    has an explicit query-to-KV-head map; else K (G, D, E), query head h with key head h // (H/G)."""
    if layout.kv_map is not None:
        q, k, _ = split_qkv(weights, layout, paired=True)
        return q, k
    return mats["q"], mats["k"]


def _weights(ckpt: Checkpoint, layer: StateDictLayer) -> dict[str, Tensor]:
    return {rel: ckpt.tensors.get(key) for rel, key in layer.keys().items()}


def _layout_file(layout: str | Path | LayoutFile | Mapping[str, QKVLayout] | None) -> LayoutFile | None:
    if layout is None or isinstance(layout, LayoutFile):
        return layout
    if isinstance(layout, Mapping):
        if not all(isinstance(v, QKVLayout) for v in layout.values()):
            raise ConfigError("analyze_checkpoints(layout={...}): expected {module pattern: QKVLayout}")
        return LayoutFile(tuple(LayoutEntry(k, v) for k, v in layout.items()), "layout=")
    return read_layout_file(layout)


def analyze_checkpoints(
    paths: Iterable[str | Path],
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    sec_top: int = DEFAULT_SEC_TOP,
    sinks: Sequence[Sink] = (),
    alerts_path: Path | None = None,
    alerts: AlertConfig | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
    probe: ProbeFn | None = None,
    layout: str | Path | LayoutFile | Mapping[str, QKVLayout] | None = None,
    model_layout: ModelLayoutFn | None = None,
) -> Analysis:
    """Analyse checkpoints (files, folders, globs) in step order; see the module docstring.

    Failures (a missing path, a corrupt or refused file, an unknown layout) are
    collected in ``Analysis.failures`` with one line each; the others go on.
    ``progress`` wraps the ordered checkpoints (e.g. ``tqdm``). ``probe`` adds attention
    arrays per checkpoint (``hooks.checkpoint.probe.Probe``); its failures are collected too.
    ``layout``: a layout file (path or :class:`LayoutFile`) or a Monitor-style spec
    ``{module pattern: QKVLayout}`` for every checkpoint; else each checkpoint's own
    (see :mod:`diag.offline.layers`). ``model_layout`` finds the layouts of a Hugging
    Face folder's model (``hooks.checkpoint.search.ModelLayouts``).
    """
    if layout is not None and (heads is not None or kv_heads is not None):
        raise ConfigError("analyze_checkpoints: pass either layout= (--layout) or heads=/kv_heads= (--heads, "
                          "--kv-heads), not both: the layout already holds the head counts")
    spec = _layout_file(layout)
    out = Analysis()
    found, failed = find_checkpoints(str(p) for p in paths)
    out.failures += [(arg, str(err)) for arg, err in failed]
    ordered, failed_steps = order_checkpoints(found)
    out.failures += failed_steps
    fan = FanOut(list(sinks))
    series = _Series(out, heads, kv_heads, sec_top, fan, AlertSink(fan, alerts_path), Detectors(alerts), probe,
                     spec, model_layout)
    for path, step in progress(ordered) if progress else ordered:
        try:
            series.add(path, step)
        except DiagError as err:
            out.failures.append((str(path), str(err)))
        except (RuntimeError, OSError, ValueError) as err:  # a tensor that cannot be read or split
            out.failures.append((str(path), f"{path}: failed while reading its attention weights ({err}); "
                                 "the file is corrupt or its shapes do not fit the layout"))
    fan.flush()
    return out
