"""Offline W&B for the tests of :mod:`diag.outputs.wandb_sink` (tests only): the environment that keeps every file W&B
writes in one folder, and the run folders under it. Runs are read back with
:func:`diag.outputs.wandb_read.read_offline_run`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["offline_env", "run_dirs"]


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
