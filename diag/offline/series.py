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

The work is split in three: the plan (:mod:`diag.offline.plan`: steps and layers, from headers), the
units (:mod:`diag.offline.units`: one checkpoint at a time, one layer at a time, against the checkpoint
before it; in worker processes with ``jobs``, :mod:`diag.offline.jobs`; kept on disk with ``store``,
:mod:`diag.offline.store`; each taken from where it is, :mod:`diag.offline.source`), and the records, written
here in step order from the units. :func:`prepare_series` makes the plan and names the units without computing
or writing anything (the command line asks it whether ``--out`` already holds this very analysis, finished);
:meth:`Series.run` computes and writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diag.detectors import Alert, AlertConfig, Detectors, Observation
from diag.errors import ConfigError
from diag.layouts.statedict import Heads, StateDictLayer
from diag.layouts.vocab import QKVLayout
from diag.math.metrics import DEFAULT_SEC_TOP
from diag.offline.checkpoint import STEP_KEYS, STEP_NAMES
from diag.offline.layers import ModelLayoutFn
from diag.offline.layoutfile import LayoutEntry, LayoutFile, read_layout_file
from diag.offline.plan import LayoutChoice, Plan, Planned, make_plan
from diag.offline.source import UnitSource
from diag.offline.store import UnitStore
from diag.offline.units import ProbeFn
from diag.outputs.alert_sink import AlertSink
from diag.outputs.records import LayerArrays, build_record, per_head_default
from diag.outputs.sinks import FanOut, Record, Sink

__all__ = ["Analysis", "ProbeFn", "Series", "analyze_checkpoints", "prepare_series"]


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
    positions: list[str] = field(default_factory=list)  # checkpoints whose step is their position in the series

    @property
    def steps(self) -> list[int]:
        return [step for _, step in self.analysed]

    @property
    def assumptions(self) -> list[str]:
        """What could not be read from the checkpoints: the layouts' assumptions, steps taken from positions."""
        stated = [] if self.heads is None else list(self.heads.assumptions)
        if self.positions:
            shown = ", ".join(self.positions[:3]) + (", ..." if len(self.positions) > 3 else "")
            stated.append(f"assumed: the step of each checkpoint is its position in the series (0, 1, ...; {shown})"
                          f": none has a step stored with it ({', '.join(STEP_KEYS)}) or in its name "
                          f"({STEP_NAMES}); the steps written are these positions")
        return stated

    def summary(self) -> dict:
        """A JSON-ready summary: checkpoints, layers, final metrics, alerts, failures."""
        return {
            "checkpoints": [{"path": p, "step": s, **({"step_from": "position"} if p in self.positions else {})}
                            for p, s in self.analysed],
            "failures": [{"path": p, "error": e} for p, e in self.failures],
            "heads": None if self.heads is None else {"source": self.heads.source, "note": self.heads.note},
            "assumptions": self.assumptions,
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
    return None if layout.kv_heads == layout.n_heads else list(layout.kv_index)


def _num(x: float) -> float | None:
    """A JSON number, or None (null) where the value is not finite."""
    return float(x) if math.isfinite(x) else None


class _Records:
    """The records, in step order, from the units."""

    def __init__(self, out: Analysis, sinks: FanOut, alert_sink: AlertSink, detectors: Detectors) -> None:
        self.out, self.sinks, self.alert_sink, self.detectors = out, sinks, alert_sink, detectors
        self.previous: Planned | None = None
        self.per_head = True

    def add(self, entry: Planned, units: UnitSource) -> None:
        if entry.error is not None:
            self.out.failures.append((str(entry.path), entry.error))
            return
        result = units.result(entry, self.previous)
        if result.error is not None:
            self.out.failures.append((str(entry.path), result.error))
            return
        if not self.out.layers:
            self.out.layers, self.out.heads = list(entry.layers or ()), entry.heads
            self.per_head = per_head_default(sum(la.layout.n_heads for la in self.out.layers))
        if result.updates is not None and self.previous is not None:
            gap = None if entry.step_from == "position" else entry.step - self.previous.step
            self._emit(self.previous.step, result.updates, True, gap)
        arrays = {label: dict(metrics) for label, metrics in result.spectra.items()}
        if result.probe_error is not None:
            self.out.failures.append((str(entry.path), result.probe_error))
        for label, metrics in (result.probe or {}).items():
            arrays.setdefault(label, {}).update(metrics)
        self._emit(entry.step, arrays, False)
        self.previous = entry
        self.out.analysed.append((str(entry.path), entry.step))
        if entry.step_from == "position":
            self.out.positions.append(str(entry.path))

    def _emit(self, step: int, arrays: LayerArrays, update: bool, gap: int | None = 1) -> None:
        """``gap``: the optimizer steps an update spans (None: not known, the steps are positions)."""
        (self.out.updates if update else self.out.spectra)[step] = arrays
        record = build_record(step, arrays, self.per_head)
        self.out.records.append(record)
        self.sinks.write(record)
        alerts = self.detectors.observe(Observation(step, None, arrays, update_steps=gap))
        self.out.alerts += alerts
        self.alert_sink.emit(alerts)


def _layout_file(layout: str | Path | LayoutFile | Mapping[str, QKVLayout] | None) -> LayoutFile | None:
    if layout is None or isinstance(layout, LayoutFile):
        return layout
    if isinstance(layout, Mapping):
        if not all(isinstance(v, QKVLayout) for v in layout.values()):
            raise ConfigError("analyze_checkpoints(layout={...}): expected {module pattern: QKVLayout}")
        return LayoutFile(tuple(LayoutEntry(k, v) for k, v in layout.items()), "layout=")
    return read_layout_file(layout)


def _check_options(layout: object, heads: int | None, kv_heads: int | None, kv_map: str | None,
                   user_model: ModelLayoutFn | None, jobs: int) -> None:
    if layout is not None and (heads is not None or kv_heads is not None):
        raise ConfigError("analyze_checkpoints: pass either layout= (--layout) or heads=/kv_heads= (--heads, "
                          "--kv-heads), not both: the layout already holds the head counts")
    if kv_map is not None and layout is not None:
        raise ConfigError("analyze_checkpoints: pass either layout= (--layout) or kv_map= (--kv-map), not both: "
                          "a layout file states each layer's pairing in its kv_map field")
    if user_model is not None and (layout is not None or heads is not None or kv_heads is not None):
        raise ConfigError("analyze_checkpoints: user_model= (--model) finds the layouts and head counts of the "
                          "model it builds; pass it without layout=/heads=/kv_heads= (--layout, --heads, --kv-heads)")
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"analyze_checkpoints(jobs={jobs!r}): expected a whole number of processes >= 1")


