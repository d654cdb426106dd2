"""``python -m diag analyze``: the command-line application around :func:`diag.offline.series.analyze_checkpoints`.

Writes into ``--out``: TensorBoard event files and ``metrics.jsonl`` (the live
Monitor's tags, steps = the checkpoints' steps), ``alerts.jsonl``, and
``report/index.html`` with its figures. Prints a summary table (or ``--json``)
on stdout; progress and ``error:`` lines go to stderr. Exit codes: see
:mod:`diag.cli.main`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np

from diag.cli.common import kv_map_arg, positive, tensorboard_command
from diag.errors import DiagError
from diag.layouts.vocab import QKVLayout
from diag.math.metrics import DEFAULT_SEC_TOP
from diag.offline.series import Analysis, Series, prepare_series
from diag.offline.store import FOLDER as STORE_FOLDER
from diag.offline.store import UnitStore
from diag.outputs.sinks import JsonlSink, Sink, TensorBoardSink, check_logdir

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    analyze.add_argument("--heads", type=positive, metavar="N", help="shorthand: attention heads per layer, every "
                         "layer alike (overrides the config); the packing and pairing it assumes are printed")
    analyze.add_argument("--kv-heads", type=positive, metavar="G", help="shorthand: key/value heads (grouped-query "
                         "attention; query head h assumed to pair with key/value head h // (N/G), stated in the "
                         "output; --kv-map sets another pairing)")
    analyze.add_argument("--kv-map", type=kv_map_arg, metavar="MAP", help="the grouped-query pairing, which the "
                         "weights cannot tell: 'grouped' (query head h with key/value head h // (N/G), as Hugging "
                         "Face's repeat_kv), 'tiled' (h %% G, as Tensor.repeat) or one key/value head per query head "
                         "('0,1,0,1'); refused where the layouts know the pairing and it differs")
    analyze.add_argument("--model", metavar="MODULE:CALLABLE", help="your own model class, for a bare state dict: "
                         "MODULE:CALLABLE (e.g. mypkg.model:build, a file's folder on PYTHONPATH or the current "
                         "one) returns the model; it is built on the meta device (no weights allocated) and its "
                         "attention layers found as the live Monitor finds them. Your code, named here; never code "
                         "from a checkpoint")
    analyze.add_argument("--jobs", type=positive, default=1, metavar="N", help="worker processes for a series "
                         "(default: 1); the outputs equal one process's")
    analyze.add_argument("--resume", action="store_true", help="continue an analysis in --out that was stopped, "
                         "or add the checkpoints written since to a finished one: checkpoints already computed (kept "
                         "in --out/per-checkpoint) are not computed again, and the outputs are written anew, equal "
                         "to an uninterrupted run's. A finished analysis of the same checkpoints has nothing to "
                         "continue: said, and nothing written")
    analyze.add_argument("--sec-top", type=positive, default=DEFAULT_SEC_TOP, metavar="S",
                         help=f"s of the spectral energy concentration SEC_s (default: {DEFAULT_SEC_TOP})")
    analyze.add_argument("--json", action="store_true", help="print a JSON summary on stdout (for scripts)")
    analyze.add_argument("--no-report", action="store_true", help="no figures and no index.html")
    analyze.add_argument("--overwrite", action="store_true", help="replace the analysis in --out (finished or "
                         "stopped) and its outputs: every checkpoint is analysed again")
    analyze.add_argument("--quiet", action="store_true", help="no progress bar and no summary table")
    analyze.add_argument("--probe", metavar="FILE", help="also measure attention: run the model built from a "
                         "Hugging Face config.json on these inputs (token ids, or text with the folder's tokenizer)")

def _refused(out: Path, overwrite: bool, resume: bool) -> str | None:
    """Why ``out`` cannot take this analysis (the policy of every output folder:
    :func:`diag.outputs.sinks.check_logdir`), or None; nothing in it is removed here."""
    if overwrite and resume:
        return "pass either --overwrite (start again) or --resume (continue), not both"
    if overwrite or resume:
        return None
    store = UnitStore(out / STORE_FOLDER)
    state = store.state()
    if state == "finished":
        return (f"{out} holds a finished analysis ({_what(store)}); pass --overwrite to analyse again from the start "
                "and replace it, --resume to add the checkpoints written or re-written since, or another folder")
    if state == "stopped":
        return (f"{out} holds a stopped analysis ({STORE_FOLDER}/); pass --resume to continue it, --overwrite to "
                "replace it, or another folder")
    try:
        check_logdir(out, how="--overwrite to replace it, or --resume to continue the analysis it holds")
    except DiagError as err:
        return str(err)
    return None


def _what(store: UnitStore) -> str:
    """``per-checkpoint/: 4 checkpoints, steps 0..30``: the finished analysis a store holds."""
    done = store.finished() or {}
    steps, n = done.get("steps") or [], done.get("checkpoints", 0)
    span = f", steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f", step {steps[0]}" if steps else ""
    return f"{STORE_FOLDER}/: {n} checkpoint{'' if n == 1 else 's'}{span}"


def _prepare_out(out: Path, overwrite: bool, resume: bool) -> str | None:
    """None when ``out`` is ready; else the reason it is not. ``resume`` keeps the computed checkpoints
    (``per-checkpoint/``) and replaces the outputs, which are written again from them; ``overwrite`` replaces
    both."""
    if not (overwrite or resume):
        return None  # checked by _refused: no earlier run there
    units = out / STORE_FOLDER
    try:
        check_logdir(out, overwrite=True)
    except DiagError as err:
        return str(err)
    if overwrite and units.is_dir():
        shutil.rmtree(units)
    if (out / "report").is_dir():
        for old in (out / "report").iterdir():
            if old.is_file() and old.suffix in (".png", ".html"):
                old.unlink()
    return None


def _probe(inputs: str | None):
    """The ``--probe`` callable; it runs a live model, so it lives in ``hooks`` (imported only here)."""
    if inputs is None:
        return None
    from hooks.checkpoint.probe import Probe

    return Probe(inputs)


def _model_layout():
    """Layouts of a Hugging Face folder's model, built from config.json by ``hooks`` (imported only here)."""
    from hooks.checkpoint.search import ModelLayouts

    return ModelLayouts()


