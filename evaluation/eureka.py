"""A Eureka-moment reproduction: a 2x2 grid of digits where one digit says which other one is the label.

Run:  OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.eureka --seed 0
      OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.eureka --seed 0 --attention normsoftmax
      (2000 steps, about 1.5 min on one idle core; --logdir runs/eureka for TensorBoard)

The task follows Hoffmann et al. ("Eureka-Moments in Transformers"), built from
scikit-learn's 8x8 digits (1797 images, shipped with the package, no download).
An image is a 16x16 grid of four digits: the top-left one is the *indicator*;
its class mod 3 selects the label cell (0: top-right, 1: bottom-left,
2: bottom-right) and the label is the class of the digit there. Every batch
draws fresh random combinations from the training digits; the validation set
is a fixed set of combinations of held-out digits. Nothing says which cell is
the indicator except its position, so the model must learn an intermediate step
(read the indicator, then look at the cell it names) that no label shows.

The model is a small pre-LN ViT (4x4 patches: 16 tokens plus a class token)
whose attention is nanoGPT-style (a fused ``c_attn`` and ``n_head``), so the
Monitor discovers it with no spec. ``--attention normsoftmax`` replaces the
softmax of the logits ``s`` by ``softmax(s / (T * std_keys(s)))`` (Hoffmann et
al.'s NormSoftmax: the logits normalised by their standard deviation over the
keys, with a temperature ``T``, ``--temperature``).

Typical course (plain softmax, seeds 0 and 1): within 300 steps the loss falls
to about 1.4, on its way to ln 3 = 1.10 (the model reads the three candidate
digits but not the indicator: validation accuracy about 0.41, the no-indicator
ceiling is 0.43); it sinks slowly for 400-900 more steps, then drops abruptly
(1.2 to 0.6 in about 100 steps) when the indicator is learned, and validation
accuracy jumps to about 0.9. The measured table over seeds is in docs/alerts.md.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from diag.outputs.sinks import MemorySink
from hooks import AlertConfig, Monitor

__all__ = ["EurekaConfig", "DigitGrid", "ViT", "train"]


@dataclass
class EurekaConfig:
    attention: str = "softmax"  # or "normsoftmax"
    temperature: float = 0.5  # NormSoftmax: logits / (temperature * std) -> std 1 / temperature
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    patch: int = 4  # 4x4 patches of the 16x16 grid: 16 tokens
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    steps: int = 2000
    eval_every: int = 20
    every: int = 10  # Monitor sampling interval
    seed: int = 0
    alerts: AlertConfig = field(default_factory=AlertConfig)


# ------------------------------------------------------------------ data


class DigitGrid:
    """2x2 grids of sklearn digits; cell 0 is the indicator, cell 1 + (indicator % 3) the label."""

    def __init__(self, held_out: float = 0.25) -> None:
        digits = load_digits()
        images = torch.tensor(digits.images / 16.0, dtype=torch.float32)  # (1797, 8, 8) in [0, 1]
        labels = torch.tensor(digits.target, dtype=torch.long)  # (1797,)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))  # fixed split
        n_val = int(held_out * len(labels))
        self.train_images, self.train_labels = images[order[n_val:]], labels[order[n_val:]]
        self.val_images, self.val_labels = images[order[:n_val]], labels[order[:n_val]]

    @staticmethod
    def compose(images: Tensor, labels: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        """idx (B, 4) digit indices -> grids (B, 16, 16) and labels (B,)."""
        cells = images[idx]  # (B, 4, 8, 8)
        top = torch.cat([cells[:, 0], cells[:, 1]], dim=2)  # (B, 8, 16)
        bottom = torch.cat([cells[:, 2], cells[:, 3]], dim=2)  # (B, 8, 16)
        grid = torch.cat([top, bottom], dim=1)  # (B, 16, 16)
        which = 1 + labels[idx[:, 0]] % 3  # (B,) the cell the indicator names
        return grid, labels[idx.gather(1, which[:, None])[:, 0]]

    def batch(self, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.train_labels), (n, 4), generator=gen)
        return self.compose(self.train_images, self.train_labels, idx)

    def validation(self, n: int = 1000) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.val_labels), (n, 4), generator=torch.Generator().manual_seed(99))
        return self.compose(self.val_images, self.val_labels, idx)


# ------------------------------------------------------------------ model


class SelfAttention(nn.Module):
    def __init__(self, cfg: EurekaConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused q, k, v: discovered as nanoGPT-style
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.norm_softmax = cfg.attention == "normsoftmax"
        self.temperature = cfg.temperature

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        if self.norm_softmax:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
            s = s / (self.temperature * s.std(dim=-1, keepdim=True) + 1e-6)  # NormSoftmax
            y = torch.softmax(s, dim=-1) @ v  # (B, H, T, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: EurekaConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        c = cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class ViT(nn.Module):
    """Patches of the 16x16 grid -> tokens, a class token, pre-LN blocks, a linear head on the class token."""

    def __init__(self, cfg: EurekaConfig) -> None:
        super().__init__()
        self.patch = cfg.patch
        n_tokens = (16 // cfg.patch) ** 2
        self.embed = nn.Linear(cfg.patch * cfg.patch, cfg.n_embd)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.n_embd))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n_tokens + 1, cfg.n_embd))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, 10)

    def forward(self, grid: Tensor) -> Tensor:
        b, p = grid.shape[0], self.patch  # grid: (B, 16, 16)
        patches = grid.unfold(1, p, p).unfold(2, p, p).reshape(b, -1, p * p)  # (B, N, p*p), row-major
        x = torch.cat([self.cls.expand(b, -1, -1), self.embed(patches)], dim=1) + self.pos  # (B, N+1, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))  # (B, 10)


# ------------------------------------------------------------------ training


@dataclass
class EurekaRun:
    cfg: EurekaConfig
    monitor: Monitor
    memory: MemorySink
    losses: list[float]  # every step's training loss
    evals: list[tuple[int, float, float]]  # (step, validation loss, validation accuracy)


def train(cfg: EurekaConfig, logdir: str | Path | None = None, say=None, *,
          lr_factor: Callable[[int], float] | None = None, qk_norm: bool = False,
          wrap: Callable | None = None) -> EurekaRun:
    """Train one run with the Monitor attached; returns the closed Monitor, its records and the curves.

    ``lr_factor(step)``: the learning rate of a step as a fraction of ``cfg.lr`` (default: constant);
    ``qk_norm``: LayerNorm on q and k per head (:class:`evaluation.runs.QKNormAttention`); ``wrap``: called
    with the Monitor's detectors, returns what replaces them (the evaluation's recorder, closed after the Monitor)."""
    say = say or (lambda *a: None)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    data = DigitGrid()
    val_x, val_y = data.validation()
    model = ViT(cfg)
    if qk_norm:
        from evaluation.runs import QKNormAttention

        for block in model.blocks:
            block.attn = QKNormAttention(block.attn, cfg.n_embd // cfg.n_head, causal=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or (lambda s: 1.0))
    memory = MemorySink()
    monitor = Monitor(model, logdir=logdir, every=cfg.every, sinks=[memory], alerts=cfg.alerts)
    if wrap is not None:
        monitor.detectors = wrap(monitor.detectors)
    losses, evals = [], []
    start = time.perf_counter()
    try:
        for step in range(cfg.steps):
            model.train()
            x, y = data.batch(cfg.batch_size, gen)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            monitor.step(step, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(loss.item())
            if step % cfg.eval_every == 0 or step == cfg.steps - 1:
                model.eval()
                with torch.no_grad():
                    logits = model(val_x)
                accuracy = (logits.argmax(-1) == val_y).float().mean().item()
                evals.append((step, F.cross_entropy(logits, val_y).item(), accuracy))
                recent = losses[-cfg.eval_every:]
                say(f"step {step:5d}  train loss {sum(recent) / len(recent):.3f}  val loss {evals[-1][1]:.3f}  "
                    f"val acc {evals[-1][2]:.3f}  qk/v grad ratio {_qk_ratio(monitor.last):.2f}  "
                    f"{time.perf_counter() - start:5.1f}s")
    finally:
        monitor.close()
        if wrap is not None:
            monitor.detectors.close()  # the recorder's file, after the update sample Monitor.close judged
    return EurekaRun(cfg, monitor, memory, losses, evals)


# ------------------------------------------------------------------ analysis (definitions in docs/alerts.md)


def blind_accuracy(data: DigitGrid | None = None) -> float:
    """Validation accuracy of an oracle that knows the classes of the three candidate cells but not the indicator.

    It answers the most frequent candidate class: right for sure when that class is the label and appears at
    least twice, 1/3 in expectation when the three classes differ. This is the accuracy ceiling of the plateau.
    """
    data = data or DigitGrid()
    idx = torch.randint(len(data.val_labels), (1000, 4), generator=torch.Generator().manual_seed(99))
    _, label = data.compose(data.val_images, data.val_labels, idx)  # the same draws as validation()
    total = 0.0
    for cands, y in zip(data.val_labels[idx[:, 1:]].tolist(), label.tolist()):
        top = max(set(cands), key=cands.count)
        total += (1.0 / 3.0) if len(set(cands)) == 3 else float(y == top)
    return total / len(label)


def accuracy_jump(evals: list[tuple[int, float, float]], blind: float, tail: int = 3) -> tuple[int | None, float]:
    """The accuracy jump: the first evaluation step whose validation accuracy exceeds halfway from ``blind``
    (the plateau's ceiling) to the final accuracy (mean of the last ``tail`` evaluations); and that threshold.

    None when the final accuracy is not at least 0.2 above ``blind``: the run never left the plateau.
    """
    final = float(np.mean([acc for _, _, acc in evals[-tail:]]))
    threshold = (blind + final) / 2.0
    if final < blind + 0.2:
        return None, threshold
    return next((step for step, _, acc in evals if acc > threshold), None), threshold


def layer_mean_series(memory: MemorySink, metric: str) -> list[tuple[int, float]]:
    """(step, mean over layers of a layer-level metric such as ``grad_ratio_qk_v``), from the Monitor's records."""
    out = []
    for record in memory.records:
        values = [v for tag, v in record.scalars.items() if tag.split("/")[0] == metric and tag.count("/") == 1]
        if values:
            out.append((record.step, float(np.mean(values))))
    return out


def mean_between(series: list[tuple[int, float]], lo: float, hi: float) -> float:
    values = [v for s, v in series if lo <= s < hi and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


def _qk_ratio(last: dict[str, float]) -> float:
    values = [v for tag, v in last.items() if tag.startswith("grad_ratio_qk_v/")]
    return float(np.mean(values)) if values else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=EurekaConfig.steps)
    parser.add_argument("--attention", choices=("softmax", "normsoftmax"), default="softmax")
    parser.add_argument("--temperature", type=float, default=EurekaConfig.temperature)
    parser.add_argument("--lr", type=float, default=EurekaConfig.lr)
    parser.add_argument("--layers", type=int, default=EurekaConfig.n_layer)
    parser.add_argument("--patch", type=int, choices=(2, 4, 8), default=EurekaConfig.patch)
    parser.add_argument("--batch", type=int, default=EurekaConfig.batch_size)
    parser.add_argument("--logdir", default=None, help="TensorBoard/JSONL run directory (default: none)")
    args = parser.parse_args()
    cfg = EurekaConfig(attention=args.attention, temperature=args.temperature, lr=args.lr, n_layer=args.layers,
                       patch=args.patch, batch_size=args.batch,
                       steps=args.steps, seed=args.seed)
    run = train(cfg, args.logdir, say=print)
    for a in run.monitor.alert_sink.history:
        if a.level != "info" or a.kind.startswith("eureka"):
            print(f"  step {a.step:5d}  {a.level:8s} {a.kind:18s} {a.where:7s} {a.message}")


if __name__ == "__main__":
    main()
