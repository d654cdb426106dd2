"""``python -m diag demo``: a small character-level GPT trained on the CPU, monitored live.

The data is the Python standard library's own source (the ``.py`` files beside
the ``os`` module, in sorted order, the first ~2 MB), so the demo needs no
download. The model is nanoGPT-style and pre-LN, with few wide heads (d_head 64)
and context 128.

The default is a constant learning rate of 5e-3 with no warmup: the first AdamW
steps are as large as the initial weights, sigma_1(Wq^T Wk) runs away with its
energy in one direction, the loss stalls near the unigram level, and heads of
the first layer turn sparse yet low-rank (most queries point at the same few
keys). ``--warmup 100`` is the healthy twin; ``--step-limit 0.03`` the remedy
without warmup (:class:`diag.SpectralStepLimit`). Compare them in one TensorBoard::

    python -m diag demo --logdir runs/demo
    python -m diag demo --warmup 100 --logdir runs/demo-warmup
    tensorboard --logdir runs

The Monitor is attached exactly as in any training loop; print is used because
the demo is an application, not library code.
"""

from __future__ import annotations

import math
import os
import time
from argparse import Namespace
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hooks.monitor import Monitor
from hooks.steplimit import SpectralStepLimit

__all__ = ["GPTConfig", "GPT", "load_text", "run_demo"]

DEFAULT_LR = 5e-3
MAX_CHARS = 2_000_000


@dataclass
class GPTConfig:
    vocab_size: int = 128  # set from the data
    block_size: int = 128  # context length
    n_layer: int = 4
    n_head: int = 2  # few wide heads: d_head = n_embd // n_head = 64
    n_embd: int = 128
    batch_size: int = 16


# ------------------------------------------------------------------ model (nanoGPT-style, pre-LN)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused q, k, v: the Monitor's nanoGPT adapter
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        c = cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in nanoGPT
        for name, p in self.named_parameters():  # N(0, 0.02); attention output c_proj scaled down (nanoGPT)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias") and ".ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        t = idx.shape[1]  # idx, targets: (B, T)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------ data


def load_text(max_chars: int = MAX_CHARS) -> str:
    """The standard library's ``.py`` files next to ``os``, sorted by name, the first ``max_chars``."""
    parts, total = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def get_batch(data: Tensor, cfg: GPTConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ix = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=gen).tolist()
    x = torch.stack([data[i : i + cfg.block_size] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + cfg.block_size] for i in ix])  # (B, T): next characters
    return x, y


# ------------------------------------------------------------------ training


def _signals(last: dict[str, float]) -> str:
    """The headline signals of the last sampled step, across layers."""
    def pick(metric: str, stat: str, fn) -> float:
        values = [v for tag, v in last.items() if tag.startswith(metric + "/") and tag.endswith("/" + stat)]
        return fn(values) if values else math.nan
    return (f"sigma1 max {pick('qk_sigma1', 'max', max):6.2f}  attn entropy min "
            f"{pick('attn_entropy', 'min', min):.2f}  attn rank min {pick('attn_rank', 'min', min):5.1f}")


def train(args: Namespace, cfg: GPTConfig | None = None) -> tuple[Monitor, list[float]]:
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
    if (Path(args.logdir) / "metrics.jsonl").exists():
        say(f"note: {args.logdir} already holds a run; this one is added to it (use a new --logdir)")

    torch.manual_seed(args.seed)  # the weights; the batches come from their own generator
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    monitor = Monitor(model, logdir=args.logdir, every=args.every)
    tau = getattr(args, "step_limit", None)
    if tau is not None:  # the remedy (diag.SpectralStepLimit); the scheduler keeps driving the shared lr
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


def run_demo(args: Namespace) -> None:
    """Entry point of ``python -m diag demo``; ``args`` as built by :func:`diag.cli.main.build_parser`."""
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
    print(f"\ntensorboard --logdir {args.logdir}")
