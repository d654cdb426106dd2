"""The TensorBoard sink's events, read back with TensorBoard's own reader, against ``SummaryWriter``'s.

The sink writes one event per record and run. Each test writes the same records through it and through a
reference that calls ``SummaryWriter.add_scalar`` / ``add_histogram`` / ``add_text`` / ``add_image`` once per tag
(the official writer, one event per value), reads both folders with ``EventAccumulator`` and compares every run,
tag, step and value. The images the Monitor draws on its worker thread are all written, from the training thread,
by the time ``close()`` returns.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

from diag.catalog.tags import layer_runs
from diag.outputs.sinks import MemorySink, Record, TensorBoardSink
from hooks.monitor.monitor import Monitor
from tests.outputs.test_outputs import run_training
from tests.support import zoo

KEEP_ALL = {event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.TENSORS: 0,
            event_accumulator.IMAGES: 0}


def _records() -> list[Record]:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    heads = rng.random(4)
    return [
        Record(0, scalars={"loss": 2.5, "qk_sigma1/L00/H00": 1.25, "qk_sigma1/L00/H01": 3.0, "qk_sigma1/L00": 3.0,
                           "attn_entropy/L01": float("nan"), "grad_norm_q/L00/H00": 1e-30},
               histograms={"qk_spectrum/L00": rng.random(16), "attn_entropy/L00/heads": np.array([np.nan, 1.0, 2.0]),
                           "qk_sigma1/L01/heads": np.array([np.nan])},
               texts={"run/attention_sample": "| layer | rows |\n|---|---|\n| L00 | 4 |"},
               runs={"alerts/warning": {"alerts_raised": 1.0}, "alerts/info": {"alerts_raised": 0.0}}),
        Record(10, scalars={"loss": 2.0, "qk_sigma1/L00": 3.5, "qk_sigma1/L01": 0.5},
               histograms={"attn_entropy/L00/heads": heads}, images={"heatmap/qk_sigma1": image}),
        Record(20, texts={"alerts/loss_spike": "**warning** the loss"},
               runs={"alerts/warning": {"alerts_raised": 0.0}}),
    ]


def _reference(logdir: Path, records: list[Record]) -> None:
    """What SummaryWriter writes for the same records, one ``add_*`` call per value."""
    from torch.utils.tensorboard import SummaryWriter

    writers = {"": SummaryWriter(str(logdir))}

    def run(name: str) -> SummaryWriter:
        return writers.setdefault(name, SummaryWriter(str(logdir / name)))

    for r in records:
        main = writers[""]
        for tag, value in r.scalars.items():
            main.add_scalar(tag, value, r.step)
        for name, scalars in [*layer_runs(r.scalars).items(), *r.runs.items()]:
            for tag, value in scalars.items():
                run(name).add_scalar(tag, value, r.step)
        for tag, values in r.histograms.items():
            finite = values[np.isfinite(values)]
            if finite.size:
                main.add_histogram(tag, finite, r.step)
        for tag, text in r.texts.items():
            main.add_text(tag, text, r.step)
        for tag, image in r.images.items():
            main.add_image(tag, image, r.step, dataformats="HWC")
    for writer in writers.values():
        writer.close()


def _read(logdir: Path) -> dict[str, dict]:
    """run (relative folder) -> {"scalars" | "histograms" | "tensors" | "images": {tag: [(step, value), ...]}}"""
    out = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = event_accumulator.EventAccumulator(str(events.parent), size_guidance=KEEP_ALL)
        acc.Reload()
        tags = acc.Tags()
        out[str(events.parent.relative_to(logdir))] = {
            "scalars": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]},
            "histograms": {t: [(e.step, e.histogram_value) for e in acc.Histograms(t)] for t in tags["histograms"]},
            "tensors": {t: [(e.step, e.tensor_proto.SerializeToString()) for e in acc.Tensors(t)]
                        for t in tags["tensors"]},
            "images": {t: [(e.step, e.encoded_image_string, e.width, e.height) for e in acc.Images(t)]
                       for t in tags["images"]},
        }
    return out


def _same(a: list, b: list) -> bool:
    """Equal series, a NaN scalar equal to a NaN."""
    def key(v):
        return "nan" if isinstance(v, float) and np.isnan(v) else v

    return [tuple(key(v) for v in item) for item in a] == [tuple(key(v) for v in item) for item in b]


def test_events_hold_every_run_tag_step_and_value_that_summarywriter_writes(tmp_path):
    records = _records()
    sink = TensorBoardSink(tmp_path / "sink")
    for r in records:
        sink.write(r)
    sink.close()
    _reference(tmp_path / "reference", records)
    got, want = _read(tmp_path / "sink"), _read(tmp_path / "reference")
    assert sorted(got) == sorted(want) == [".", "L00", "L01", "alerts/info", "alerts/warning"]
    for run in want:
        for kind in want[run]:
            assert sorted(got[run][kind]) == sorted(want[run][kind]), (run, kind)
            for tag in want[run][kind]:
                assert _same(got[run][kind][tag], want[run][kind][tag]), (run, kind, tag)
    assert want["."]["images"]["heatmap/qk_sigma1"][0][0] == 10
    assert "run/attention_sample/text_summary" in want["."]["tensors"]
    assert want["."]["histograms"].keys() == {"qk_spectrum/L00", "attn_entropy/L00/heads"}  # no finite value: none


def _events_per_file(logdir: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return {str(f.parent.relative_to(logdir)): [e.step for e in EventFileLoader(str(f)).Load() if e.HasField("summary")]
            for f in logdir.rglob("events.out.tfevents.*")}


def test_one_event_per_record_and_run(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for r in _records():
        sink.write(r)
    sink.close()
    assert _events_per_file(tmp_path) == {".": [0, 10, 20], "L00": [0, 10], "L01": [0, 10], "alerts/warning": [0, 20],
                                          "alerts/info": [0]}


def test_purge_step_marks_a_restart_as_summarywriter_does(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    sink = TensorBoardSink(tmp_path, purge_step=7)
    sink.write(Record(7, scalars={"loss": 1.0}))
    sink.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    starts = [e.step for e in EventFileLoader(str(events)).Load() if e.session_log.status == SessionLog.START]
    assert starts == [7]


class _Threads(MemorySink):
    """A memory sink that notes the thread of every write with images."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def write(self, record: Record) -> None:
        if record.images:
            self.threads.add(threading.get_ident())
        super().write(record)


def test_images_drawn_on_the_worker_are_all_written_from_the_training_thread_by_close(tmp_path):
    case, sink = zoo.nanogpt(), _Threads()
    with Monitor(case.model, every=1, logdir=tmp_path, images=True, image_every=1, sinks=[sink]) as monitor:
        run_training(case, monitor, 4)
        drawn_before_close = {r.step for r in sink.records if r.images}
    drawn = {r.step: set(r.images) for r in sink.records if r.images}
    assert sorted(drawn) == [0, 1, 2, 3] and drawn_before_close <= {0, 1, 2}
    assert all({"heatmap/qk_sigma1", "heatmap/attn_entropy"} <= tags for tags in drawn.values()), drawn
    assert sink.threads == {threading.get_ident()}
    images = _read(tmp_path)["."]["images"]
    assert [step for step, *_ in images["heatmap/qk_sigma1"]] == [0, 1, 2, 3]
