"""The Monitor: attach to a model in one line, call ``step`` once per training step.

    monitor = Monitor(model, logdir="runs/exp1")
    ...
    loss.backward()
    monitor.step(step, loss=loss)   # after backward (and clipping), before optimizer.step()
    optimizer.step()

Semantics: values logged at step t describe the model of step t's forward and
backward; ``update_*`` at step t describe the update that optimizer step t applied
(measured at the next ``step`` call or at ``close``). A non-sampled step costs a
few attribute reads. A sampled step works under ``no_grad``, draws no random
numbers and only reads parameters and gradients. Which families a step samples
is the cadence (:mod:`hooks.monitor.cadence`): by default the loss, the gradient norms and
the spectra every 20, attention every 50, update ratios every 100, with a closer look at attention
while a head moves fast (docs/cost.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from diag.catalog.metrics import family_metrics
from diag.catalog.tags import layer_tag
from diag.detectors import Alert, AlertConfig, Detectors, Observation, TrainingHalted
from diag.errors import ConfigError, WarnOnce
from diag.layouts.vocab import QKVLayout
from diag.math.metrics import DEFAULT_SEC_TOP
from diag.offline.layoutfile import FILE_NAME as LAYOUT_FILE
from diag.offline.layoutfile import LayoutEntry, layout_document, write_layout_file
from diag.outputs.alert_sink import AlertSink
from diag.outputs.records import attention_metrics, build_record, host_arrays, per_head_default
from diag.outputs.sinks import FanOut, JsonlSink, Record, Sink, TensorBoardSink, check_logdir
from diag.outputs.tb_views import TensorBoardViews
from hooks.capture.compiled import EagerCapture
from hooks.layout.book import LayoutBook
from hooks.layout.discover import AttentionLayer, discover
from hooks.monitor.cadence import CloserLook, CloserLookConfig, resolve_cadence
from hooks.monitor.lossmean import LossMean
from hooks.monitor.weightside import WeightSide
from hooks.parallel.detectors import SharedDetectors
from hooks.parallel.headgather import HeadGather
from hooks.parallel.ranks import rank, world_size

__all__ = ["Monitor", "SIGNALS"]

log = logging.getLogger("diag")

SIGNALS = ("spectra", "attention", "grads", "updates")
SPECTRAL_METRICS = family_metrics("spectra")
GRAD_METRICS = family_metrics("grads")
REPORTED_NONFINITE = ("loss", "qk_", "grad_")  # tags whose non-finite values the nonfinite_* alerts report


class Monitor:
    """Watches every attention layer of ``model`` and writes the signals to sinks.

    Args:
        model: any ``nn.Module`` holding attention layers.
        logdir: TensorBoard run directory; ``metrics.jsonl`` and ``alerts.jsonl`` go
            there too. Checked writable now. None: only ``sinks``.
        every: sample every family at steps where ``step % every == 0`` (the uniform cadence
            of earlier versions). Default None: the per-family cadence of
            :data:`hooks.monitor.cadence.DEFAULT_CADENCE` (loss and gradient norms every 10 steps,
            spectra every 20, attention every 50, update ratios every 100, plus ``closer_look``),
            whose cost is measured in docs/cost.md.
        cadence: ``{family: steps between samples}`` for some of ``"loss"``, ``"grads"``,
            ``"spectra"``, ``"attention"``, ``"updates"``; overrides ``every`` or the default
            for the families named.
        per_head: log every head's scalars; default: when the model has at most
            256 heads in total.
        spec: ``{module-name pattern: QKVLayout}``; overrides discovery.
        signals: subset of ``("spectra", "attention", "grads", "updates")``.
        sec_top: s of the spectral energy concentration SEC_s.
        attn_seqs: the first ``attn_seqs`` sequences of the batch are analysed.
        attn_rank_rows: the attention rank uses the first this many query rows.
        sinks: more sinks (objects with write/flush/close).
        alerts: detector thresholds; ``on_alert``: called with each Alert.
        stop_on_critical: raise ``TrainingHalted`` from ``step`` on a critical alert.
        purge_step: on resume, TensorBoard discards events at or after this step; the run goes on
            in a ``logdir`` that already holds one.
        overwrite: replace the run a ``logdir`` already holds. Without it (or ``purge_step``) such
            a folder is refused: the one policy of every output folder (docs/tensorboard.md).
        images: write TensorBoard images (layer x head heatmaps, update ratios over time,
            attention maps of heads an alert names); default: when ``logdir`` is set.
        image_every: heatmaps and update-ratio images every this many steps (a multiple of
            ``every``, or of the steps that sample every family); default ten such periods
            (``10 * every``; 1000 steps at the default cadence). Attention maps go out at every alert.
        grad_scaler: the fp16 ``GradScaler`` of the loop, if any: a sampled step whose
            gradients overflowed (the scaler skips its update) then raises an info
            ``gradient_overflow`` alert instead of a critical ``nonfinite_gradients``.
        closer_look: when attention is sampled less often than the loss (the default
            cadence), also sample it (and the spectra) with the loss while a head's sigma_1
            grows fast, a collapse is being confirmed or the first updates are large
            (``RiskConfig.watch_risk`` and ``watch_growth``; for ``CloserLookConfig.hold`` steps, every
            ``early_every`` steps within the first ``early``, every ``confirm_every`` while a malignant state
            is being confirmed, attention alone every ``watch_every`` while a layer is one established head
            short of a malignant collapse; pass a ``CloserLookConfig`` to change them;
            docs/cost.md#watching-closer). One process only: under DDP, FSDP or tensor parallelism
            the ranks would have to agree every sampled step, so it is off there.
    """

    def __init__(
        self,
        model: nn.Module,
        logdir: str | os.PathLike | None = None,
        every: int | None = None,
        *,
        cadence: Mapping[str, int] | None = None,
        per_head: bool | None = None,
        spec: Mapping[str, QKVLayout] | None = None,
        signals: Iterable[str] = SIGNALS,
        sec_top: int = DEFAULT_SEC_TOP,
        attn_seqs: int = 2,
        attn_rank_rows: int = 256,
        sinks: Iterable[Sink] = (),
        alerts: AlertConfig | None = None,
        on_alert: Callable[[Alert], None] | None = None,
        stop_on_critical: bool = False,
        purge_step: int | None = None,
        overwrite: bool = False,
        images: bool | None = None,
        image_every: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        closer_look: bool | CloserLookConfig = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Monitor(model=...) needs an nn.Module, got {type(model).__name__}")
        self.signals = frozenset(signals)
        unknown = self.signals - set(SIGNALS)
        if unknown:
            raise ConfigError(f"Monitor(signals=...) has unknown {sorted(unknown)}; choose from {SIGNALS}")
        self.cadence = resolve_cadence(every, cadence, self.signals)
        self._explicit_every = every
        for name, value in (("sec_top", sec_top), ("attn_seqs", attn_seqs), ("attn_rank_rows", attn_rank_rows)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Monitor({name}={value!r}): expected an integer >= 1")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "is_enabled", None)):
            raise ConfigError(f"Monitor(grad_scaler=...): expected a torch.amp.GradScaler, got "
                              f"{type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.model, self.every, self.sec_top = model, self.cadence.base, sec_top
        self.layers: list[AttentionLayer] = discover(model, spec, computation="attention" in self.signals)
        total_heads = sum(layer.layout.n_heads for layer in self.layers)
        self.per_head = per_head_default(total_heads) if per_head is None else per_head
        sink_list = list(sinks)
        # Distributed (docs/distributed.md): only rank 0 has the logdir files and the alert callback;
        # every rank computes the metrics, and the detectors agree across ranks.
        main = rank() == 0
        resume = purge_step is not None
        self.logdir = None if logdir is None or not main else check_logdir(logdir, overwrite=overwrite, resume=resume)
        if self.logdir is not None:
            sink_list += [TensorBoardSink(self.logdir, purge_step), JsonlSink(self.logdir / "metrics.jsonl")]
        self.sinks = FanOut(sink_list)
        alert_path = None if self.logdir is None else self.logdir / "alerts.jsonl"
        self.alert_sink = AlertSink(self.sinks, alert_path, on_alert if main else None, stop_on_critical)
        self.detectors = Detectors(alerts or AlertConfig())
        cfg = self.detectors.cfg
        self._updates_at_once = cfg.note_horizon  # updates of steps before this are measured on the next step
        look = closer_look if isinstance(closer_look, CloserLookConfig) else CloserLookConfig()
        self.closer = CloserLook(self.cadence, look.hold, early=look.early, early_every=look.early_every,
                                 confirm_every=look.confirm_every, watch_every=look.watch_every,
                                 enabled=bool(closer_look) and world_size() == 1 and "attention" in self.signals)
        if world_size() > 1:
            self.detectors = SharedDetectors(self.detectors, stop_on_critical)
        # FSDP2: gathers a layer at a time on sampled steps; W_O only for its update ratio
        self._warn_once = WarnOnce(log, stacklevel=3)  # (kind, message): each kind of fault reported once
        # tensor parallelism: each rank measures its own heads, one gather of their scalars (docs/distributed.md)
        self._heads = HeadGather(self.layers) if any(layer.block is not None for layer in self.layers) else None
        self._weights = WeightSide(self.layers, self.signals, sec_top, self._warn_once,
                                   heads=self._heads)
        # the layers' layouts, decided in one place: only a captured forward confirms a layout proposed from names;
        # under tensor parallelism each rank's kernel computes its own block of heads (hooks/parallel/heads.py),
        # which the book checks
        local = [layer.on_this_rank() for layer in self.layers]
        self.layouts = LayoutBook(local, watching="attention" in self.signals)
        self.capture = EagerCapture(local, attn_seqs, attn_rank_rows, model=model, layouts=self.layouts)
        self.last: dict[str, float] = {}
        self._loss_mean = LossMean()  # every step's loss, for the mean of those between two loss samples
        self._closed = False
        self._init_tensorboard(images, image_every)
        self._layout_source = "Monitor spec" if spec else "Monitor discovery"
        if self.logdir is not None:  # the layouts travel with the run: `analyze` reads them (docs/analyze.md)
            self._guard("layout file", self.save_layout, self.logdir / LAYOUT_FILE)
        if "attention" in self.signals:
            self.capture.arm()  # the first forward; discarded if its step is not sampled

    # ------------------------------------------------------------------ public

    def should_sample(self, step: int) -> bool:
        """Whether ``step`` samples any family (the loss included)."""
        return bool(self.cadence.due(step))

    def step(self, step: int, loss: Tensor | float | None = None) -> None:
        """Call once per training step, after backward and before ``optimizer.step()``."""
        if self._closed:
            return
        if loss is not None:  # kept for the mean loss since the last sample: a detach, no kernel
            try:
                self._loss_mean.add(loss)
            except Exception as err:  # noqa: BLE001 - the training run must go on
                self._warn_once("loss", f"diag: keeping the loss failed at this step ({err!r}); training continues")
        weights = self._weights
        if weights.pending is not None:  # the step after an update sample: dW, elementwise, no host read
            self._guard("updates", weights.advance)
        due = self.cadence.due(step)
        if self.closer.until >= step:  # a closer look is on: it may add families, or a step of its own
            due = due | self.closer.adds(step)
        if weights.applied is not None and (due or weights.applied.step < self._updates_at_once):
            self._guard("updates", self._finish_updates)  # on a sampled step, or in the run's first steps
            if self.closer.until >= step:  # the ratios may have started a closer look
                due = due | self.closer.adds(step)
        if due:
            self._guard("sample", self._sample, step, loss, due)
        if self.capture.armed and "attention" not in due:
            self.capture.disarm()
        # the closer look's check only while one is on (until >= the next step): nothing more on a quiet step
        if self.cadence.is_due("attention", step + 1) or (
                self.closer.until > step and "attention" in self.closer.adds(step + 1)):
            self.capture.arm()

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Write extra scalars (tag -> value) through the Monitor's sinks, e.g. from
        :class:`hooks.SpectralStepLimit`. Never raises into training."""
        if self._closed:
            return
        self._guard("log_scalars", lambda: self.sinks.write(Record(step, {t: float(v) for t, v in scalars.items()})))

    def close(self, measure_pending: bool = True) -> None:
        """Write what is pending, remove every hook, close the detectors (where they have a ``close``) and the
        sinks. Idempotent.

        ``measure_pending=False`` drops the update ratio of the last sampled step instead of
        measuring it: on an exception path under FSDP2 that measurement is a collective the
        other ranks may never join (``__exit__`` with an exception in flight does this on
        more than one process)."""
        if self._closed:
            return
        self._closed = True
        self.capture.disarm()
        if measure_pending:
            if self._weights.pending is not None:
                self._guard("updates", self._weights.advance)
            if self._weights.applied is not None:
                self._guard("updates", self._finish_updates)
        self._weights.pending = self._weights.applied = None
        self._loss_mean.clear()  # nothing of the run's tensors kept
        close = getattr(self.detectors, "close", None)  # detectors that hold a resource (a recorder's file)
        if close is not None:
            self._guard("detectors", close)
        self.sinks.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(measure_pending=exc_type is None or world_size() == 1)

    def __del__(self) -> None:
        capture = getattr(self, "capture", None)
        if capture is not None:
            with contextlib.suppress(Exception):  # at interpreter shutdown modules may already be gone
                capture.disarm()

    @property
    def refused(self) -> Mapping[int, str]:
        """Layers whose layout the computation refused (or nothing could confirm): every metric of theirs is
        suspect (the head split may be wrong), so none is logged from then on. Asked of :attr:`layouts`."""
        return self.layouts.refused

    def state_dict(self) -> dict:
        return {"detectors": self.detectors.state_dict()}

    def layout_document(self) -> dict:
        """The watched layers' layouts as a layout file's JSON object (module path, QKVLayout, tag label)."""
        entries = [LayoutEntry(layer.name, layer.layout, layer.label) for layer in self.layers]
        return layout_document(entries, self._layout_source)

    def save_layout(self, path: str | os.PathLike) -> None:
        """Write :meth:`layout_document` to ``path`` (``attnscope_layout.json`` beside your checkpoints lets
        ``python -m diag analyze`` read them exactly with no options)."""
        entries = [LayoutEntry(layer.name, layer.layout, layer.label) for layer in self.layers]
        write_layout_file(path, entries, self._layout_source)

    def load_state_dict(self, state: dict) -> None:
        self.detectors.load_state_dict(state["detectors"])

    # --------------------------------------------------------------- internals

    def _guard(self, what: str, fn: Callable, *args: object) -> None:
        """A fault in the monitor is reported once per kind and never reaches training."""
        try:
            fn(*args)
        except TrainingHalted:
            raise
        except Exception as err:  # noqa: BLE001 - the training run must go on
            self._warn_once(what, f"diag: {what} failed at this step ({err!r}); training continues")

    def _sample(self, step: int, loss: Tensor | float | None, due: frozenset[str]) -> None:
        if "attention" in due and not self.capture.armed:
            self._warn_once("unarmed", f"diag: step {step} is sampled but step {step - 1} was not "
                            "reported, so its attention was not captured; call monitor.step for every "
                            "training step with consecutive step numbers")
        results, problems = self.capture.take() if "attention" in due else ({}, {})
        with torch.no_grad():
            by_index, spectra_failed = self._weights.sample(step, due)
            per_layer = [by_index[layer.index] for layer in self.layers]
            for layer, values in zip(self.layers, per_layer):
                self._attention(layer, values, results, problems)
            if self._heads is not None and due & {"grads", "spectra", "attention"}:  # every rank, every such step
                spectra_failed = self._gather_heads(by_index, results, due, spectra_failed)
                per_layer = [by_index[layer.index] for layer in self.layers]
            for layer, values in zip(self.layers, per_layer):
                if layer.index in self.refused:
                    values.clear()  # its weights are still snapshotted: the update is dropped when measured
            sampled = loss if "loss" in due else None
            mean = None
            if sampled is not None:
                try:  # losses of several shapes or devices: the detectors read the step's loss
                    mean = self._loss_mean.take()
                except Exception as err:  # noqa: BLE001 - the sample goes on
                    self._warn_once("loss mean", f"diag: the mean loss since the last sample failed ({err!r}); "
                                    "the plateau detector reads the sampled step's loss")
            record, arrays, loss_value, mean_value = self._record(step, per_layer, sampled, mean)
        if spectra_failed:  # NaN from a failed solver, already reported: not a sign of NaN weights
            arrays = {label: {m: v for m, v in metrics.items() if m not in SPECTRAL_METRICS}
                      for label, metrics in arrays.items()}
        overflow = self._grad_overflow(arrays)
        skip = (SPECTRAL_METRICS if spectra_failed else ()) + (GRAD_METRICS if overflow else ())
        self._check_finite(record, skip=skip)
        if overflow:  # a routine fp16 event: the scaler skips this update; not a sign of a broken run
            arrays = {label: {m: v for m, v in metrics.items() if not m.startswith("grad_")}
                      for label, metrics in arrays.items()}
        alerts = self.detectors.observe(Observation(step, loss_value, arrays, mean_value))
        record.scalars.update(self._judged())  # collapse_risk: in the same record as the signals it read
        self.last = dict(record.scalars)
        self.sinks.write(record)
        self._look_closer(step)
        if overflow:
            alerts.append(Alert(step, "gradient_overflow", "info", "", f"gradients overflowed at step {step} "
                                "under fp16 loss scaling; the GradScaler skips this update and lowers its scale"))
        self._guard("tensorboard", self._tensorboard, record, arrays, results, alerts, due)
        self.alert_sink.emit(alerts)

    def _judged(self) -> dict[str, float]:
        """What the detectors computed from this sample (``collapse_risk`` per layer), as tags."""
        judged = getattr(self.detectors, "scalars", dict)()
        return {layer_tag(metric, label): float(v) for metric, values in judged.items() for label, v in values.items()}

    def _look_closer(self, step: int) -> None:
        """After the detectors judged ``step``: start or extend the closer look if they ask for it."""
        if self.closer.period is None:
            return
        watched, reason = self.closer.heed(step, self.detectors)
        if watched:
            log.info("diag: %s: attention sampled every %d steps while it is (closer_look)", watched,
                     self.closer.watch_every)
        if reason:
            confirming = step <= self.closer.confirm_until
            dense = self.closer.confirm_until if confirming else self.closer.early - 1
            every = self.closer.confirm_every if confirming else self.closer.early_every
            early = step <= dense
            log.info("diag: %s: attention sampled every %d steps%s until at least step %d (closer_look)", reason,
                     every if early else self.closer.period,
                     f" up to step {dense}, then every {self.closer.period}" if early else "",
                     self.closer.until)

    def _grad_overflow(self, arrays: dict) -> bool:
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return False
        return any(not np.isfinite(values).all() for metrics in arrays.values()
                   for metric, values in metrics.items() if metric.startswith("grad_"))

    def _attention(self, layer, values: dict, results: dict, problems: dict) -> None:
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

    def _record(
        self, step: int, per_layer: list[dict], loss: Tensor | float | None, mean: Tensor | float | None = None
    ) -> tuple[Record, dict, float | None, float | None]:
        """The record, the detectors' arrays, the loss and the mean loss since the last loss sample as floats:
        loss tensors travel to the host in the same transfer as every metric (one host sync per sampled step on
        an accelerator). The mean goes to the detectors, not to the record: the ``loss`` tag is the step's."""
        rows = [(layer.label, values) for layer, values in zip(self.layers, per_layer)]
        scalars = {name: value.detach().reshape(1) for name, value in (("loss", loss), ("loss_mean", mean))
                   if isinstance(value, Tensor)}  # scalars, as float(loss) requires
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

    def _finish_updates(self) -> None:
        scalars: dict[str, float] = {}
        arrays: dict[str, dict[str, np.ndarray]] = {}
        with torch.no_grad():
            step, measured = self._weights.measure()
        kept = [(layer, measured[layer.index]) for layer in self.layers
                if layer.index in measured and layer.index not in self.refused]
        names = [(layer.label, metric) for layer, m in kept for metric in m]
        values = torch.stack([v.double() for _, m in kept for v in m.values()]).tolist() if names else []  # one sync
        for (label, metric), value in zip(names, values):
            scalars[layer_tag(metric, label)] = value
            arrays.setdefault(label, {})[metric] = np.array([value])
        self.last.update(scalars)
        self.sinks.write(Record(step, scalars))
        observe = getattr(self.detectors, "observe_updates", self.detectors.observe)  # distributed: no collective
        alerts = observe(Observation(step, None, arrays))
        self._look_closer(step)  # large first updates ask for it
        self.alert_sink.emit(alerts)

    def _check_finite(self, record: Record, skip: Iterable[str] = ()) -> None:
        """Non-finite values the detectors do not report: the loss, the weights (every ``qk_`` metric follows
        them) and the gradients are the ``nonfinite_*`` alerts' (one console line each, not two), and on a record
        where one of them is non-finite, what follows from it (the attention statistics) is not said again."""
        skipped = tuple(f"{metric}/" for metric in skip)
        nonfinite = [tag for tag, v in record.scalars.items() if not math.isfinite(v) and not tag.startswith(skipped)]
        if any(tag.startswith(REPORTED_NONFINITE) for tag in nonfinite):
            return  # a nonfinite_* alert says it; NaN attention statistics follow from NaN weights or inputs
        bad = [tag for tag in nonfinite if not tag.startswith(REPORTED_NONFINITE)]
        if bad:
            self._warn_once("nonfinite", f"diag: non-finite values at step {record.step} "
                            f"(e.g. {bad[:3]}); logged as NaN, training continues")

    # ------------------------------------------------- TensorBoard layout and images

    def _init_tensorboard(self, images: bool | None, image_every: int | None) -> None:
        """The image options (docs/tensorboard.md); the update-ratio history rides along as a sink."""
        full = self.cadence.full  # the steps that sample every family
        if image_every is None:
            image_every = 10 * full
        problem = None
        if isinstance(image_every, bool) or not isinstance(image_every, int) or image_every < 1 \
                or image_every % full:
            period = f"every={full}" if self._explicit_every == full else \
                f"{full} (the steps that sample every family, cadence {dict(self.cadence.periods)})"
            problem = (f"Monitor(image_every={image_every!r}): expected a positive multiple of {period} "
                       f"(images are drawn at sampled steps), e.g. image_every={10 * full}")
        elif images is not None and not isinstance(images, bool):
            problem = f"Monitor(images={images!r}): expected True, False or None (None: when logdir is set)"
        elif images and importlib.util.find_spec("PIL") is None:  # SummaryWriter.add_image encodes with Pillow
            problem = "Monitor(images=True) needs Pillow to encode PNGs: pip install pillow (or images=False)"
        if problem is not None:
            self.sinks.close()  # opened above: no file left open behind the error
            raise ConfigError(problem)
        if images is None:
            images = self.logdir is not None and importlib.util.find_spec("PIL") is not None
        self.images = images
        self.image_every = image_every
        self._views = TensorBoardViews(self.sinks, [layer.label for layer in self.layers], images=images,
                                       image_every=image_every, updates="updates" in self.signals,
                                       with_o=any(layer.o is not None for layer in self.layers))

    def _tensorboard(self, record: Record, arrays: dict, results: dict, alerts: list[Alert],
                     due: frozenset[str]) -> None:
        """The layout, alert events and images of this step (diag.outputs.tb_views); the layout is built
        from the tags of the first step that samples every family."""
        # under tensor parallelism rank 0's kernel saw its own block of heads: the first, numbered as in one process
        maps = {layer.label: getattr(results.get(layer.index), "maps", None) for layer in self.layers
                if layer.block is None or layer.block.index == 0}
        self._views.on_sample(record, arrays, maps, alerts, complete=due == frozenset(self.cadence.periods))

