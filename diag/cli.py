"""Command line: ``python -m diag <command>`` (also installed as ``attnscope``).

argparse from the standard library: no extra dependency, and ``--help`` is
generated from the same definitions that parse the arguments.

Exit codes: 0 success; 1 a run failed (the message says why); 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys

from diag.errors import DiagError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diag",
        description="Training-dynamics diagnostics for transformers (attnscope).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on the Python standard library's source and monitor it",
        description="Train a small character-level GPT on the Python standard library's own "
        "source for a few hundred steps on the CPU, with the Monitor attached, and write a "
        "TensorBoard run with every signal and the alerts it raises.",
    )
    demo.add_argument("--logdir", default="runs/demo", help="TensorBoard run directory (default: runs/demo)")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    demo.add_argument("--every", type=int, default=10, help="sample every N steps (default: 10)")
    demo.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's collapse setting)")
    demo.add_argument("--warmup", type=int, default=0, help="linear warmup steps (default: 0, no warmup)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _show_diag_log() -> None:
    """The CLI is an application: it shows the ``diag`` logger on stderr (library code never does)."""
    logger = logging.getLogger("diag")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _show_diag_log()
    try:
        if args.command == "demo":
            # The demo is a live training loop, which lives in ``hooks``; imported
            # only here so that the rest of ``diag`` never depends on ``hooks``.
            from hooks.demo import run_demo

            run_demo(args)
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
