"""Command line: ``python -m diag <command>`` (also installed as ``attnscope``).

argparse from the standard library: no extra dependency, and ``--help`` is
generated from the same definitions that parse the arguments.

Exit codes:

* 0: success;
* 1: ``demo``: the run failed (the message says why); ``report``: the page could not be written;
  ``analyze``: some checkpoints (or ``--probe`` on some) failed, one ``error:`` line each on
  stderr, and the others were analysed, or its report could not be written;
* 2: bad usage (argparse's message), or the output folder (``demo --logdir``, ``analyze --out``)
  already holds a run and ``--overwrite`` was not given, or ``report``'s LOGDIR holds no run, or
  ``analyze`` found nothing it could analyse (every path missing, corrupt, refused or of an
  unknown layout), or its ``--probe`` file is missing.

No command exits 0 without the output it was asked for: ``analyze`` whose report could not be
written exits 1.
"""

from __future__ import annotations

import argparse

from diag.cli import analyze, demo, report
from diag.cli.common import show_diag_log, tensorboard_command

__all__ = ["COMMANDS", "build_parser", "main", "tensorboard_command"]

COMMANDS = {"demo": demo, "analyze": analyze, "report": report}  # each: add_parser(sub), run(args) -> exit code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diag",
        description="Training-dynamics diagnostics for transformers (attnscope).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    show_diag_log()
    return COMMANDS[args.command].run(args)
