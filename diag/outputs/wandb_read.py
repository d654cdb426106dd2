"""Reading an offline W&B run back from a script: every record of its ``.wandb`` file, once W&B has written all of it.

    from diag.outputs.wandb_read import read_offline_run

    run.finish()
    back = read_offline_run(run_dir)        # the run's folder, wandb/offline-run-*; waits for the end of the file
    back.history                            # the rows: [{"_step": 0, "user/loss": 2.3, ...}, ...]
    back.series("qk_sigma1/L00/max", step="attnscope/step")   # [(step, value), ...]
    back.summary, back.alerts, back.table("attnscope/alerts")

Why it waits. ``run.finish()`` returns once W&B's service (``wandb-core``, a process of its own) has answered the
run's exit, before the service has written the end of the ``.wandb`` file: the file is written in blocks of
32 KiB, and the last, partial block (the run's last row, the summary, the exit record) reaches the disk when the
service closes the run, on a message ``finish`` sends without waiting for an answer. That takes milliseconds on
an idle machine and can take seconds on a busy one; a reader that opens the file in between sees every record up
to the last whole block, so the run's last row is missing (in a small run, every row). Nothing is lost: the
service writes the rest once it gets to it, also when the process that logged has exited.

The reader is W&B's own: ``python -m wandb leet inspect --json --follow`` prints every record of the file, one
JSON object a line, and keeps reading until the run's exit record (or until the file has gone ``timeout``
seconds without a write). A history value comes back as JSON, a value that is not finite as the string
``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, which :attr:`OfflineRun.history` turns back into floats; media and
tables as their ``<key>._type``, ``<key>.path``, ... entries.

Only a subprocess is started here: importing this module imports no ``wandb``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.errors import SinkError

__all__ = ["OfflineRun", "read_offline_run", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0  # seconds without a write to the file after which an unfinished run is given up on
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _value(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


@dataclass(frozen=True)
class OfflineRun:
    """The records of one offline W&B run, in the order W&B wrote them (each as ``wandb leet inspect --json``
    prints it: ``{"num": ..., "type": "history", "history": {...}}``)."""

    folder: Path  # the run's folder (wandb/offline-run-*), where its files/ are
    records: list[dict]

    @property
    def finished(self) -> bool:
        """Whether the file holds the run's exit record: ``run.finish()`` ran and W&B wrote the file to its end."""
        return any(r["type"] == "exit" for r in self.records)

    @property
    def run_id(self) -> str:
        return next(r["run"]["run_id"] for r in self.records if r["type"] == "run")

    @property
    def history(self) -> list[dict]:
        """The rows, each ``{key: value}`` with W&B's ``_step``; non-finite values as floats."""
        return [{k: _value(v) for k, v in r["history"].get("item", {}).items()}
                for r in self.records if r["type"] == "history"]

    @property
    def summary(self) -> dict:
        """The summary as the run left it: every summary record's updates, in order."""
        out: dict = {}
        for r in self.records:
            if r["type"] == "summary":
                out.update({k: _value(v) for k, v in r["summary"].get("update", {}).items()})
        return out

    @property
    def alerts(self) -> list[dict]:
        """The ``run.alert`` records: title, text, level."""
        return [r["alert"] for r in self.records if r["type"] == "alert"]

    def series(self, key: str, step: str = "_step") -> list[tuple[Any, Any]]:
        """``[(step, value), ...]`` of every row that holds ``key`` (``step``: the key of the x axis, W&B's
        ``_step`` or a step metric such as ``attnscope/step``)."""
        return [(row.get(step), row[key]) for row in self.history if key in row]

    def table(self, key: str) -> dict:
        """The newest ``wandb.Table`` logged under ``key`` (a custom chart's table too): ``{"columns": [...],
        "data": [[...], ...]}``, read from the run's ``files/`` folder."""
        rows = self.history
        logged = [row for row in rows if row.get(f"{key}._type") == "table-file"]
        if not logged:
            tables = sorted({k[: -len("._type")] for row in rows for k, v in row.items()
                             if k.endswith("._type") and v == "table-file"})
            raise SinkError(f"{self.folder}: no table {key!r} in the run's history; its tables: {tables}")
        return json.loads((self.folder / "files" / logged[-1][f"{key}.path"]).read_text(encoding="utf-8"))


def _transaction_log(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("run-*.wandb")) if path.is_dir() else []
    if len(found) != 1:
        what = "no such file or folder" if not path.exists() else f"{len(found)} run-*.wandb files in it"
        raise SinkError(f"read_offline_run({str(path)!r}): {what}; pass one run's folder (wandb/offline-run-*, "
                        "or wandb/latest-run) or its run-*.wandb file")
    return found[0]


def read_offline_run(path: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT,
                     partial: bool = False) -> OfflineRun:
    """Every record of the offline W&B run at ``path`` (its folder, or its ``run-*.wandb`` file).

    Waits until W&B has written the run's exit record, which it writes after ``run.finish()`` has returned
    (module docstring). ``timeout``: seconds without a write to the file after which a run with no exit record
    is given up on (a run still being trained waits for as long as it writes). ``partial=True``: no wait; the
    records already on disk, which may end before the run's last rows.

    Raises :class:`~diag.errors.SinkError` when the file cannot be read, and, unless ``partial``, when the run
    has no exit record after ``timeout`` idle seconds (its process died before ``run.finish()``)."""
    if importlib.util.find_spec("wandb") is None:
        raise SinkError("read_offline_run needs the wandb package (its reader, wandb leet): pip install -e '.[wandb]'")
    log = _transaction_log(Path(path))
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json"]
    if not partial:
        cmd += ["--follow", "--idle-timeout", f"{max(1, math.ceil(timeout))}s"]
    done = subprocess.run([*cmd, str(log)], capture_output=True, text=True, encoding="utf-8")
    if done.returncode != 0:
        raise SinkError(f"read_offline_run: {' '.join(cmd[1:])} {log} exited {done.returncode}: "
                        f"{done.stderr.strip()[-2000:]}")
    run = OfflineRun(log.parent, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")])
    if not partial and not run.finished:
        raise SinkError(f"read_offline_run: {log} has no exit record after {timeout:g} s without a write: the run "
                        "was not finished (its process stopped before run.finish(), or is still running); "
                        "read_offline_run(..., partial=True) reads the records it holds")
    return run
