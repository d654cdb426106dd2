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
built of the demo GPT's blocks and attention (``hooks.demo``: nanoGPT-style, a
fused ``c_attn`` and ``n_head``) without the causal mask, so the Monitor
discovers it with no spec. ``--attention normsoftmax`` replaces the softmax of
the logits ``s`` by ``softmax(s / (T * std_keys(s)))`` (Hoffmann et al.'s
NormSoftmax: the logits normalised by their standard deviation over the keys,
with a temperature ``T``, ``--temperature``); ``--attention qknorm`` puts a
LayerNorm on q and k per head. The runs the evaluation records go through
``python -m evaluation.runs vit`` (:func:`train_spec`).

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

from diag.detectors.config import AlertConfig
from diag.outputs.sinks import MemorySink
from evaluation.recording import recording
from evaluation.spec import RunSpec
from hooks.demo import Block, Schedule, SelfAttention, train_steps
from hooks.monitor.monitor import Monitor

__all__ = ["EurekaConfig", "DigitGrid", "ViT", "train", "train_spec"]


@dataclass
class EurekaConfig:
    attention: str = "softmax"  # "normsoftmax", or "qknorm" (LayerNorm on q and k per head)
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

    def __post_init__(self) -> None:
        if self.attention not in ("softmax", "normsoftmax", "qknorm"):
            raise ValueError(f"EurekaConfig(attention={self.attention!r}): expected 'softmax', 'normsoftmax' or "
                             "'qknorm'")


# ------------------------------------------------------------------ data


class DigitGrid:
    """2x2 grids of sklearn digits; cell 0 is the indicator, cell 1 + (indicator % candidates) the label (3
    candidates: any of the other cells; 2: the top-right or bottom-left one, the bottom-right cell a distractor)."""

    def __init__(self, held_out: float = 0.25, candidates: int = 3) -> None:
        if candidates not in (2, 3):
            raise ValueError(f"DigitGrid(candidates={candidates!r}): expected 2 or 3 candidate cells")
        self.candidates = candidates
        digits = load_digits()
        images = torch.tensor(digits.images / 16.0, dtype=torch.float32)  # (1797, 8, 8) in [0, 1]
        labels = torch.tensor(digits.target, dtype=torch.long)  # (1797,)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))  # fixed split
        n_val = int(held_out * len(labels))
        self.train_images, self.train_labels = images[order[n_val:]], labels[order[n_val:]]
        self.val_images, self.val_labels = images[order[:n_val]], labels[order[:n_val]]

    def compose(self, images: Tensor, labels: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        """idx (B, 4) digit indices -> grids (B, 16, 16) and labels (B,)."""
        cells = images[idx]  # (B, 4, 8, 8)
        top = torch.cat([cells[:, 0], cells[:, 1]], dim=2)  # (B, 8, 16)
        bottom = torch.cat([cells[:, 2], cells[:, 3]], dim=2)  # (B, 8, 16)
        grid = torch.cat([top, bottom], dim=1)  # (B, 16, 16)
        which = 1 + labels[idx[:, 0]] % self.candidates  # (B,) the cell the indicator names
        return grid, labels[idx.gather(1, which[:, None])[:, 0]]

    def batch(self, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.train_labels), (n, 4), generator=gen)
        return self.compose(self.train_images, self.train_labels, idx)

    def validation(self, n: int = 1000) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.val_labels), (n, 4), generator=torch.Generator().manual_seed(99))
        return self.compose(self.val_images, self.val_labels, idx)


# ------------------------------------------------------------------ model


class ViTAttention(SelfAttention):
    """The demo's attention (``hooks.demo.SelfAttention``) over every token, with softmax, NormSoftmax or QK-norm."""

    def __init__(self, cfg: EurekaConfig) -> None:
        super().__init__(cfg.n_embd, cfg.n_head, causal=False, qk_norm=cfg.attention == "qknorm")
        self.norm_softmax = cfg.attention == "normsoftmax"
        self.temperature = cfg.temperature

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.norm_softmax:
            return super().attend(q, k, v)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        s = s / (self.temperature * s.std(dim=-1, keepdim=True) + 1e-6)  # NormSoftmax
        return torch.softmax(s, dim=-1) @ v  # (B, H, T, D)


