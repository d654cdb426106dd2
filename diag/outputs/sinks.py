"""Outputs behind one small protocol: TensorBoard, JSONL, and a fault-isolating fan-out.

A :class:`Record` holds everything measured at one step. Sinks write records;
:class:`FanOut` calls every sink, and a sink that raises is reported once (a
warning and the ``diag`` logger) while the others go on. Nothing here raises into
the training loop after construction.

A sink may also have ``write_layout(layout)``: the custom-scalars layout of the run
(``{category: {chart: ["Multiline", [tag regex, ...]]}}``, see :mod:`diag.outputs.tb_layout`),
and ``write_view(record)``: what only a dashboard shows (the alert events, the constants as
text, see :mod:`diag.outputs.tb_views`), and ``write_alerts(alerts)``: the
:class:`~diag.detectors.base.Alert` objects of one step, for a backend with alerts of its own
(W&B's ``run.alert``, MLflow's run tags), and ``set_logdir(path, write_report)``: the Monitor's logdir and
the function that writes the run report of its files (``write_report(logdir, out) -> out``), for a sink that logs
the report at close (the MLflow sink); :class:`FanOut` passes
them only to the sinks that have them.

Chosen libraries: ``torch.utils.tensorboard``'s ``FileWriter`` and summary builders (what its
``SummaryWriter`` writes with, from the ``tensorboard`` package) for event files, one event per record
and run; the standard library's ``json`` for JSONL, one whole step per ``write`` call with no user-space
buffer, so a killed process never leaves a torn line behind.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from diag.catalog.tags import layer_runs
from diag.errors import SinkError, WarnOnce

__all__ = ["Record", "Sink", "TensorBoardSink", "JsonlSink", "MemorySink", "FanOut", "check_logdir", "earlier_run",
           "RUN_FILES"]

log = logging.getLogger("diag")


@dataclass
class Record:
    """What one step produced. Scalars may be NaN; histograms are 1-D arrays; images are
    (height, width, 3) uint8 RGB arrays (see :mod:`diag.outputs.figures`)."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, np.ndarray] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    images: dict[str, np.ndarray] = field(default_factory=dict)
    # TensorBoard only: scalars of other runs (sub-folders of the logdir), {run: {tag: value}}
    runs: dict[str, dict[str, float]] = field(default_factory=dict)


@runtime_checkable
class Sink(Protocol):
    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


# What a run writes into its folder: an earlier run is found by these (TensorBoard runs of their own:
# the layers L00/, L01/, ..., the alert levels alerts/critical/, ...).
RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "events.out.tfevents.*", "L*/events.out.tfevents.*",
             "alerts/*/events.out.tfevents.*")


def earlier_run(logdir: str | os.PathLike) -> list[Path]:
    """The files of an earlier run in ``logdir`` (empty when there is none)."""
    path = Path(logdir)
    return sorted(f for pattern in RUN_FILES for f in path.glob(pattern) if f.is_file())


def check_logdir(logdir: str | os.PathLike, *, overwrite: bool = False, resume: bool = False,
                 how: str = "overwrite=True to replace it, or purge_step=<the step you resume from> to continue it",
                 ) -> Path:
    """Create ``logdir`` and prove it writable now, not in the middle of training.

    One policy for every output folder (the Monitor's ``logdir``, ``analyze --out``,
    ``demo --logdir``): a folder that already holds a run is refused, unless ``overwrite``
    (its run files are deleted first) or ``resume`` (the run goes on in it: the Monitor's
    ``purge_step``). ``how``: the caller's ways out, for the message.
    """
    path = Path(logdir)
    earlier = earlier_run(path)
    if earlier and not resume and not overwrite:
        raise SinkError(
            f"{path} already holds a run ({earlier[0].relative_to(path)}); pass another folder, or {how}"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        if overwrite and not resume:
            for old in earlier:
                old.unlink()
        probe = path / ".diag-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise SinkError(
            f"logdir {str(path)!r} is not writable ({err.strerror or err}); "
            "pass a directory you can write to, e.g. logdir='runs/exp1'"
        ) from err
    return path


class TensorBoardSink:
    """Event files through TensorBoard's own writer (``torch.utils.tensorboard``'s ``FileWriter`` and summary
    builders, as ``SummaryWriter`` uses them): one event per record and run, holding every value of the record
    (scalars, histograms, texts, images) under the tags ``add_scalar``, ``add_histogram``, ``add_text`` and
    ``add_image`` would give them. The writer's own thread serialises and writes the events; no flush per write.

    Besides the run in ``logdir`` (every tag), one run per layer in ``logdir/L03`` with the
    charted statistics under one name for all layers (:func:`diag.catalog.tags.layer_runs`), so
    TensorBoard draws the layers of a chart in distinct colours and names them; and the runs a
    record names in ``Record.runs`` (the alert events).
    """

    def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None) -> None:
        self.logdir, self.purge_step = Path(logdir), purge_step
        self.writer = self._open(self.logdir)
        self.runs: dict[str, object] = {}  # sub-run name -> its FileWriter

    def _open(self, path: Path):
        """A ``FileWriter`` on ``path``; with ``purge_step``, the restart events ``SummaryWriter(purge_step=...)``
        writes, after which TensorBoard drops the events of steps from ``purge_step`` on written before them."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from torch.utils.tensorboard.writer import FileWriter

        writer = FileWriter(str(path))
        if self.purge_step is not None:
            writer.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
            writer.add_event(Event(step=self.purge_step, session_log=SessionLog(status=SessionLog.START)))
        return writer

    def _run(self, name: str):
        if name not in self.runs:
            self.runs[name] = self._open(self.logdir / name)
        return self.runs[name]

    def write(self, record: Record) -> None:
        values = summary_values(record)
        if values:
            self.writer.add_summary(_summary(values), record.step)
        for run, scalars in [*layer_runs(record.scalars).items(), *record.runs.items()]:
            if scalars:
                self._run(run).add_summary(_summary(scalar_values(scalars)), record.step)

    def write_layout(self, layout: dict) -> None:
        """The custom-scalars layout; TensorBoard shows the newest one of the run."""
        from torch.utils.tensorboard.summary import custom_scalars

        self.writer.add_summary(custom_scalars(layout))

    def write_view(self, record: Record) -> None:
        self.write(record)

    def flush(self) -> None:
        for writer in [self.writer, *self.runs.values()]:
            writer.flush()

    def close(self) -> None:
        for writer in [self.writer, *self.runs.values()]:
            writer.close()


def _summary(values: list):
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=values)


def scalar_values(scalars: dict[str, float]) -> list:
    """``Summary.Value`` protos of scalars, as ``SummaryWriter.add_scalar`` writes each (a float32 simple value)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]


