"""MLflow as a sink: the scalars as run metrics, the alerts as run tags and an artifact, the run report at the end.

    import mlflow
    from diag.outputs.mlflow_sink import MLflowSink

    with mlflow.start_run():
        monitor = Monitor(model, logdir="runs/exp1", sinks=[MLflowSink()])

What goes where (docs/integrations.md#mlflow):

* every scalar of a :class:`~diag.outputs.sinks.Record` is a metric of the run, at the record's step, under its
  TensorBoard tag (``qk_sigma1/L03/H07``, ``alerts/malignant_collapse``; :func:`mlflow_key` maps the characters
  MLflow refuses, reversibly), after ``prefix``: none in a run the sink created (the run is the Monitor's, as a
  TensorBoard logdir is), ``attnscope/`` in a run it did not (the user's, a trainer's), where ``loss`` or
  ``grad_norm`` of the run's own would otherwise share a name with the Monitor's and mix two series. A value
  that is not finite is sent as NaN, which MLflow keeps (an infinity it would store as the largest double):
  where ``metrics.jsonl`` holds null, the run holds NaN, and nowhere else.
  Histograms, texts and images stay in TensorBoard; the run report (below) draws its figures from the scalars.
* each kind of alert is a run tag ``attnscope.alert.<kind>``: the status, level, place and step of its latest
  record, as one line; the whole list of alerts is the artifact ``attnscope/alerts.json`` (the records of
  ``alerts.jsonl``, as one JSON list).
* at :meth:`close`, when the Monitor has a logdir and ``report=True``: the run report of ``python -m diag report``
  as the artifact ``attnscope/report.html``.

The run: ``run_id`` if given, else the active run of the thread that writes the first record
(``mlflow.active_run()``: the user's ``with mlflow.start_run()``, the Hugging Face Trainer's MLflowCallback), else
a run the sink creates (``experiment``, ``run_name``) and ends at :meth:`close`. A run the sink did not create
is never ended by it, and the sink never starts a second run.

Cost: :meth:`write` copies the scalars into a buffer (the training thread pays that only); a background thread
turns them into ``mlflow.entities.Metric`` objects and sends them with ``MlflowClient.log_batch`` in chunks of
MLflow's per-call limits (``MAX_METRICS_PER_BATCH``, ``MAX_PARAMS_TAGS_PER_BATCH``), every ``flush_every``
seconds, when a chunk is full, and at :meth:`flush` and :meth:`close` (docs/cost.md#mlflow).

Faults: nothing here raises into training. A failed send is reported once (the ``diag`` logger, a warning) and
its metrics stay buffered for the next send (at most ``max_pending`` values; beyond that the oldest are dropped
and counted). :meth:`close` waits at most ``close_timeout`` seconds for the last send and logs, as an error, how
many values never reached the server (they are all in ``metrics.jsonl`` when the Monitor has a logdir).

``mlflow`` is imported in the constructor only: importing ``diag`` or ``hooks`` never imports it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from diag.detectors.base import Alert
from diag.outputs.sinks import Record, json_value

__all__ = ["MLflowSink", "mlflow_key", "tag_of_key", "ALERT_TAG_PREFIX", "ARTIFACT_DIR", "SHARED_RUN_PREFIX"]

log = logging.getLogger("diag")

ALERT_TAG_PREFIX = "attnscope.alert."  # + the alert's kind: the run tag of that kind's latest record
SHARED_RUN_PREFIX = "attnscope/"  # before the metric names in a run the sink did not create
ARTIFACT_DIR = "attnscope"  # alerts.json and report.html, inside the run's artifacts

# MLflow's metric and tag names: letters, digits, '_', '-', '.', ' ', '/' (and ':' except on Windows). Every other
# character c, and the escape character '-' itself, is written as '-' + two hex digits of ord(c) ('-uXXXX' beyond
# 0xff): "L03/H00+H03" -> "L03/H00-2bH03". The tags of diag have no '-', so every tag made of allowed characters
# keeps its name; tag_of_key reads a key back.
_KEEP = re.compile(r"[A-Za-z0-9_./ ]")
_ESCAPE = re.compile(r"-(u[0-9a-f]{4}|[0-9a-f]{2})")


def mlflow_key(tag: str) -> str:
    """The MLflow name of a diag tag (reversible: :func:`tag_of_key`)."""
    if all(_KEEP.match(c) for c in tag):
        return tag
    return "".join(c if _KEEP.match(c) else (f"-{ord(c):02x}" if ord(c) <= 0xFF else f"-u{ord(c):04x}")
                   for c in tag)


def tag_of_key(key: str) -> str:
    """The diag tag an MLflow name stands for (the inverse of :func:`mlflow_key`)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1).lstrip("u"), 16)), key)