class ViT(nn.Module):
    """Patches of the 16x16 grid -> tokens, a class token, pre-LN blocks, a linear head on the class token."""

    def __init__(self, cfg: EurekaConfig) -> None:
        super().__init__()
        self.patch = cfg.patch
        n_tokens = (16 // cfg.patch) ** 2
        self.embed = nn.Linear(cfg.patch * cfg.patch, cfg.n_embd)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.n_embd))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n_tokens + 1, cfg.n_embd))
        self.blocks = nn.ModuleList(Block(cfg.n_embd, ViTAttention(cfg)) for _ in range(cfg.n_layer))
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


def train(cfg: EurekaConfig, logdir: str | Path | None = None, say: Callable[[str], None] | None = None, *,
          schedule: Schedule | None = None, observations: Path | None = None) -> EurekaRun:
    """Train one run with the Monitor attached; returns the closed Monitor, its records and the curves.

    ``schedule``: the learning rate of each step as a fraction of ``cfg.lr``; ``observations``: where the
    evaluation records what the detectors are given (:func:`evaluation.recording.recording`)."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    data = DigitGrid()
    model = ViT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    memory = MemorySink()
    monitor = Monitor(model, logdir=logdir, every=cfg.every, sinks=[memory], alerts=cfg.alerts)
    evaluate = Evaluation(cfg, model, data, monitor, say)
    with recording(monitor, observations):
        losses = train_steps(model, lambda: data.batch(cfg.batch_size, gen),
                             lambda batch: F.cross_entropy(model(batch[0]), batch[1]), optimizer, cfg.steps,
                             schedule=schedule or Schedule(), monitor=monitor, callbacks=(evaluate,))
    return EurekaRun(cfg, monitor, memory, losses, evaluate.evals)


class Evaluation:
    """After every ``cfg.eval_every``-th step and the last: the held-out loss and accuracy (``evals``), and a
    progress line to ``say``."""

    def __init__(self, cfg: EurekaConfig, model: ViT, data: DigitGrid, monitor: Monitor,
                 say: Callable[[str], None] | None) -> None:
        self.cfg, self.model, self.monitor, self.say = cfg, model, monitor, say
        self.val_x, self.val_y = data.validation()
        self.evals: list[tuple[int, float, float]] = []
        self.start = time.perf_counter()

    def __call__(self, step: int, losses: list[float]) -> None:
        if step % self.cfg.eval_every and step != self.cfg.steps - 1:
            return
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self.val_x)
        accuracy = (logits.argmax(-1) == self.val_y).float().mean().item()
        self.evals.append((step, F.cross_entropy(logits, self.val_y).item(), accuracy))
        if self.say is not None:
            recent = losses[-self.cfg.eval_every:]
            self.say(f"step {step:5d}  train loss {sum(recent) / len(recent):.3f}  val loss {self.evals[-1][1]:.3f}  "
                     f"val acc {accuracy:.3f}  qk/v grad ratio {_qk_ratio(self.monitor.last):.2f}  "
                     f"{time.perf_counter() - self.start:5.1f}s")


def train_spec(spec: RunSpec, out: Path) -> dict:
    """A ``RunSpec(task="vit")``: train it, recorded into ``out``; returns its every-step losses, its held-out
    evaluations and the no-indicator accuracy (:func:`blind_accuracy`)."""
    cfg = EurekaConfig(attention=spec.twin or "softmax", seed=spec.seed, steps=spec.steps, lr=spec.lr,
                       every=spec.every or 10, **spec.shape)
    run = train(cfg, schedule=spec.lr_schedule, observations=out / "observations.jsonl")
    return {"losses": run.losses, "evals": run.evals, "blind": blind_accuracy()}


# ------------------------------------------------------------------ analysis (definitions in docs/alerts.md)


def blind_accuracy(data: DigitGrid | None = None) -> float:
    """Validation accuracy of an oracle that knows the classes of the candidate cells but not the indicator.

    It answers the most frequent candidate class: right for sure when that class is the label and appears at
    least twice, 1/k in expectation when the k candidates' classes differ. This is the accuracy ceiling of the
    plateau.
    """
    data = data or DigitGrid()
    idx = torch.randint(len(data.val_labels), (1000, 4), generator=torch.Generator().manual_seed(99))
    _, label = data.compose(data.val_images, data.val_labels, idx)  # the same draws as validation()
    total = 0.0
    k = data.candidates
    for cands, y in zip(data.val_labels[idx[:, 1:1 + k]].tolist(), label.tolist()):
        top = max(set(cands), key=cands.count)
        total += 1.0 / k if len(set(cands)) == k else float(y == top)
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
    parser.add_argument("--attention", choices=("softmax", "normsoftmax", "qknorm"), default="softmax")
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