def _user_model(spec: str | None):
    """``--model``: the user's model built on the meta device by ``hooks`` (imported only here)."""
    if spec is None:
        return None
    from hooks.checkpoint.usermodel import UserModel

    return UserModel(spec)


def _progress(quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    # Only on a terminal (disable=None), and only once a series takes more than a second: a quick
    # run, or one that fails at its first checkpoint, prints no bar before its message.
    return lambda items: tqdm(items, desc="checkpoints", unit="ckpt", file=sys.stderr, leave=False,
                              disable=None, delay=1.0)


def _log_above_progress(active: bool) -> contextlib.AbstractContextManager:
    """Log lines (alerts) printed above the progress bar instead of through it."""
    if not active:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger("diag")])


def _table(analysis: Analysis) -> str:
    last = max(analysis.spectra)
    lines = [f"step {last}: layer  sigma1_max  sec_max  erank_mean  stable_rank_mean  last_update_q"]
    last_update = analysis.updates[max(analysis.updates)] if analysis.updates else {}
    for la in analysis.layers:
        m = analysis.spectra[last][la.label]
        ratio = last_update.get(la.label, {}).get("update_ratio_q")
        lines.append(f"  {la.label:>8}  {np.max(m['qk_sigma1']):10.4g}  {np.max(m['qk_sec']):7.3f}  "
                     f"{np.mean(m['qk_erank']):10.3f}  {np.mean(m['qk_stable_rank']):16.3f}  "
                     f"{'-' if ratio is None else f'{ratio[0]:.3g}':>14}")
    return "\n".join(lines)