def alert_tag_value(a: Alert, limit: int) -> str:
    """One line: ``firing critical at L03/H05, step 120 (since 110): <message>``, cut to ``limit`` characters."""
    where = f" at {a.where}" if a.where else ""
    since = f" (since {a.since})" if a.since is not None else ""
    text = f"{a.status} {a.level}{where}, step {a.step}{since}: {a.message}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def alert_json(a: Alert) -> dict:
    """An alert as ``alerts.jsonl`` writes it (non-finite values as null, the docs anchor added)."""
    record = {**asdict(a), "docs": a.anchor}
    record["values"] = {k: json_value(v) if isinstance(v, float) else v for k, v in record["values"].items()}
    return record


class MLflowSink:
    """Writes the Monitor's scalars and alerts into an MLflow run (see the module's documentation).

    Args:
        run_id: the run to write into; default: the active run at the first write, else a run of the sink's own.
        tracking_uri: default ``mlflow.get_tracking_uri()`` (``MLFLOW_TRACKING_URI``).
        experiment: the experiment of a run the sink creates (a name; created if missing); default MLflow's
            (``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``, else the default experiment).
        run_name: the name of a run the sink creates.
        prefix: put before every metric name; default: none in a run the sink creates, ``"attnscope/"`` in a run
            it did not create.
        report: log the run report (``attnscope/report.html``) at close when the Monitor has a logdir.
        flush_every: seconds between the background sends.
        close_timeout: seconds :meth:`close` waits for the last send.
        max_pending: the most scalar values kept while the server cannot be reached.
    """

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None, experiment: str | None = None,
                 run_name: str | None = None, prefix: str | None = None, report: bool = True, flush_every: float = 5.0,
                 close_timeout: float = 60.0, max_pending: int = 5_000_000) -> None:
        import mlflow
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self._mlflow, self._Metric, self._RunTag = mlflow, Metric, RunTag
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id, self.experiment, self.run_name, self.report = run_id, experiment, run_name, report
        self.flush_every, self.close_timeout, self.max_pending = flush_every, close_timeout, max_pending
        self.prefix = prefix
        self.owns_run = False  # True once the sink created the run: only then does close() end it
        self.logdir: Path | None = None
        self._write_report: Callable[[Path, Path], Path] | None = None
        # MLflow's per-call limits: metrics and tags per log_batch call, the length of a tag value
        self._max_metrics = min(getattr(validation, "MAX_METRICS_PER_BATCH", 1000),
                                getattr(validation, "MAX_ENTITIES_PER_BATCH", 1000))
        self._max_tags = min(getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100),
                             getattr(validation, "MAX_ENTITIES_PER_BATCH", 1000))
        self._max_tag_value = getattr(validation, "MAX_TAG_VAL_LENGTH", 5000)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._records: deque[tuple[int, int, dict[str, float]]] = deque()  # (step, ms, scalars), not yet converted
        self._metrics: list = []  # converted, not yet sent (a failed send keeps them here)
        self._pending = 0  # scalar values in _records and _metrics
        self._dropped = 0  # values dropped beyond max_pending
        self._alerts: list[dict] = []
        self._alert_tags: dict[str, str] = {}  # tag -> value, not yet sent
        self._alerts_changed = False
        self._sent = 0  # values the server accepted
        self._failed: set[str] = set()  # what failed, reported once each
        self._keys: dict[str, str] = {}
        self._attached = False
        self._closing = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the training thread

    def set_logdir(self, logdir: str | os.PathLike | None,
                   write_report: Callable[[Path, Path], Path] | None = None) -> None:
        """The Monitor's logdir, and what writes the run report of its metrics.jsonl and alerts.jsonl to a file
        (``diag.reports.run.write_run_report``, handed over by the Monitor: the outputs import no report code)."""
        self.logdir = None if logdir is None else Path(logdir)
        self._write_report = write_report

    def write(self, record: Record) -> None:
        if self._closing:
            return
        self._attach()
        if not record.scalars:
            return
        with self._lock:
            self._records.append((record.step, int(time.time() * 1000), dict(record.scalars)))
            self._pending += len(record.scalars)
            over = self._pending - self.max_pending
            full = self._pending >= self._max_metrics
        if over > 0:
            self._drop(over)
        if full:
            self._wake.set()

    def write_alerts(self, alerts: list[Alert]) -> None:
        if self._closing or not alerts:
            return
        self._attach()
        with self._lock:
            for a in alerts:
                self._alerts.append(alert_json(a))
                self._alert_tags[mlflow_key(ALERT_TAG_PREFIX + a.kind)] = alert_tag_value(a, self._max_tag_value)
            self._alerts_changed = True
        self._wake.set()  # alerts go out at once

    def flush(self) -> None:
        """Send what is buffered now (in the background: the caller does not wait)."""
        self._wake.set()

    def close(self) -> None:
        """Send everything, log the alerts and the report, end the run if the sink created it. Waits at most
        ``close_timeout`` seconds; reports what could not be sent. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._thread is None:  # nothing was ever written: no run is created for nothing
            return
        self._wake.set()
        self._thread.join(self.close_timeout)
        if self._thread.is_alive():
            log.error("diag: MLflowSink: the last send to %s did not finish within %.0f s; %d scalar values were "
                      "not sent%s", self.tracking_uri, self.close_timeout, self._pending, self._where_kept())

    @property
    def unsent(self) -> int:
        """Scalar values written but not (yet) accepted by the server."""
        return self._pending

    def _attach(self) -> None:
        """At the first write, on the training thread: the run (given, else the thread's active run, else the sink
        creates one in the background) and the sender thread."""
        if self._attached:
            return
        self._attached = True
        if self.run_id is None:
            try:
                active = self._mlflow.active_run()
            except Exception:  # noqa: BLE001 - no active run to be found: the sink creates its own
                active = None
            if active is not None:
                self.run_id = active.info.run_id
                if self.tracking_uri != self._mlflow.get_tracking_uri():
                    log.warning("diag: MLflowSink writes into the active run %s at %s (tracking_uri=%s was given)",
                                self.run_id, self._mlflow.get_tracking_uri(), self.tracking_uri)
                    self.tracking_uri = self._mlflow.get_tracking_uri()
                    self.client = type(self.client)(tracking_uri=self.tracking_uri)
        if self.prefix is None:
            self.prefix = "" if self.run_id is None else SHARED_RUN_PREFIX
        self._thread = threading.Thread(target=self._run, name="attnscope-mlflow", daemon=True)
        self._thread.start()

    def key(self, tag: str) -> str:
        """The MLflow metric name of a diag tag in this sink's run (``prefix`` is settled at the first write)."""
        key = self._keys.get(tag)
        if key is None:
            key = self._keys[tag] = mlflow_key((self.prefix or "") + tag)
        return key

    def _drop(self, n: int, *, sender: bool = False) -> None:
        """Drop the ``n`` oldest buffered values (the server is out of reach and the buffer full). The training
        thread drops records not yet converted; only the sender thread touches the converted ones."""
        with self._lock:
            dropped = 0
            if sender:
                dropped = min(n, len(self._metrics))
                del self._metrics[:dropped]
            while dropped < n and self._records:
                dropped += len(self._records.popleft()[2])
            self._pending -= dropped
            self._dropped += dropped
        if dropped:
            self._report("dropped", f"diag: MLflowSink: {self.tracking_uri} cannot keep up or cannot be reached; "
                         f"more than {self.max_pending} values waited, the oldest are dropped (counted at close)"
                         + self._where_kept())

    def _where_kept(self) -> str:
        return f"; every value is in {self.logdir / 'metrics.jsonl'}" if self.logdir is not None else ""

    def _report(self, what: str, message: str, level: int = logging.WARNING) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.log(level, "%s", message)

    # ---------------------------------------------------------------- the sender thread

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_every)
            self._wake.clear()
            closing = self._closing
            self._send()
            if closing:
                self._finish()
                return

    def _ensure_run(self) -> bool:
        if self.run_id is not None:
            return True
        try:
            experiment_id = self._experiment_id()
            run = self.client.create_run(experiment_id, run_name=self.run_name)
        except Exception as err:  # noqa: BLE001 - the server may be down: tried again at the next send
            self._report("create_run", f"diag: MLflowSink cannot create a run at {self.tracking_uri} ({err!r}); "
                         "the values wait in memory and are sent when it can" + self._where_kept())
            return False
        self.run_id, self.owns_run = run.info.run_id, True
        return True

    def _experiment_id(self) -> str:
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME

        name = self.experiment or MLFLOW_EXPERIMENT_NAME.get()
        if name:
            found = self.client.get_experiment_by_name(name)
            return found.experiment_id if found is not None else self.client.create_experiment(name)
        return MLFLOW_EXPERIMENT_ID.get() or "0"

    def _send(self) -> None:
        """Convert the buffered records, send them in chunks; then the alert tags and alerts.json."""
        if not self._ensure_run():
            return
        with self._lock:
            records, self._records = self._records, deque()
        Metric, key = self._Metric, self.key
        nan, finite = math.nan, math.isfinite
        converted = [Metric(key(tag), value if finite(value := float(v)) else nan, ms, step)
                     for step, ms, scalars in records for tag, v in scalars.items()]
        with self._lock:
            self._metrics.extend(converted)
        while self._metrics:
            chunk = self._metrics[: self._max_metrics]
            try:
                self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as err:  # noqa: BLE001 - kept for the next send
                self._report("log_batch", f"diag: MLflowSink cannot send metrics to run {self.run_id} at "
                             f"{self.tracking_uri} ({err!r}); they wait in memory and are sent when it can"
                             + self._where_kept())
                if self._pending > self.max_pending:
                    self._drop(self._pending - self.max_pending, sender=True)
                break
            with self._lock:
                del self._metrics[: len(chunk)]
                self._pending -= len(chunk)
                self._sent += len(chunk)
        self._send_alerts()

    def _send_alerts(self) -> None:
        with self._lock:
            tags, self._alert_tags = self._alert_tags, {}
            alerts = list(self._alerts) if self._alerts_changed else None
            self._alerts_changed = False
        items = [self._RunTag(k, v) for k, v in tags.items()]
        try:
            for i in range(0, len(items), self._max_tags):
                self.client.log_batch(self.run_id, tags=items[i: i + self._max_tags], synchronous=True)
            if alerts is not None:
                self.client.log_text(self.run_id, json.dumps(alerts, indent=1), f"{ARTIFACT_DIR}/alerts.json")
        except Exception as err:  # noqa: BLE001 - tried again at the next send
            self._report("alerts", f"diag: MLflowSink cannot send the alerts to run {self.run_id} ({err!r}); "
                         "tried again at the next send")
            with self._lock:
                self._alert_tags = {**tags, **self._alert_tags}
                self._alerts_changed = self._alerts_changed or alerts is not None

    def _finish(self) -> None:
        """At close: the report, the run's end (if the sink created it), what was lost."""
        if self.run_id is not None and self.report and self._write_report is not None and self.logdir is not None \
                and (self.logdir / "metrics.jsonl").is_file():
            try:
                with tempfile.TemporaryDirectory(prefix="attnscope-report-") as tmp:
                    path = self._write_report(self.logdir, Path(tmp) / "report.html")
                    self.client.log_artifact(self.run_id, str(path), ARTIFACT_DIR)
            except Exception as err:  # noqa: BLE001 - the metrics are there; only the page is missing
                self._report("report", f"diag: MLflowSink: the run report was not logged ({err!r}); "
                             f"python -m diag report {self.logdir} writes it")
        if self.owns_run:
            try:
                self.client.set_terminated(self.run_id, "FINISHED")
            except Exception as err:  # noqa: BLE001
                self._report("end", f"diag: MLflowSink cannot end its run {self.run_id} ({err!r})")
        lost = self._pending + self._dropped
        if lost:
            log.error("diag: MLflowSink: %d of %d scalar values did not reach %s%s", lost, lost + self._sent,
                      self.tracking_uri, self._where_kept())