@dataclass
class Series:
    """A series planned (its checkpoints in step order, their layers) and its units named: nothing computed or
    written yet (:func:`prepare_series`)."""

    plan: Plan
    units: UnitSource
    jobs: int = 1

    def finished(self) -> bool:
        """Whether the store holds a finished analysis of exactly this series (same checkpoints, same options)."""
        return self.units.finished()

    def run(self, sinks: Sequence[Sink] = (), alerts_path: Path | None = None, alerts: AlertConfig | None = None,
            progress: Callable[[Iterable], Iterable] | None = None) -> Analysis:
        """The analysis, its records written to ``sinks`` and its alerts to ``alerts_path``."""
        out = Analysis(failures=list(self.plan.failures))
        fan = FanOut(list(sinks))
        records = _Records(out, fan, AlertSink(fan, alerts_path), Detectors(alerts))
        store = self.units.store
        if store is not None:
            store.begin()
        self.units.start(self.jobs)
        try:
            for entry in progress(self.plan.entries) if progress else self.plan.entries:
                records.add(entry, self.units)
        finally:
            self.units.close()
        if store is not None:
            store.forget_others()
            store.finish(out.steps)
        fan.flush()
        return out


def prepare_series(
    paths: Iterable[str | Path],
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    sec_top: int = DEFAULT_SEC_TOP,
    probe: ProbeFn | None = None,
    layout: str | Path | LayoutFile | Mapping[str, QKVLayout] | None = None,
    model_layout: ModelLayoutFn | None = None,
    kv_map: str | None = None,
    user_model: ModelLayoutFn | None = None,
    jobs: int = 1,
    store: str | Path | None = None,
) -> Series:
    """The plan of :func:`analyze_checkpoints` (its options, the same), ready to :meth:`Series.run`."""
    _check_options(layout, heads, kv_heads, kv_map, user_model, jobs)
    choice = LayoutChoice(_layout_file(layout), heads, kv_heads, model_layout, kv_map, user_model)
    plan = make_plan(paths, choice)
    units = UnitSource(plan.entries, sec_top, probe, None if store is None else UnitStore(store))
    return Series(plan, units, jobs)


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
    kv_map: str | None = None,
    user_model: ModelLayoutFn | None = None,
    jobs: int = 1,
    store: str | Path | None = None,
) -> Analysis:
    """Analyse checkpoints (files, folders, globs) in step order; see the module docstring.

    Failures (a missing path, a corrupt or refused file, an unknown layout) are
    collected in ``Analysis.failures`` with one line each; the others go on.
    ``progress`` wraps the ordered checkpoints (e.g. ``tqdm``). ``probe`` adds attention
    arrays per checkpoint (``hooks.checkpoint.probe.Probe``); its failures are collected too.
    ``layout``: a layout file (path or :class:`LayoutFile`) or a Monitor-style spec
    ``{module pattern: QKVLayout}`` for every checkpoint; else each checkpoint's own
    (see :mod:`diag.offline.layers`). ``model_layout`` finds the layouts of a Hugging
    Face folder's model (``hooks.checkpoint.search.ModelLayouts``); ``user_model`` those of the
    user's own model (``hooks.checkpoint.usermodel.UserModel``, ``--model``). ``kv_map``: the
    grouped-query pairing where the layouts assume one (``"grouped"``, ``"tiled"`` or ``"0,1,0,1"``).
    ``jobs``: worker processes (the results are those of one). ``store``: a folder where each
    checkpoint's arrays are kept; a later call with the same checkpoints and options reads them
    instead of computing them again (how ``--out`` resumes), and an analysis that ran to its end says
    so there (:meth:`diag.offline.store.UnitStore.state`).
    """
    series = prepare_series(paths, heads=heads, kv_heads=kv_heads, sec_top=sec_top, probe=probe, layout=layout,
                            model_layout=model_layout, kv_map=kv_map, user_model=user_model, jobs=jobs, store=store)
    return series.run(sinks, alerts_path, alerts, progress)
