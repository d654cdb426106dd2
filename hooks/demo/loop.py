"""The demo's training loop: AdamW with or without warmup, the Monitor attached as in any loop.

print is used because the demo is an application, not library code.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from diag.catalog.tags import parse_tag
from diag.errors import ConfigError
from hooks.demo.data import get_batch, load_text
from hooks.demo.model import GPT, GPTConfig
from hooks.monitor.monitor import Monitor
from hooks.steplimit import SpectralStepLimit

__all__ = ["DEFAULT_LR", "DemoRun", "train", "run_demo"]

DEFAULT_LR = 5e-3


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


def train(args: DemoRun, cfg: GPTConfig | None = None) -> tuple[Monitor, list[float]]:
    """Train with the Monitor attached; returns the closed Monitor and every step's loss."""
    cfg = cfg or GPTConfig()
    lr = DEFAULT_LR if args.lr is None else args.lr
    warmup = max(0, args.warmup)
    say = (lambda *a: None) if args.quiet else print
    text = load_text()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)  # (N,)
    cfg.vocab_size = len(chars)
    unigram = -sum(n / len(text) * math.log(n / len(text)) for n in Counter(text).values())

    torch.manual_seed(args.seed)  # the weights; the batches come from their own generator
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    monitor = Monitor(model, logdir=args.logdir, every=args.every, overwrite=args.overwrite)
    tau = args.step_limit
    if tau is not None:  # the remedy (hooks.SpectralStepLimit); the scheduler keeps driving the shared lr
        optimizer = SpectralStepLimit(optimizer, tau, model=model, monitor=monitor, audit=True)
    say(f"demo: {len(text) / 1e6:.1f}M characters of stdlib source, vocabulary {cfg.vocab_size}, unigram "
        f"entropy {unigram:.2f} nats; GPT {cfg.n_layer} layers x {cfg.n_head} heads, d_model {cfg.n_embd}, "
        f"context {cfg.block_size}, batch {cfg.batch_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; AdamW lr {lr:g}, "
        + (f"linear warmup over {warmup} steps" if warmup else "no warmup")
        + ("" if tau is None else f", spectral step limit tau {tau:g}"))
    start, losses = time.perf_counter(), []
    try:
        model.train()
        for step in range(args.steps):
            x, y = get_batch(data, cfg, gen)
            loss = model(x, y)
            loss.backward()
            monitor.step(step, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(loss.item())
            if step % 50 == 0 or step == args.steps - 1:
                recent = losses[-50:]
                say(f"step {step:4d}  loss {sum(recent) / len(recent):.3f}  {_signals(monitor.last)}  "
                    f"{time.perf_counter() - start:5.1f}s")
    finally:
        monitor.close()
    return monitor, losses


def run_demo(args: DemoRun) -> None:
    """Entry point of ``python -m diag demo``: train, then print the warning and critical alerts."""
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
