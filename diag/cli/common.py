"""What the subcommands share: the TensorBoard command they print, argparse types, the ``diag`` log on stderr."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

__all__ = ["at_least", "every", "kv_map_arg", "non_negative", "positive", "show_diag_log", "tensorboard_command"]


def tensorboard_command(logdir: str | Path) -> str:
    """The command that shows ``logdir`` in TensorBoard, from any shell: this Python's full path (the
    venv's ``tensorboard`` script is not on PATH outside it), and the folder above the run, so that
    TensorBoard names the run after its folder (``demo``; its layers ``demo/L00``, ...) instead of
    ``.``, beside the runs it can be compared with."""
    path = Path(logdir).resolve()
    return f"{shlex.quote(sys.executable)} -m tensorboard.main --logdir {shlex.quote(str(path.parent))}"


def at_least(low: int):
    """An argparse type: an integer >= ``low``, else argparse's error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


positive, non_negative = at_least(1), at_least(0)


def every(text: str) -> int | None:
    """``--every``: a positive integer, or ``default`` (None: the Monitor's per-family cadence)."""
    if text == "default":
        return None
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {text!r}") from None


def kv_map_arg(text: str) -> str:
    """``--kv-map``: ``grouped``, ``tiled`` or comma-separated key/value heads (one per query head)."""
    if text in ("grouped", "tiled"):
        return text
    parts = text.replace(" ", "").split(",")
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected 'grouped', 'tiled' or comma-separated key/value head numbers "
                                         f"such as 0,1,0,1 (one per query head), got {text!r}")
    return ",".join(str(int(p)) for p in parts)


def show_diag_log() -> None:
    """The CLI is an application: it shows the ``diag`` logger on stderr (library code never does)."""
    logger = logging.getLogger("diag")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