@functools.cache
def default_bins() -> np.ndarray:
    """The bin edges of ``SummaryWriter.add_histogram(bins="tensorflow")`` (its ``default_bins``: +-1e-12 to 1e20 in
    steps of 10%, and 0), as one array built once: the same histogram as that list gives, without converting it at
    every call."""
    edges, v = [], 1e-12
    while v < 1e20:
        edges.append(v)
        v *= 1.1
    return np.array([-e for e in reversed(edges)] + [0.0] + edges)


def summary_values(record: Record) -> list:
    """Every value of ``record`` for its run's event: its scalars, the histograms of the finite values of its
    histograms, its texts and its images, each as the matching ``SummaryWriter.add_*`` would tag and encode it."""
    from torch.utils.tensorboard.summary import histogram, image, text

    values = scalar_values(record.scalars)
    for tag, array in record.histograms.items():
        finite = array[np.isfinite(array)]
        if finite.size:
            values.extend(histogram(tag, finite, default_bins()).value)
    for tag, message in record.texts.items():
        values.extend(text(tag, message).value)
    for tag, picture in record.images.items():
        values.extend(image(tag, picture, dataformats="HWC").value)
    return values


def json_value(value: float) -> float | None:
    """A measured value as JSON: null if not finite (strict JSON readers reject a bare NaN or Infinity)."""
    return value if math.isfinite(value) else None


def jsonl_line(step: str, tag: str, value: float) -> str:
    """``json.dumps({"step": step, "tag": tag, "value": json_value(float(value))})`` to the byte (``step`` already
    JSON), formatted directly: the tag is escaped by json's own ASCII encoder, a finite value written as json writes a
    float (its ``repr``), a non-finite one as null."""
    v = float(value)
    number = float.__repr__(v) if math.isfinite(v) else "null"
    return f'{{"step": {step}, "tag": {_json_string(tag)}, "value": {number}}}'


_json_string = json.encoder.encode_basestring_ascii  # what json.dumps uses with its default ensure_ascii=True


class JsonlSink:
    """``metrics.jsonl``: one ``{"step", "tag", "value"}`` object per scalar (null if not finite).

    Each step goes out as one ``os.write`` on a file opened with ``O_APPEND``, with
    no user-space buffer in between, so a killed process leaves whole lines only.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Record) -> None:
        step = json.dumps(record.step)
        lines = [jsonl_line(step, tag, value) for tag, value in record.scalars.items()]
        if lines and self._fd is not None:
            if os.fstat(self._fd).st_nlink == 0:  # deleted (e.g. the logdir removed mid-run): say so
                raise SinkError(f"{self.path} was deleted while the run was writing it; later steps are "
                                "not in any metrics.jsonl (the other sinks go on)")
            data = ("\n".join(lines) + "\n").encode("utf-8")
            while data:
                data = data[os.write(self._fd, data) :]

    def flush(self) -> None:
        pass  # nothing is buffered

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemorySink:
    """Keeps every record in a list: for tests, notebooks and the detectors' replay."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.layouts: list[dict] = []
        self.views: list[Record] = []
        self.alerts: list = []  # the Alert objects, as write_alerts received them

    def write(self, record: Record) -> None:
        self.records.append(record)

    def write_layout(self, layout: dict) -> None:
        self.layouts.append(layout)

    def write_view(self, record: Record) -> None:
        self.views.append(record)

    def write_alerts(self, alerts: list) -> None:
        self.alerts.extend(alerts)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        return [(r.step, r.scalars[tag]) for r in self.records if tag in r.scalars]


class FanOut:
    """Calls every sink; a failing sink is reported once and the others go on."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = list(sinks)
        self._report = WarnOnce(log, logging.ERROR, stacklevel=3)  # once per sink

    def add(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def _call(self, method: str, *args: object, optional: bool = False) -> None:
        for sink in self.sinks:
            if optional and not hasattr(sink, method):
                continue
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # a sink must never kill training
                self._report(id(sink), f"diag: sink {type(sink).__name__}.{method} failed ({err!r}); "
                             "other sinks go on")

    def write(self, record: Record) -> None:
        self._call("write", record)

    def write_layout(self, layout: dict) -> None:
        self._call("write_layout", layout, optional=True)  # only sinks that have it

    def write_view(self, record: Record) -> None:
        self._call("write_view", record, optional=True)  # only sinks that have it

    def write_alerts(self, alerts: list) -> None:
        self._call("write_alerts", alerts, optional=True)  # only sinks that have it

    def set_logdir(self, logdir: Path, write_report) -> None:
        self._call("set_logdir", logdir, write_report, optional=True)  # only sinks that have it

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")
