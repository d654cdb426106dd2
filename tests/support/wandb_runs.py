"""Reading offline W&B runs back, for the tests of :mod:`diag.outputs.wandb_sink` (tests only).

The reader is W&B's own: ``wandb leet inspect --json`` prints every record of a run's ``.wandb``
transaction log as one JSON object a line (history rows, alerts, summaries, the run itself).
History values come back as JSON; a value that is not finite as the string ``"NaN"``, ``"Infinity"``
or ``"-Infinity"``, which :func:`history` turns back into floats.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

__all__ = ["offline_env", "run_dirs", "records", "history", "alerts", "run_id", "summary", "table"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def offline_env(home: str | Path) -> dict[str, str]:
    """Environment variables for W&B offline with every file it writes under ``home`` (runs, artifacts' staging,
    cache, settings): no account, no network, nothing in the user's home folder."""
    home = Path(home)
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(home), "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


def run_dirs(root: str | Path) -> list[Path]:
    """Every run folder (``offline-run-*`` or ``run-*``) under ``root``, at any depth."""
    return sorted(p.parent for p in Path(root).rglob("run-*.wandb"))


def records(run_dir: str | Path) -> list[dict]:
    """Every record of the run's ``.wandb`` file, in order."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _value(value: object) -> object:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def history(recs: list[dict]) -> list[dict]:
    """The history rows, each ``{key: value}`` with ``_step``; non-finite values as floats."""
    rows = []
    for r in recs:
        if r["type"] == "history":
            item = r["history"].get("item", {})
            rows.append({k: _value(v) for k, v in item.items()})
    return rows


def alerts(recs: list[dict]) -> list[dict]:
    """The ``run.alert`` records: title, text, level."""
    return [r["alert"] for r in recs if r["type"] == "alert"]


def run_id(recs: list[dict]) -> str:
    return next(r["run"]["run_id"] for r in recs if r["type"] == "run")


def summary(recs: list[dict]) -> dict:
    """The summary as the run left it: every summary record's updates, in order."""
    out: dict = {}
    for r in recs:
        if r["type"] == "summary":
            out.update({k: _value(v) for k, v in r["summary"].get("update", {}).items()})
    return out


def table(run_dir: str | Path, rows: list[dict], key: str) -> dict:
    """The newest ``wandb.Table`` logged under ``key``: ``{"columns": [...], "data": [[...], ...]}``, read from
    the run's ``files/`` folder."""
    logged = [row for row in rows if row.get(f"{key}._type") == "table-file"]
    assert logged, f"no table {key!r} in the run's history"
    return json.loads((Path(run_dir) / "files" / logged[-1][f"{key}.path"]).read_text())