def _heads(layout: QKVLayout) -> str:
    """``4 heads of 16``; with grouped-query attention ``4 query heads, 2 key/value heads, of 16``."""
    if layout.kv_heads == layout.n_heads:
        return f"{layout.n_heads} heads of {layout.head_dim}"
    return f"{layout.n_heads} query heads, {layout.kv_heads} key/value heads, of {layout.head_dim}"


def _describe(analysis: Analysis, out: Path, report: Path | None) -> str:
    la = analysis.layers[0]
    steps = analysis.steps
    head = [
        f"analysed {len(steps)} checkpoint(s), steps {steps[0]}..{steps[-1]}; {len(analysis.layers)} attention "
        f"layers ({la.layout.adapter}, {_heads(la.layout)}); "
        f"{analysis.heads.note if analysis.heads else ''}",
        *analysis.assumptions,
        _table(analysis),
        f"alerts: {len(analysis.alerts)}"
        + "".join(f"\n  step {a.step} {a.level} {a.kind} {a.where}: {a.message}" for a in analysis.alerts),
        f"TensorBoard: {tensorboard_command(out)}",
    ]
    if report is not None:
        head.append(f"report: {report}")
    return "\n".join(head)


def _prepare(args: argparse.Namespace, out: Path) -> Series:
    """The series planned, nothing computed or written (DiagError: --layout unreadable, or given with --heads;
    --probe or --model unusable)."""
    return prepare_series(args.paths, heads=args.heads, kv_heads=args.kv_heads, sec_top=args.sec_top,
                          probe=_probe(args.probe), layout=args.layout, model_layout=_model_layout(),
                          kv_map=args.kv_map, user_model=_user_model(args.model), jobs=args.jobs,
                          store=out / STORE_FOLDER)


def _analyze(args: argparse.Namespace, out: Path, series: Series) -> Analysis | None:
    """The analysis written to ``out``; None (after one ``error:`` line) when it cannot be made."""
    sinks: list[Sink] = [TensorBoardSink(out), JsonlSink(out / "metrics.jsonl")]
    progress = _progress(args.quiet)
    try:
        with _log_above_progress(progress is not None):
            return series.run(sinks, out / "alerts.jsonl", progress=progress)
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    finally:
        for sink in sinks:
            sink.close()


def _nothing_to_continue(out: Path, series: Series) -> bool:
    """``--resume`` on a finished analysis of these very checkpoints and options: said, and nothing touched."""
    if not (series.finished() and (out / "metrics.jsonl").is_file()):
        return False
    print(f"note: {out} holds a finished analysis of these checkpoints with these options "
          f"({_what(UnitStore(out / STORE_FOLDER))}): nothing to continue, its outputs are left as they are; "
          "pass --overwrite to analyse them again", file=sys.stderr)
    return True


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    reason = _refused(out, args.overwrite, args.resume)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if args.quiet:
        logging.getLogger("diag").setLevel(logging.WARNING)
    try:
        series = _prepare(args, out)
    except DiagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.resume and _nothing_to_continue(out, series):
        return 0
    reason = _prepare_out(out, args.overwrite, args.resume)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    analysis = _analyze(args, out, series)
    if analysis is None:
        return 2
    for _, message in analysis.failures:
        print(f"error: {message}", file=sys.stderr)
    if not analysis.analysed:
        print("error: nothing analysed; see the errors above", file=sys.stderr)
        return 2
    report = None
    if not args.no_report:
        try:
            from diag.reports.checkpoints import write_report

            report = write_report(analysis, out / "report")
        except (DiagError, OSError) as err:
            print(f"error: the report was not written: {err}", file=sys.stderr)
    if args.quiet and not args.json:
        for assumption in analysis.assumptions:  # never silent about what was assumed
            print(f"note: {assumption}", file=sys.stderr)
    if args.json:
        summary = analysis.summary()
        summary["outputs"] = {"logdir": str(out), "report": None if report is None else str(report)}
        print(json.dumps(summary))
    elif not args.quiet:
        print(_describe(analysis, out, report))
    return 1 if analysis.failures or (report is None and not args.no_report) else 0
