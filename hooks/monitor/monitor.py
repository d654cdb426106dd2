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
is the cadence (:mod:`hooks.monitor.cadence`): by default the loss and the gradient norms every 10 steps,
the spectra every 20, attention every 50, update ratios every 100, with a closer look at attention
while a head moves fast (docs/cost.md). The Monitor coordinates: :mod:`hooks.monitor.sampling` measures,
the detectors judge, the sinks write.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from diag.catalog.tags import layer_tag
from diag.detectors import Alert, AlertConfig, Detector, Detectors, Observation, TrainingHalted
from diag.detectors.nonfinite import overflow_alert
from diag.errors import ConfigError, WarnOnce
from diag.layouts.vocab import QKVLayout
from diag.math.metrics import DEFAULT_SEC_TOP
from diag.offline.layoutfile import FILE_NAME as LAYOUT_FILE
from diag.offline.layoutfile import LayoutEntry, layout_document, write_layout_file
from diag.outputs.alert_sink import AlertSink
from diag.outputs.records import per_head_default
from diag.outputs.sinks import FanOut, JsonlSink, Record, Sink, TensorBoardSink, check_logdir
from diag.outputs.tb_views import TensorBoardViews, image_options
from hooks.capture.capture import ENTROPY_ROWS
from hooks.layout.discover import AttentionLayer, discover
from hooks.monitor.cadence import SIGNALS, CloserLook, resolve_cadence
from hooks.monitor.sampling import Sampler
from hooks.monitor.sharedlook import SharedCloserLook
from hooks.parallel.detectors import SharedDetectors
from hooks.parallel.ranks import rank, world_size

__all__ = ["Monitor", "SIGNALS"]

log = logging.getLogger("diag")


def write_report(logdir: Path, out: Path) -> Path:
    """The run report of ``logdir`` (``python -m diag report``), for a sink that logs it; imported when called."""
    from diag.reports.run import write_run_report

    return write_run_report(logdir, out)


