"""The channels alerts go out on: the ``diag`` logger (one line per alert), every sink (TensorBoard
text and a count per kind), ``alerts.jsonl``, a user callback, and optionally a stop.

Detectors return :class:`~diag.detectors.base.Alert` objects and import no sink; the Monitor and
the checkpoint analysis hand them to :class:`AlertSink`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from diag.detectors.base import Alert, TrainingHalted
from diag.outputs.sinks import FanOut, Record, json_value

__all__ = ["AlertSink", "console_line", "shown_where"]

log = logging.getLogger("diag")
LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


def shown_where(a: Alert) -> str:
    """Where, once: a layer's record with the heads it counts (``L02 (H00, H01)``), the heads a record of several
    heads stands for, else ``where``."""
    if a.heads and "/" not in a.where:
        return f"{a.where} ({', '.join(h.split('/')[-1] for h in a.heads)})"
    return ", ".join(a.heads) if a.heads else a.where


def console_line(a: Alert) -> str:
    """``diag alert <kind> [resolved] at <where>, step <n>: <message> (docs/alerts.md#<kind>)``."""
    where = f" at {shown_where(a)}" if a.where else ""
    status = " resolved" if a.status == "resolved" else ""
    return f"diag alert {a.kind}{status}{where}, step {a.step}: {a.message} ({a.anchor})"


class AlertSink:
    """Sends alerts to the ``diag`` logger, every sink, ``alerts.jsonl`` and a user callback; with
    ``stop_on_critical`` raises :class:`TrainingHalted` after writing a step with a critical alert.

    ``path`` (``alerts.jsonl``) is created at construction, empty, or kept as it is where it exists (a resumed
    run appends to it): a reader tells "no alert" (an empty file) from "not written" (no file)."""

    def __init__(
        self,
        sinks: FanOut,
        path: Path | None,
        callback: Callable[[Alert], None] | None = None,
        stop_on_critical: bool = False,
    ) -> None:
        self.sinks, self.path, self.callback, self.stop = sinks, path, callback, stop_on_critical
        self.history: list[Alert] = []
        self._append_failed = False
        self._append(b"")

    def emit(self, alerts: list[Alert]) -> None:
        if not alerts:
            return
        self.history += alerts
        record = Record(alerts[0].step)
        for a in alerts:
            tag = f"alerts/{a.kind}"
            if a.status == "firing":  # the scalar counts episodes that start; resolved records are text only
                record.scalars[tag] = record.scalars.get(tag, 0.0) + 1.0
            where = f" {shown_where(a)}:" if a.where else ""
            status = " (resolved)" if a.status == "resolved" else ""
            record.texts[tag] = record.texts.get(tag, "") + f"**{a.level}**{status}{where} {a.message} " \
                                                            f"[{a.anchor}]\n\n"
            log.log(LEVELS[a.level], "%s", console_line(a))
        self.sinks.write(record)
        self.sinks.write_alerts(alerts)
        self._append_jsonl(alerts)
        self._call_back(alerts)
        critical = [a for a in alerts if a.level == "critical" and a.status == "firing"]
        if self.stop and critical:
            self.sinks.flush()
            raise TrainingHalted(critical[0])

    def _append_jsonl(self, alerts: list[Alert]) -> None:
        # One os.write on an O_APPEND descriptor, no user-space buffer (as diag.outputs.sinks.JsonlSink):
        # a process killed at any moment leaves whole lines only.
        self._append("".join(json.dumps(_plain({**asdict(a), "docs": a.anchor})) + "\n" for a in alerts).encode())

    def _append(self, data: bytes) -> None:
        """``data`` appended to ``path`` (created if missing; nothing: only created)."""
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
        except OSError as err:
            if not self._append_failed:  # reported once; the other channels go on
                self._append_failed = True
                log.error("diag: cannot append to %s (%s); alerts still go to the other channels", self.path, err)

    def _call_back(self, alerts: list[Alert]) -> None:
        if self.callback is None:
            return
        for a in alerts:
            try:
                self.callback(a)
            except Exception as err:  # noqa: BLE001 - a user callback must not kill training
                log.error("diag: on_alert callback raised %r for %s", err, a.kind)


def _plain(record: dict) -> dict:
    """A value the detector could not measure (NaN, e.g. a signal the cadence did not sample) is written as null,
    as metrics.jsonl writes it."""
    return {**record, "values": {k: json_value(v) if isinstance(v, float) else v for k, v in record["values"].items()}}
