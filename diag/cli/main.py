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
import logging
import shlex
import sys
from pathlib import Path

from diag.errors import DiagError
from diag.math.metrics import DEFAULT_SEC_TOP

__all__ = ["main", "build_parser", "tensorboard_command"]


def tensorboard_command(logdir: str | Path) -> str:
    """The command that shows ``logdir`` in TensorBoard, from any shell: this Python's full path (the
    venv's ``tensorboard`` script is not on PATH outside it), and the folder above the run, so that
    TensorBoard names the run after its folder (``demo``; its layers ``demo/L00``, ...) instead of
    ``.``, beside the runs it can be compared with."""
    path = Path(logdir).resolve()
    return f"{shlex.quote(sys.executable)} -m tensorboard.main --logdir {shlex.quote(str(path.parent))}"


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
    demo.add_argument("--steps", type=_positive, default=300, help="training steps (default: 300)")
    demo.add_argument("--every", type=_every, default=10, help="sample every signal every N steps, or 'default' for "
                      "the Monitor's per-family cadence (default: 10)")
    demo.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's collapse setting)")
    demo.add_argument("--warmup", type=_non_negative, default=0, help="linear warmup steps (default: 0, no warmup)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--step-limit", type=float, default=None, metavar="TAU",
                      help="bound each matrix's step: sigma_1(dW)/sigma_1(W) <= TAU (SpectralStepLimit; default: off)")
    demo.add_argument("--overwrite", action="store_true", help="replace the run --logdir already holds (without "
                      "it, such a folder is refused)")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    _add_analyze(sub)
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
    return parser


def _at_least(low: int):
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


_positive, _non_negative = _at_least(1), _at_least(0)


def _every(text: str) -> int | None:
    """``--every``: a positive integer, or ``default`` (None: the Monitor's per-family cadence)."""
    if text == "default":
        return None
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {text!r}") from None


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    analyze = sub.add_parser(
        "analyze",
        help="weight-side diagnostics of checkpoints (one, or a series in step order)",
        description="Analyse checkpoints after the fact: sigma_1, spectrum, SEC, effective and stable rank of "
        "every head's Wq^T Wk, and update ratios between consecutive checkpoints, with the live Monitor's "
        "tags, to a TensorBoard run, metrics.jsonl, alerts.jsonl and a report folder. Nothing in a checkpoint "
        "is executed: PyTorch files are loaded with weights_only=True.",
    )
    analyze.add_argument("paths", nargs="+", metavar="PATH",
                         help="checkpoint files (.pt .pth .bin .ckpt .safetensors, *.index.json), model folders "
                         "(config.json + weights), folders of checkpoints, or quoted globs")
    analyze.add_argument("--out", default="runs/analyze", metavar="DIR",
                         help="output folder: TensorBoard run, metrics.jsonl, alerts.jsonl, report/ "
                         "(default: runs/analyze)")
    analyze.add_argument("--layout", metavar="FILE", help="the attention layouts as a JSON layout file (module paths "
                         "or patterns, QKVLayout fields: packing, head counts per stage, query-to-KV-head map); "
                         "needed for a bare state dict whose layout the keys and config do not tell "
                         "(docs/analyze.md#layout-files). A run's own attnscope_layout.json is found without it")
    analyze.add_argument("--heads", type=_positive, metavar="N", help="shorthand: attention heads per layer, every "
                         "layer alike (overrides the config); the packing and pairing it assumes are printed")
    analyze.add_argument("--kv-heads", type=_positive, metavar="G", help="shorthand: key/value heads (grouped-query "
                         "attention; query head h assumed to pair with key/value head h // (N/G))")
    analyze.add_argument("--sec-top", type=_positive, default=DEFAULT_SEC_TOP, metavar="S",
                         help=f"s of the spectral energy concentration SEC_s (default: {DEFAULT_SEC_TOP})")
    analyze.add_argument("--json", action="store_true", help="print a JSON summary on stdout (for scripts)")
    analyze.add_argument("--no-report", action="store_true", help="no figures and no index.html")
    analyze.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    analyze.add_argument("--quiet", action="store_true", help="no progress bar and no summary table")
    analyze.add_argument("--probe", metavar="FILE", help="also measure attention: run the model built from a "
                         "Hugging Face config.json on these inputs (token ids, or text with the folder's tokenizer)")


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
    if args.command == "analyze":
        from diag.cli.analyze import run_analyze

        return run_analyze(args)
    if args.command == "report":
        return _report(args)
    return _demo(args)


def _report(args: argparse.Namespace) -> int:
    from diag.outputs.run_report import write_run_report

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


def _demo(args: argparse.Namespace) -> int:
    # The demo is a live training loop, which lives in ``hooks``; imported only here so that the
    # rest of ``diag`` never depends on ``hooks``.
    from diag.outputs.sinks import check_logdir

    try:
        check_logdir(args.logdir, overwrite=args.overwrite, how="--overwrite to replace it")
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from hooks.demo import run_demo

    try:
        run_demo(args)
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"\nTensorBoard: {tensorboard_command(args.logdir)}\nreport:      {shlex.quote(sys.executable)} -m diag "
          f"report {shlex.quote(str(args.logdir))}")
    return 0
