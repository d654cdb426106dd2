"""One training run of the evaluation, described by a :class:`RunSpec`, trained and recorded.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs lm --seed 0 --lr 5e-3 --steps 300 --out runs/eval
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs lm --seed 0 --lr 5e-3 --steps 300 --qk-norm --out runs/eval

Tasks:

* ``lm``: the demo's character-level GPT (``hooks.demo``: 4 layers of 2 heads, d_model 128, context 128,
  batch 16, AdamW betas 0.9/0.95, weight decay 0.1) on the standard library's source (``--corpus stdlib``) or
  on the English text of Python's own documentation (``--corpus pydoc``: ``pydoc_data.topics``), with a
  constant learning rate or a linear warmup then cosine decay, optionally with QK-norm (LayerNorm on q and k
  per head: the twin that cannot collapse) and at another width and depth. The collapse reproduction.
* ``vit``: the Eureka task's ViT (:mod:`evaluation.eureka`): softmax or NormSoftmax attention, any learning
  rate and warmup, optionally QK-norm; the Eureka reproduction, and at a high learning rate without warmup
  a ViT that may collapse.
* ``hf``: a Hugging Face model built from a config (:mod:`evaluation.healthy`): GPT-2, LLaMA with grouped-query
  attention, a BERT-style masked language model, a ViT classifier; optionally NormSoftmax attention (the
  causal twin of a language-model plateau).

Each run is recorded with the Monitor at ``every=1`` (``hf``: at the default cadence, the Monitor as a user
attaches it), its detectors wrapped by a :class:`evaluation.record.Recorder` that writes every observation to
``observations.jsonl``; ``run.json`` holds the spec, every step's loss and learning rate, and the task's own
outcome (held-out accuracy for the Eureka task). The detectors are replayed offline on these files
(:mod:`evaluation.detectors`) for any threshold and any coarser cadence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evaluation.record import Recorder
from hooks import Monitor

__all__ = ["RunSpec", "record", "lr_factor"]


@dataclass(frozen=True)
class RunSpec:
    task: str  # "lm", "vit" or "hf"
    seed: int
    lr: float
    steps: int
    warmup: int = 0
    schedule: str = "constant"  # or "cosine": linear warmup, then cosine decay to 0
    twin: str = ""  # "", "qknorm" (LayerNorm on q and k per head) or "normsoftmax"
    layers: int = 0  # 0: the task's default shape
    heads: int = 0
    width: int = 0
    corpus: str = "stdlib"  # lm: "stdlib" or "pydoc"
    context: int = 0  # lm: the context length (0: the demo's 128)
    model: str = ""  # hf: "gpt2", "llama", "bert", "modernbert" or "vit"
    threads: int = 1  # torch threads: another reduction order gives the same run other rounding
    every: int = 1  # the Monitor's interval (hf: 0, the default cadence)

    def __post_init__(self) -> None:
        if self.task not in ("lm", "vit", "hf"):
            raise ValueError(f"RunSpec.task={self.task!r}: expected 'lm', 'vit' or 'hf'")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"RunSpec.schedule={self.schedule!r}: expected 'constant' or 'cosine'")
        if self.twin not in ("", "qknorm", "normsoftmax"):
            raise ValueError(f"RunSpec.twin={self.twin!r}: expected '', 'qknorm' or 'normsoftmax'")

    @property
    def name(self) -> str:
        """A folder name that says what differs from the task's default, and the seed."""
        parts = [self.task if self.task != "hf" else f"hf-{self.model}", f"lr{self.lr:g}"]
        if self.warmup:
            parts.append(f"w{self.warmup}")
        if self.schedule != "constant":
            parts.append(self.schedule)
        if self.twin:
            parts.append(self.twin)
        if self.layers or self.heads or self.width:
            parts.append(f"{self.layers}x{self.heads}x{self.width}")
        if self.corpus != "stdlib":
            parts.append(self.corpus)
        if self.context:
            parts.append(f"ctx{self.context}")
        if self.threads != 1:
            parts.append(f"t{self.threads}")
        return "-".join(parts) + f"-s{self.seed}"

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def lr_factor(spec: RunSpec, step: int) -> float:
    """The learning rate of ``step`` as a fraction of ``spec.lr``."""
    warm = min(1.0, (step + 1) / spec.warmup) if spec.warmup else 1.0
    if spec.schedule == "constant" or step < spec.warmup:
        return warm
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class QKNormAttention(nn.Module):
    """A nanoGPT-style attention (fused ``c_attn``) with QK-norm (Dehghani et al. 2023): LayerNorm on q and k
    per head. ``causal``: the language model's mask; otherwise full attention (the ViT)."""

    def __init__(self, base: nn.Module, head_dim: int, causal: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = base.c_attn, base.c_proj, base.n_head
        self.q_norm, self.k_norm = nn.LayerNorm(head_dim), nn.LayerNorm(head_dim)
        self.causal = causal

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


def corpus(name: str) -> str:
    """The text of a corpus: the standard library's source, or the English of Python's documentation."""
    if name == "stdlib":
        from hooks.demo import load_text

        return load_text()
    if name == "pydoc":
        import pydoc_data.topics

        return "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    raise ValueError(f"unknown corpus {name!r}: expected 'stdlib' or 'pydoc'")


def _monitor(model: nn.Module, spec: RunSpec, out: Path) -> Monitor:
    every = spec.every or None
    monitor = Monitor(model, every=every)
    monitor.detectors = Recorder(monitor.detectors, out / "observations.jsonl")
    return monitor


def train_lm(spec: RunSpec, out: Path) -> dict:
    from hooks.demo import GPT, GPTConfig, get_batch

    text = corpus(spec.corpus)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)  # (N,)
    shape = {k: v for k, v in (("n_layer", spec.layers), ("n_head", spec.heads), ("n_embd", spec.width),
                               ("block_size", spec.context)) if v}
    cfg = GPTConfig(vocab_size=len(chars), **shape)
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    model = GPT(cfg)
    if spec.twin == "qknorm":
        for block in model.h:
            block.attn = QKNormAttention(block.attn, cfg.n_embd // cfg.n_head, causal=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(spec, s))
    monitor = _monitor(model, spec, out)
    losses = []
    try:
        model.train()
        for step in range(spec.steps):
            x, y = get_batch(data, cfg, gen)
            loss = model(x, y)
            loss.backward()
            monitor.step(step, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(loss.item())
    finally:
        monitor.close()
        monitor.detectors.close()  # the recorder's file, after the update sample Monitor.close judged
    return {"losses": losses}


def train_vit(spec: RunSpec, out: Path) -> dict:
    from evaluation import eureka

    shape = {k: v for k, v in (("n_layer", spec.layers), ("n_head", spec.heads), ("n_embd", spec.width)) if v}
    cfg = eureka.EurekaConfig(attention="normsoftmax" if spec.twin == "normsoftmax" else "softmax",
                              seed=spec.seed, steps=spec.steps, lr=spec.lr, every=spec.every or 10, **shape)
    run = eureka.train(cfg, lr_factor=lambda s: lr_factor(spec, s), qk_norm=spec.twin == "qknorm",
                       wrap=lambda det: Recorder(det, out / "observations.jsonl"))
    return {"losses": run.losses, "evals": run.evals, "blind": eureka.blind_accuracy()}


def train_hf(spec: RunSpec, out: Path) -> dict:
    from evaluation import healthy

    return healthy.train_spec(spec, out)


TRAIN = {"lm": train_lm, "vit": train_vit, "hf": train_hf}


class Claimed(RuntimeError):
    """The run's folder is being recorded by another living process (two plans over one folder)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def claim(out: Path) -> None:
    """Claim ``out`` for this process: ``.claim`` holds the claimer's process id. A claim whose process is
    gone (a killed or crashed recording) is taken over; one whose process lives raises :class:`Claimed`, and
    so does an empty one (written by an older plan, or being written this instant), which names the file to
    remove when no plan is recording."""
    path = out / ".claim"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            text = path.read_text().strip() if path.exists() else ""
            if not text.isdigit():
                raise Claimed(f"{path} exists and names no process (an older plan's claim, or one being written): "
                              f"remove it if no plan is recording into {out.parent}") from None
            if _alive(int(text)):
                raise Claimed(f"{out.name} is being recorded by process {text} ({path})") from None
            path.unlink(missing_ok=True)  # its recorder is gone: take the run over
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return
    raise Claimed(f"{path} was claimed again while this process took over a stale claim")


def record(spec: RunSpec, root: Path) -> Path:
    """Train ``spec`` and record it into ``root / spec.name`` (``run.json`` last: a folder without it is
    incomplete and is recorded again). Raises :class:`Claimed` when another living process records it."""
    out = root / spec.name
    if (out / "run.json").exists():  # recorded meanwhile (another plan process)
        return out
    out.mkdir(parents=True, exist_ok=True)
    claim(out)
    torch.set_num_threads(spec.threads)
    result = TRAIN[spec.task](spec, out)
    lrs = [spec.lr * lr_factor(spec, s) for s in range(spec.steps)]
    (out / "run.json").write_text(json.dumps({"config": asdict(spec), "lrs": lrs, **result}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("lm", "vit", "hf"))
    parser.add_argument("--out", type=Path, required=True, help="the folder of runs; this one goes in a sub-folder")
    for f in fields(RunSpec):
        if f.name == "task":
            continue
        kind = type(f.default)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "twin":
            parser.add_argument("--qk-norm", dest="twin", action="store_const", const="qknorm", default="")
            parser.add_argument("--normsoftmax", dest="twin", action="store_const", const="normsoftmax")
        elif f.name in ("seed", "lr", "steps"):
            parser.add_argument(flag, type=float if f.name == "lr" else int, required=True)
        else:
            parser.add_argument(flag, type=kind, default=f.default)
    args = vars(parser.parse_args())
    root = args.pop("out")
    try:
        print(record(RunSpec(**args), root))
    except Claimed as error:
        raise SystemExit(f"not recorded: {error}") from None


if __name__ == "__main__":
    main()
