"""Weights & Biases as an output: the Monitor's scalars, images, histograms, charts and alerts in a W&B run.

    from diag.outputs.wandb_sink import WandbSink

    run = wandb.init(project="my-project")
    monitor = Monitor(model, logdir="runs/exp1", sinks=[WandbSink()])   # writes into the active run

``wandb`` is imported only when a :class:`WandbSink` is built: importing ``diag`` or ``hooks`` never imports it.

What goes where (docs/integrations.md#weights-biases):

* **Keys.** Every scalar of a record under its TensorBoard tag, the names of ``metrics.jsonl``
  (``qk_sigma1/L00/max``, ``alerts/malignant_collapse``); a tag without ``/`` (``loss``) goes under
  ``attnscope/`` (``attnscope/loss``), so that it never mixes with the user's own ``loss``
  (:func:`wandb_key`). A value that is not finite is logged as it is (NaN, inf), where ``metrics.jsonl``
  writes null.
* **Step axis.** Each row carries the Monitor's step as ``attnscope/step``, and every key prefix the sink
  writes is declared with ``run.define_metric("<prefix>/*", step_metric="attnscope/step")``, so W&B draws
  the Monitor's charts against the training step, not against W&B's own ``_step``.
* **Rows.** In a run the sink did not start and that the user logs into with W&B's implicit step
  (``commit=False``, the default for such a run), the sink never advances ``_step``: a Monitor step goes
  into the row the user has open (``run.log(..., commit=False)``), and the user's ``wandb.log`` calls land at
  exactly the steps they would without the Monitor. A row holds one Monitor step: a second one waits, in
  order, for the user's next row (a sampled step's values usually go into the row after the one of the
  step before). What waits when the sink closes goes out in rows of its own. In a run the sink started,
  or with ``commit=True`` (the Hugging Face and Lightning integrations: their loggers commit every row and
  chart against their own step metric), every Monitor step is a row of its own.
* **Images** (heatmaps, update ratios, attention maps) as ``wandb.Image``; **histograms** as
  ``wandb.Histogram`` of the finite values. Texts and TensorBoard's per-run scalars are not written.
* **Charts.** Offline W&B cannot create workspace panels; at close the sink logs, for every chart of the
  custom-scalars layout (:mod:`diag.outputs.tb_layout`: one chart per metric, a line per layer), a
  ``wandb.plot.line_series`` under ``attnscope_charts/<family>/<tag>``: a custom chart panel titled as in
  TensorBoard, the Monitor's step on x, one named line per layer (per alert level for the alerts chart). They go
  into the row open at close (in the user's run: the user's last row, or the sink's last row when Monitor steps
  were still waiting; in a run the sink started: a row of its own); each chart's table is a file of the run
  (``files/media/table/attnscope_charts/...``) and a ``run_table`` artifact.
* **Alerts.** ``run.alert`` for each alert (a firing one at its level, INFO/WARN/ERROR; a resolved one at
  INFO), titled ``attnscope <kind> at <where>``, with the message, the step and the docs section. Every
  alert record is also a row of the table ``attnscope/alerts`` (step, kind, level, where, status, since,
  message, docs), logged at close into the row of the charts, and the summary keeps
  ``attnscope/alerts_fired`` (the number of alerts that fired) and ``attnscope/last_alert`` (the newest record,
  as its console line).
* **Ranks.** Built in a process whose ``torch.distributed`` is initialised with a rank other than 0, the
  sink does nothing (no run, no writes): the Monitor's integrations pass sinks to the main rank only, and a
  sink built by the user on every rank writes from rank 0 alone.
* **Reading back.** ``run.finish()`` returns before W&B's service has written the end of the run's ``.wandb``
  file (its last rows, the summary, the exit record); :func:`diag.outputs.wandb_read.read_offline_run` waits for
  it (a reader that does not wait misses the last row).
* **Faults.** Every method catches what W&B raises and reports it once on the ``diag`` logger: a sink
  never stops training. ``close`` finishes only a run the sink started itself.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import Any

import numpy as np

from diag.catalog.tags import layer_runs
from diag.detectors.base import Alert
from diag.errors import SinkError, WarnOnce
from diag.outputs.alert_sink import console_line, shown_where
from diag.outputs.sinks import Record

__all__ = ["WandbSink", "wandb_key", "STEP_METRIC", "ALERT_TABLE", "ALERT_COLUMNS", "CHART_PREFIX"]

log = logging.getLogger("diag")

STEP_METRIC = "attnscope/step"
ROOT = "attnscope"  # where the tags without a "/" go, and the table and summary entries
ALERT_TABLE = "attnscope/alerts"
ALERT_COLUMNS = ["step", "kind", "level", "where", "status", "since", "message", "docs"]
CHART_PREFIX = "attnscope_charts"
MAX_WAITING = 1000  # Monitor steps waiting for the user's rows before the sink commits rows of its own


def wandb_key(tag: str) -> str:
    """The W&B key of a TensorBoard tag: the tag itself, or ``attnscope/<tag>`` for a tag without ``/``."""
    return tag if "/" in tag else f"{ROOT}/{tag}"


def _main_rank() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:  # noqa: BLE001 - no torch.distributed: one process
        return True


def _alert_level(wandb: Any, alert: Alert) -> Any:
    if alert.status != "firing":
        return wandb.AlertLevel.INFO
    return {"critical": wandb.AlertLevel.ERROR, "warning": wandb.AlertLevel.WARN}.get(alert.level,
                                                                                      wandb.AlertLevel.INFO)


class WandbSink:
    """Writes the Monitor's records into a W&B run (module docstring: what goes where).

    Args:
        run: the run to write into. None: the active run (``wandb.run``) if there is one, else a run the sink
            starts with ``wandb.init(project=..., name=..., dir=..., **init_kwargs)`` and finishes at close.
        project, name, dir, **init_kwargs: for the run the sink starts (``mode="offline"`` or
            ``WANDB_MODE=offline``: no network; ``wandb sync`` uploads it later).
        step_metric: the key of the Monitor's step in every row.
        images: log the records' images.
        commit: True: every Monitor step is a row of its own; False: the Monitor's steps go into the rows the
            user opens, and W&B's ``_step`` is never advanced by the sink. None: False for a run the sink did
            not start, True for its own.
        start_run: False: never start a run; with no ``run``, write into whichever run is active at each write
            (the Hugging Face Trainer starts its run after the callbacks are built), nothing while none is.
    """

    def __init__(self, run: Any = None, *, project: str | None = None, name: str | None = None,
                 dir: str | os.PathLike | None = None, step_metric: str = STEP_METRIC, images: bool = True,
                 commit: bool | None = None, start_run: bool = True, **init_kwargs: Any) -> None:
        self.active = _main_rank()
        self.step_metric, self.images, self.start_run = step_metric, images, start_run
        self.run: Any = None
        self.own = False  # whether the sink started the run (and so finishes it)
        self._commit = commit
        self._report = WarnOnce(log, logging.ERROR, stacklevel=3)
        self._defined: set[str] = set()
        self._waiting: OrderedDict[int, dict[str, Any]] = OrderedDict()  # Monitor step -> its values
        self._row: tuple[int, int] | None = None  # (the user's run.step, the Monitor step) of the open row
        self._layout: dict | None = None
        self._lines: dict[str, dict[str, list[tuple[int, float]]]] = {}  # chart key -> line name -> points
        self._alerts: list[Alert] = []
        self._closed = False
        if not self.active:
            return
        import wandb

        self.wandb = wandb
        if run is not None:
            self.run = run
        elif wandb.run is not None:
            self.run = wandb.run
        elif start_run:
            settings = {k: v for k, v in (("project", project), ("name", name), ("dir", dir)) if v is not None}
            if dir is not None:
                os.makedirs(dir, exist_ok=True)
            self.run = wandb.init(**settings, **init_kwargs)
            self.own = True

    # ------------------------------------------------------------------ the protocol

    def write(self, record: Record) -> None:
        if not self._attach():
            return
        values: dict[str, Any] = {}
        for tag, value in record.scalars.items():
            values[wandb_key(tag)] = float(value)
        for tag, hist in record.histograms.items():
            finite = np.asarray(hist, dtype=np.float64)
            finite = finite[np.isfinite(finite)]
            if finite.size:
                values[wandb_key(tag)] = self.wandb.Histogram(finite)
        if self.images:
            for tag, image in record.images.items():
                values[wandb_key(tag)] = self.wandb.Image(np.asarray(image))
        self._keep_lines(record.step, record.scalars)
        if values:
            self._waiting.setdefault(record.step, {}).update(values)
            self._drain()

    def write_view(self, record: Record) -> None:
        """The alert events per level, for the alerts chart (the view's other parts are TensorBoard's)."""
        if not self.active:
            return
        for run, scalars in record.runs.items():
            for tag, value in scalars.items():
                self._lines.setdefault(tag, {}).setdefault(run.split("/")[-1], []).append((record.step, value))

    def write_layout(self, layout: dict) -> None:
        """Kept: its charts are logged at close, when their lines are complete."""
        if self.active:
            self._layout = layout

    def write_alerts(self, alerts: list[Alert]) -> None:
        if not self._attach():
            return
        self._alerts.extend(alerts)
        self._check_open()
        for a in alerts:
            where = f" at {shown_where(a)}" if a.where else ""
            status = " resolved" if a.status == "resolved" else ""
            self._guard("alert", lambda a=a, where=where, status=status: self.run.alert(
                title=f"attnscope {a.kind}{status}{where}"[:64],
                text=f"{a.level}{status}{where}, step {a.step}: {a.message} (docs: {a.anchor})",
                level=_alert_level(self.wandb, a), wait_duration=1))
        self.run.summary[f"{ROOT}/alerts_fired"] = sum(a.status == "firing" for a in self._alerts)
        self.run.summary[f"{ROOT}/last_alert"] = console_line(alerts[-1]) if alerts else ""

    def flush(self) -> None:
        pass  # W&B writes in its own process; the waiting steps wait for the user's rows

    def close(self) -> None:
        """Writes the waiting steps, the charts and the alert table; finishes the run only if the sink started
        it. Never raises."""
        if self._closed or self.run is None:
            self._closed = True
            return
        self._closed = True
        if getattr(self.run, "_is_finished", False):  # finished by its owner: W&B refuses every call
            self._guard("close", self._check_open)
            return
        self._guard("close", self._drain, True)
        self._guard("charts", self._log_charts)
        self._guard("alert table", self._log_alert_table)
        if self.own:
            self._guard("finish", self.run.finish)

    # ------------------------------------------------------------------ internals

    def _attach(self) -> bool:
        """Whether there is a run to write into (with ``start_run=False``: the active one, once it exists)."""
        if not self.active or self._closed:
            return False
        if self.run is None and not self.start_run:
            self.run = self.wandb.run
        return self.run is not None

    def _check_open(self) -> None:
        """Raise if the run is finished: W&B refuses every call then, and asking a finished run for its step
        waits 30 s for an answer that never comes (``Run.step``)."""
        if getattr(self.run, "_is_finished", False):
            raise SinkError("the W&B run is finished; the Monitor's later values are not in it (finish the run "
                            "after the Monitor is closed)")

    def _commits(self) -> bool:
        return self.own if self._commit is None else self._commit

    def _define(self, keys: list[str]) -> None:
        if self.step_metric not in self._defined:
            self._defined.add(self.step_metric)
            self.run.define_metric(self.step_metric)
        for key in keys:
            prefix = key.split("/", 1)[0]
            if "/" in key and prefix not in self._defined:
                self._defined.add(prefix)
                self.run.define_metric(f"{prefix}/*", step_metric=self.step_metric)

    def _log(self, step: int, values: dict[str, Any], commit: bool) -> None:
        self._define(list(values))
        self.run.log({**values, self.step_metric: step}, commit=commit)

    def _drain(self, closing: bool = False) -> None:
        """Log the waiting Monitor steps: each as a row of its own, or into the user's open row while that
        holds no other Monitor step."""
        self._check_open()
        if self._commits():
            while self._waiting:
                step, values = self._waiting.popitem(last=False)
                self._log(step, values, commit=True)
            return
        while self._waiting:
            step = next(iter(self._waiting))
            user_step = self.run.step
            fresh = self._row is None or self._row[0] != user_step
            if fresh or self._row[1] == step:
                self._log(step, self._waiting.pop(step), commit=False)
                self._row = (user_step, step)
            elif closing or len(self._waiting) > MAX_WAITING:
                if not closing:
                    self._report("waiting", f"diag: WandbSink: more than {MAX_WAITING} Monitor steps wait for "
                                 "rows of the run (it logs less often than the Monitor samples); the sink "
                                 "commits rows of its own from here on, which advances the run's _step")
                self.run.log({}, commit=True)  # closes the user's open row, with the Monitor step in it
                self._row = None
            else:
                return  # waits for the user's next row

    def _keep_lines(self, step: int, scalars: dict[str, float]) -> None:
        """The points of the layout's charts: the per-layer statistics (a line per layer) and the global tags."""
        for layer, tags in layer_runs(scalars).items():
            for tag, value in tags.items():
                self._lines.setdefault(tag, {}).setdefault(layer, []).append((step, float(value)))
        for tag, value in scalars.items():
            if "/" not in tag:
                self._lines.setdefault(tag, {}).setdefault(tag, []).append((step, float(value)))

    def _log_charts(self) -> None:
        import re

        if self._layout is None:
            return
        charts: dict[str, Any] = {}
        for category, entries in self._layout.items():
            for title, (_, patterns) in entries.items():
                tags = [tag for tag in self._lines if any(re.match(p, tag) for p in patterns)]
                lines = {name: [(s, v) for s, v in points if math.isfinite(v)]
                         for tag in tags for name, points in sorted(self._lines[tag].items())}
                lines = {name: points for name, points in lines.items() if points}
                if not lines:
                    continue
                key = f"{CHART_PREFIX}/{category}/{tags[0].replace('/', '.')}"
                charts[key] = self.wandb.plot.line_series(
                    xs=[[s for s, _ in points] for points in lines.values()],
                    ys=[[v for _, v in points] for points in lines.values()],
                    keys=list(lines), title=title, xname="step")
        if charts:
            self.run.log(charts, commit=self._commits())

    def _log_alert_table(self) -> None:
        self.run.summary[f"{ROOT}/alerts_fired"] = sum(a.status == "firing" for a in self._alerts)  # 0: none fired
        if not self._alerts:
            return
        table = self.wandb.Table(columns=ALERT_COLUMNS, data=[
            [a.step, a.kind, a.level, shown_where(a), a.status, a.since, a.message, a.anchor] for a in self._alerts])
        self.run.log({ALERT_TABLE: table}, commit=self._commits())

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - W&B must never stop training
            self._report(what, f"diag: WandbSink {what} failed ({err!r}); training goes on")
