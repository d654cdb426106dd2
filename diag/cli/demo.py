"""``python -m diag demo``: the demo training run (its loop lives in ``hooks.demo``, imported only when it runs)."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from diag.cli.common import every, non_negative, positive, tensorboard_command
from diag.errors import DiagError

if TYPE_CHECKING:
    from hooks.monitor.monitor import Monitor

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on the Python standard library's source and monitor it",
        description="Train a small character-level GPT on the Python standard library's own "
        "source for a few hundred steps on the CPU, with the Monitor attached, and write a "
        "TensorBoard run with every signal and the alerts it raises.",
    )
    demo.add_argument("--logdir", default="runs/demo", help="TensorBoard run directory (default: runs/demo)")
    demo.add_argument("--steps", type=positive, default=300, help="training steps (default: 300)")
    demo.add_argument("--every", type=every, default=10, help="sample every signal every N steps, or 'default' for "
                      "the Monitor's per-family cadence (default: 10)")
    demo.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's collapse setting)")
    demo.add_argument("--warmup", type=non_negative, default=0, help="linear warmup steps (default: 0, no warmup)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--step-limit", type=float, default=None, metavar="TAU",
                      help="bound each matrix's step: sigma_1(dW)/sigma_1(W) <= TAU (SpectralStepLimit; default: off)")
    demo.add_argument("--overwrite", action="store_true", help="replace the run --logdir already holds (without "
                      "it, such a folder is refused)")
    demo.add_argument("--wandb", action="store_true", help="also write into a Weights & Biases run, offline unless "
                      "WANDB_MODE says otherwise (its files under LOGDIR/wandb; needs pip install -e '.[wandb]')")
    demo.add_argument("--mlflow", metavar="URI", default=None, help="also write into a run of its own in the MLflow "
                      "experiment attnscope-demo at this tracking URI (a server, http://HOST:PORT, or a local store; "
                      "needs pip install -e '.[mlflow]')")
    demo.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    # The demo is a live training loop, which lives in ``hooks``; imported only here so that the
    # rest of ``diag`` never depends on ``hooks``.
    from diag.outputs.sinks import check_logdir

    try:
        check_logdir(args.logdir, overwrite=args.overwrite, how="--overwrite to replace it")
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from hooks.demo import DemoRun, run_demo

    try:
        monitor = run_demo(DemoRun(**{f.name: getattr(args, f.name) for f in fields(DemoRun)}))
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"\nTensorBoard: {tensorboard_command(args.logdir)}\nreport:      {shlex.quote(sys.executable)} -m diag "
          f"report {shlex.quote(str(args.logdir))}")
    if args.wandb:
        runs = shlex.quote(str(Path(args.logdir) / "wandb" / "latest-run"))
        print(f"W&B run:     {runs} (offline: upload it with wandb sync {runs})")
    return _mlflow_outcome(monitor, args.mlflow) if args.mlflow else 0


def _mlflow_outcome(monitor: Monitor, uri: str) -> int:
    """Where the MLflow run is; 1 when values of the run never reached the server (the sink has said why)."""
    from diag.outputs.mlflow_sink import MLflowSink

    (sink,) = [s for s in monitor.sinks.sinks if isinstance(s, MLflowSink)]
    if sink.run_id is None or sink.unsent:
        print(f"error: --mlflow {uri}: {sink.unsent} values did not reach the tracking server (the messages above say "
              f"why); every value is in {monitor.logdir / 'metrics.jsonl'}", file=sys.stderr)
        return 1
    print(f"MLflow run:  {sink.run_id} in experiment attnscope-demo at {sink.tracking_uri}")
    return 0
