"""``python -m diag report``: one HTML page about a live run, from its metrics.jsonl and alerts.jsonl."""

from __future__ import annotations

import argparse
import sys

from diag.errors import DiagError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser(
        "report",
        help="a self-contained HTML report of a live run (from its metrics.jsonl and alerts.jsonl)",
        description="Write one HTML page about a run a Monitor wrote: the loss and every signal per layer with "
        "the alert episodes shaded, heatmaps of every head over time, and the alerts with their advice. "
        "Reads only metrics.jsonl and alerts.jsonl; works while the run is still going.",
    )
    report.add_argument("logdir", metavar="LOGDIR", help="the run folder (the Monitor's logdir, e.g. runs/demo)")
    report.add_argument("--out", metavar="FILE", help="the HTML file (default: LOGDIR/report.html; replaced if "
                        "it exists: it is derived from the run)")


def run(args: argparse.Namespace) -> int:
    from diag.reports.run import write_run_report

    try:
        path = write_run_report(args.logdir, args.out)
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: the report was not written: {err}", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0