class Monitor:
    """Watches every attention layer of ``model`` and writes the signals to sinks.

    Args:
        model: any ``nn.Module`` holding attention layers.
        logdir: TensorBoard run directory; ``metrics.jsonl`` and ``alerts.jsonl`` go
            there too. Checked writable now. None: only ``sinks``.
        every: sample every family at steps where ``step % every == 0``. Default None: the per-family
            cadence of :data:`hooks.monitor.cadence.DEFAULT_CADENCE` (loss and gradient norms every 10 steps,
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
        attn_rank_rows: the attention rank reads this many query rows, spread through the sequence.
        attn_entropy_rows: in sequences with more query rows, the attention entropy and sink share are read from
            this many rows spread through the sequence, and the max logit in float32 (1,024 by default: every row
            of shorter contexts; docs/metrics.md#attention-at-long-context). None: every row, in float64.
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
        closer_look: sample attention more often while the detectors ask for it: at every step while a head is
            near the malignant lines, with every loss sample while a layer is at risk
            (:class:`hooks.monitor.cadence.CloserLook`, docs/cost.md#watching-closer). Under DDP, FSDP2 or tensor
            parallelism rank 0's detectors decide and every rank samples the steps they ask for: one broadcast of
            two int64 from rank 0 after every step the detectors judged, none on other steps
            (docs/distributed.md#alerts-across-ranks).
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
        attn_entropy_rows: int | None = ENTROPY_ROWS,
        sinks: Iterable[Sink] = (),
        alerts: AlertConfig | None = None,
        on_alert: Callable[[Alert], None] | None = None,
        stop_on_critical: bool = False,
        purge_step: int | None = None,
        overwrite: bool = False,
        images: bool | None = None,
        image_every: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        closer_look: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Monitor(model=...) needs an nn.Module, got {type(model).__name__}")
        self.signals = frozenset(signals)
        self.cadence = resolve_cadence(every, cadence, self.signals)
        # Distributed (docs/distributed.md): only rank 0 has the logdir files and the alert callback;
        # every rank computes the metrics, and the detectors agree across ranks.
        main = rank() == 0
        self.images, self.image_every = image_options(images, image_every, full=self.cadence.full, every=every,
                                                      periods=self.cadence.periods, logdir=logdir is not None and main)
        self.model, self.every, self.sec_top, self.grad_scaler = model, self.cadence.base, sec_top, grad_scaler
        self.layers: list[AttentionLayer] = discover(model, spec, computation="attention" in self.signals)
        total_heads = sum(layer.layout.n_heads for layer in self.layers)
        self.per_head = per_head_default(total_heads) if per_head is None else per_head
        self._warn_once = WarnOnce(log, stacklevel=3)  # (kind, message): each kind of fault reported once
        self.sampler = Sampler(model, self.layers, self.signals, sec_top=sec_top, attn_seqs=attn_seqs,
                               attn_rank_rows=attn_rank_rows, attn_entropy_rows=attn_entropy_rows,
                               per_head=self.per_head, warn=self._warn_once,
                               grad_scaler=grad_scaler)
        self.capture, self.layouts = self.sampler.capture, self.sampler.layouts
        self._weights, self._loss_mean = self.sampler.weights, self.sampler.loss_mean
        self.logdir = None if logdir is None or not main else check_logdir(
            logdir, overwrite=overwrite, resume=purge_step is not None)
        files = [] if self.logdir is None else [TensorBoardSink(self.logdir, purge_step),
                                                JsonlSink(self.logdir / "metrics.jsonl")]
        self.sinks = FanOut([*sinks, *files])
        if self.logdir is not None:  # for a sink that logs the run report at close (MLflowSink)
            self.sinks.set_logdir(self.logdir, write_report)
        alert_path = None if self.logdir is None else self.logdir / "alerts.jsonl"
        self.alert_sink = AlertSink(self.sinks, alert_path, on_alert if main else None, stop_on_critical)
        detectors = Detectors(alerts or AlertConfig())
        self._updates_at_once = detectors.cfg.note_horizon  # updates of steps before this are measured on the next
        self.detectors: Detector = SharedDetectors(detectors, stop_on_critical) if world_size() > 1 else detectors
        look = bool(closer_look) and "attention" in self.signals
        # several ranks: rank 0's detectors decide the look, and every rank takes its decision (one broadcast)
        self.closer = CloserLook(self.cadence, look) if world_size() == 1 else SharedCloserLook(
            self.cadence, look, self._device())
        shared = isinstance(self.closer, SharedCloserLook) and self.closer.period is not None
        self._agree = self.closer.agree if shared else None
        self._views = TensorBoardViews(self.sinks, [layer.label for layer in self.layers], images=self.images,
                                       image_every=self.image_every, updates="updates" in self.signals,
                                       with_o=any(layer.o is not None for layer in self.layers))
        self.last: dict[str, float] = {}
        self._closed = False
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
            self._guard("keeping the loss", self._loss_mean.add, loss)
        weights = self._weights
        if weights.pending is not None:  # the step after an update sample: dW, elementwise, no host read
            self._guard("updates", weights.advance)
        due = self.cadence.due(step)
        if self.closer.until >= step:  # a closer look is on: it may add families, or a step of its own
            due = due | self.closer.adds(step)
        if weights.applied is not None and (due or weights.applied.step < self._updates_at_once):
            self._guard("updates", self._finish_updates)  # on a sampled step, or in the run's first steps
            self._agree_closer()
            if self.closer.until >= step:  # the ratios may have started a closer look
                due = due | self.closer.adds(step)
        if due:
            self._guard("sample", self._sample, step, loss, due)
            self._agree_closer()
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
        """Write what is pending, remove every hook, close the sinks. Idempotent.

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
        self._guard("tensorboard", self._views.close)  # the images still being drawn, written before the sinks close
        self.sinks.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(measure_pending=exc_type is None or world_size() == 1)

    def __del__(self) -> None:
        capture = self.__dict__.get("capture")  # None when __init__ raised before the capture was set up
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

    def load_state_dict(self, state: dict) -> None:
        self.detectors.load_state_dict(state["detectors"])

    def layout_document(self) -> dict:
        """The watched layers' layouts as a layout file's JSON object (module path, QKVLayout, tag label)."""
        return layout_document(self._layout_entries(), self._layout_source)

    def save_layout(self, path: str | os.PathLike) -> None:
        """Write :meth:`layout_document` to ``path`` (``attnscope_layout.json`` beside your checkpoints lets
        ``python -m diag analyze`` read them exactly with no options)."""
        write_layout_file(path, self._layout_entries(), self._layout_source)

    # --------------------------------------------------------------- a sampled step

    def _sample(self, step: int, loss: Tensor | float | None, due: frozenset[str]) -> None:
        """Measure, judge, write: the detectors' scalars (``collapse_risk``) go in the same record as the
        signals they read; the alerts go out after the record and the dashboards."""
        sample = self.sampler.measure(step, loss, due)
        alerts = self.detectors.observe(sample.observation)
        judged = self.detectors.scalars()  # {metric: {layer label: value}}
        sample.record.scalars.update({layer_tag(metric, label): float(v) for metric, values in judged.items()
                                      for label, v in values.items()})
        self.last = dict(sample.record.scalars)
        self.sinks.write(sample.record)
        self._look_closer(step)
        if sample.overflow:  # a routine fp16 event: the scaler skips this update
            alerts.append(overflow_alert(step))
        self._guard("tensorboard", self._views.on_sample, sample.record, sample.arrays, sample.maps, alerts,
                    due == frozenset(self.cadence.periods))
        self.alert_sink.emit(alerts)

    def _finish_updates(self) -> None:
        """The update ratios of the last update sample: written, judged (no collective: ``observe_updates``)."""
        record, arrays = self.sampler.updates()  # arrays[label][metric]: (1,)
        self.last.update(record.scalars)
        self.sinks.write(record)
        alerts = self.detectors.observe_updates(Observation(record.step, None, arrays))
        self._look_closer(record.step)  # large first updates ask for it
        self.alert_sink.emit(alerts)

    def _look_closer(self, step: int) -> None:
        """After the detectors judged ``step``: start or extend the closer look if they ask for it."""
        for started in self.closer.heed(step, self.detectors):
            log.info("diag: %s (closer_look)", started)

    def _agree_closer(self) -> None:
        """Several ranks, after each step the detectors judged (every rank gets here, whatever failed before): every
        rank takes rank 0's closer look, so that all sample the same steps. Nothing in one process."""
        if self._agree is not None:
            self._guard("closer look", self._agree)

    def _device(self) -> torch.device:
        """Where the Monitor's own collectives put a tensor of its own: the watched parameters' device, which the
        process group serves (the training's collectives move them)."""
        params = (p for layer in self.layers for p in layer.params().values())
        return next(params, torch.empty(0)).device

    def _guard(self, what: str, fn: Callable, *args: object) -> None:
        """A fault in the monitor is reported once per kind and never reaches training."""
        try:
            fn(*args)
        except TrainingHalted:
            raise
        except Exception as err:  # noqa: BLE001 - the training run must go on
            self._warn_once(what, f"diag: {what} failed at this step ({err!r}); training continues")

    def _layout_entries(self) -> list[LayoutEntry]:
        return [LayoutEntry(layer.name, layer.layout, layer.label) for layer in self.layers]

