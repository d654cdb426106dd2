"""The Monitor of a recorded run: its detectors wrapped by a :class:`evaluation.record.Recorder`, closed in order.

Every training task of the evaluation (:mod:`evaluation.lm`, :mod:`evaluation.eureka`, :mod:`evaluation.healthy`)
trains inside :func:`recording`, so that ``observations.jsonl`` holds every observation the detectors were given,
the update ratios the Monitor measures at ``close`` included, and is closed when the run ends. A run of the demo's
GPT recorded at every step also keeps its full attention maps' measurements (``attention.npz``,
:mod:`evaluation.maps`): the ground truth of the attention states.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from evaluation.maps import MapRecorder
from evaluation.record import Recorder
from hooks import Monitor

__all__ = ["recording"]


@contextmanager
def recording(monitor: Monitor, observations: Path | None, maps: Path | None = None) -> Iterator[Monitor]:
    """Record what ``monitor``'s detectors are given into ``observations`` (None: nothing recorded) and, with
    ``maps``, the measurements of its model's attention maps at every training forward while the block runs; then
    close the Monitor (which writes its pending sample) and after it the recorders."""
    recorder = None
    if observations is not None:
        recorder = monitor.detectors = Recorder(monitor.detectors, observations)
    mapper = MapRecorder(monitor.model, maps) if maps is not None else None
    try:
        yield monitor
    finally:
        monitor.close()
        if recorder is not None:
            recorder.close()
        if mapper is not None:
            mapper.close()
