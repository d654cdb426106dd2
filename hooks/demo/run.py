"""The demo's run: the GPT on the standard library's source, AdamW with or without warmup, the Monitor attached.

print is used because the demo is an application, not library code.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diag.catalog.tags import parse_tag
from diag.errors import ConfigError
from diag.outputs.sinks import Sink
from hooks.demo.data import encode, get_batch, load_text
from hooks.demo.loop import Schedule, StepCallback, adamw, train_steps
from hooks.demo.model import GPT, GPTConfig
from hooks.monitor.monitor import Monitor
from hooks.steplimit import SpectralStepLimit

__all__ = ["DEFAULT_LR", "DemoRun", "train", "run_demo"]

DEFAULT_LR = 5e-3
PROGRESS_EVERY = 50  # steps between progress lines (each the mean loss of the steps since the last)


@dataclass
class DemoRun:
    """One demo training run: what ``python -m diag demo`` takes from its command line."""

    logdir: str | Path | None = "runs/demo"
    steps: int = 300
    every: int | None = 10  # None: the Monitor's per-family cadence
    lr: float | None = None  # None: DEFAULT_LR, the collapse setting
    warmup: int = 0  # linear warmup steps; 0: none
    seed: int = 0
    step_limit: float | None = None  # tau of a SpectralStepLimit around AdamW; None: plain AdamW
    overwrite: bool = False
    quiet: bool = False
    wandb: bool = False  # also write into a W&B run (offline unless WANDB_MODE says otherwise)
    mlflow: str | None = None  # also write into an MLflow run at this tracking URI

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"DemoRun({name}={value!r}): expected an integer >= {low}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"DemoRun(seed={self.seed!r}): expected an integer")
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                       or self.every < 1):
            raise ConfigError(f"DemoRun(every={self.every!r}): expected an integer >= 1, or None for the "
                              "Monitor's per-family cadence")


def _signals(last: dict[str, float]) -> str:
    """The headline signals of the last sampled step, across layers."""
    def pick(metric: str, stat: str, fn) -> float:
        values = [v for tag, v in last.items() if (p := parse_tag(tag)) and p.metric == metric and p.part == stat]
        return fn(values) if values else math.nan
    return (f"sigma1 max {pick('qk_sigma1', 'max', max):6.2f}  attn entropy min "
            f"{pick('attn_entropy', 'min', min):.2f}  attn rank min {pick('attn_rank', 'min', min):5.1f}")


def _header(text: str, cfg: GPTConfig, model: GPT, lr: float, args: DemoRun) -> str:
    unigram = -sum(n / len(text) * math.log(n / len(text)) for n in Counter(text).values())
    return (f"demo: {len(text) / 1e6:.1f}M characters of stdlib source, vocabulary {cfg.vocab_size}, unigram "
            f"entropy {unigram:.2f} nats; GPT {cfg.n_layer} layers x {cfg.n_head} heads, d_model {cfg.n_embd}, "
            f"context {cfg.block_size}, batch {cfg.batch_size}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; AdamW lr {lr:g}, "
            + (f"linear warmup over {args.warmup} steps" if args.warmup else "no warmup")
            + ("" if args.step_limit is None else f", spectral step limit tau {args.step_limit:g}"))


def _wandb_sink(args: DemoRun) -> Sink:
    """The demo's W&B run: project ``attnscope-demo``, its files under the logdir (``<logdir>/wandb``), offline
    unless ``WANDB_MODE`` names another mode."""
    import importlib.util
    import os

    from diag.outputs.wandb_sink import WandbSink

    if importlib.util.find_spec("wandb") is None:  # the sink imports it; here: a message that says what to install
        raise ConfigError("--wandb needs the wandb package: pip install -e '.[wandb]'")
    return WandbSink(project="attnscope-demo", dir=args.logdir or ".", mode=os.getenv("WANDB_MODE") or "offline")


def _mlflow_sink(args: DemoRun) -> Sink:
    """The demo's MLflow run: a run of its own in the experiment ``attnscope-demo`` at the tracking URI
    ``args.mlflow``, named after the logdir, ended at close (with the run report as an artifact)."""
    import importlib.util

    from diag.outputs.mlflow_sink import MLflowSink

    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("--mlflow needs the mlflow package: pip install -e '.[mlflow]'")
    name = Path(args.logdir).name if args.logdir else "demo"
    return MLflowSink(tracking_uri=args.mlflow, experiment="attnscope-demo", run_name=name)


def _requested_sinks(args: DemoRun) -> tuple[Sink, ...]:
    """The sinks the command line asked for (--wandb, --mlflow)."""
    return (*((_wandb_sink(args),) if args.wandb else ()), *((_mlflow_sink(args),) if args.mlflow else ()))


def train(args: DemoRun, cfg: GPTConfig | None = None, *, sinks: Sequence[Sink] = (),
          callbacks: Sequence[StepCallback] = ()) -> tuple[Monitor, list[float]]:
    """Train with the Monitor attached; returns the closed Monitor and every step's loss.

    sinks: more sinks for the Monitor (a :class:`~diag.outputs.wandb_sink.WandbSink`, say); callbacks: called
    after every step as ``train_steps`` calls them (``(step, losses)``), after the progress line."""
    cfg = cfg or GPTConfig()
    lr = DEFAULT_LR if args.lr is None else args.lr
    text = load_text()
    data, cfg.vocab_size = encode(text)
    torch.manual_seed(args.seed)  # the weights; the batches come from their own generator
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = adamw(model, lr)
    sinks = sinks or _requested_sinks(args)
    monitor = Monitor(model, logdir=args.logdir, every=args.every, overwrite=args.overwrite, sinks=sinks)
    if args.step_limit is not None:  # the remedy (hooks.SpectralStepLimit); the schedule drives the shared lr
        optimizer = SpectralStepLimit(optimizer, args.step_limit, model=model, monitor=monitor, audit=True)
    start = time.perf_counter()

    def progress(step: int, losses: list[float]) -> None:
        if step % PROGRESS_EVERY == 0 or step == args.steps - 1:
            recent = losses[-PROGRESS_EVERY:]
            print(f"step {step:4d}  loss {sum(recent) / len(recent):.3f}  {_signals(monitor.last)}  "
                  f"{time.perf_counter() - start:5.1f}s")

    if not args.quiet:
        print(_header(text, cfg, model, lr, args))
    try:
        losses = train_steps(model, lambda: get_batch(data, cfg, gen), lambda batch: model(*batch), optimizer,
                             args.steps, schedule=Schedule(args.warmup), monitor=monitor,
                             callbacks=(*(() if args.quiet else (progress,)), *callbacks))
    finally:
        monitor.close()
    return monitor, losses


def run_demo(args: DemoRun) -> Monitor:
    """Entry point of ``python -m diag demo``: train, then print the warning and critical alerts. Returns the
    closed Monitor (its ``sinks`` hold the W&B and MLflow sinks the arguments asked for)."""
    monitor, _ = train(args)
    alerts = monitor.alert_sink.history
    if not args.quiet:
        shown = [a for a in alerts if a.level != "info"]
        print(f"\n{len(shown)} warning/critical alert(s):" if shown else "\nno warning or critical alerts")
        for a in shown:
            print(f"  step {a.step:4d}  {a.level:8s} {a.kind:18s} {a.where:7s} {a.message}")
        info = Counter(a.kind for a in alerts if a.level == "info")
        if info:
            print("  and info alerts: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(info.items()))
                  + f" (all in {Path(args.logdir) / 'alerts.jsonl'})")
    return monitor
