"""Train one configuration once and record what the detectors saw, for offline replay.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.record collapse --seed 0 --lr 5e-3 --out runs/eval/c0
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.record eureka --seed 0 --steps 1200 --out runs/eval/e0

The Monitor samples at ``--every`` (default 1: every step); its detectors are wrapped by a
recorder that appends every :class:`~diag.detectors.Observation` to ``observations.jsonl``.
``evaluation/detectors.py`` then replays the detectors over these files for any
threshold choice and any coarser sampling interval (keep the observations whose step is a
multiple of ``k``: exactly what a Monitor at ``every=k`` would have passed them, since each
sample measures the step it samples and the update ratio of the step right after it).

Also written: ``run.json`` (the configuration, every step's training loss and, for the Eureka
task, the held-out evaluations ``(step, loss, accuracy)`` and the no-indicator accuracy).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diag.detectors import Observation


class Recorder:
    """Wraps the Monitor's detectors: every observation is appended to a JSONL file, then judged."""

    def __init__(self, inner, path: Path) -> None:
        self.inner, self.path = inner, path
        self.file = path.open("w")

    def observe(self, obs: Observation) -> list:
        self._write(obs)
        return self.inner.observe(obs)

    def _write(self, obs: Observation) -> None:
        layers = {label: {k: [None if not math.isfinite(x) else x for x in np.asarray(v, float).tolist()]
                          for k, v in m.items()} for label, m in obs.layers.items()}
        self.file.write(json.dumps({"step": obs.step, "loss": obs.loss, "layers": layers}) + "\n")
        self.file.flush()

    def observe_updates(self, obs: Observation) -> list:
        """The update ratios of a step after a sample (the Monitor's shared, collective-free path): recorded too."""
        self._write(obs)
        return getattr(self.inner, "observe_updates", self.inner.observe)(obs)

    def __getattr__(self, name: str):  # the rest of the detectors' interface (cfg, wants_attention, ...)
        if name.startswith("__") or name == "inner":  # copy/pickle look these up before __init__ has run
            raise AttributeError(name)
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def load_observations(path: Path) -> list[Observation]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        layers = {label: {k: np.array([math.nan if x is None else x for x in v], float) for k, v in m.items()}
                  for label, m in r["layers"].items()}
        out.append(Observation(r["step"], r["loss"], layers))
    return out


class QKNormAttention(nn.Module):
    """The demo's causal attention with QK-norm (Dehghani et al. 2023): LayerNorm on q and k per head."""

    def __init__(self, base: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = base.c_attn, base.c_proj, base.n_head
        self.q_norm, self.k_norm = nn.LayerNorm(head_dim), nn.LayerNorm(head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


def record_collapse(args: argparse.Namespace, out: Path) -> dict:
    """The demo GPT (hooks.demo.train), its Monitor's detectors wrapped by a Recorder."""
    import hooks.demo.loop as demo  # the training loop looks GPT and Monitor up in its own module

    original_gpt, original_monitor = demo.GPT, demo.Monitor

    def build(cfg):
        model = original_gpt(cfg)
        if args.qk_norm:
            for block in model.h:
                block.attn = QKNormAttention(block.attn, cfg.n_embd // cfg.n_head)
        return model

    def monitor(model, logdir, every, **kwargs):  # kwargs: the demo's overwrite= (no logdir here)
        # zero configuration, QK-norm included: discovery sees the q_norm/k_norm children and checks shapes only
        # (a norm between the projection and the kernel changes q's values; docs/alerts.md#evaluation)
        m = original_monitor(model, logdir=None, every=every)
        m.detectors = Recorder(m.detectors, out / "observations.jsonl")
        return m

    demo.GPT, demo.Monitor = build, monitor
    try:
        ns = demo.DemoRun(lr=args.lr, warmup=args.warmup, quiet=True, logdir=out, seed=args.seed, every=args.every,
                          steps=args.steps)
        cfg = demo.GPTConfig(block_size=args.context) if args.context else None
        _, losses = demo.train(ns, cfg)
    finally:
        demo.GPT, demo.Monitor = original_gpt, original_monitor
    return {"losses": losses}


def record_eureka(args: argparse.Namespace, out: Path) -> dict:
    from evaluation import eureka

    original = eureka.Monitor

    def monitor(model, logdir, every, sinks, alerts):
        m = original(model, logdir=None, every=every, sinks=sinks, alerts=alerts)
        m.detectors = Recorder(m.detectors, out / "observations.jsonl")
        return m

    eureka.Monitor = monitor
    try:
        cfg = eureka.EurekaConfig(attention=args.attention, seed=args.seed, steps=args.steps, lr=args.lr,
                                  every=args.every, eval_every=args.eval_every)
        run = eureka.train(cfg)
    finally:
        eureka.Monitor = original
    return {"losses": run.losses, "evals": run.evals, "blind": eureka.blind_accuracy()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("collapse", "eureka"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0, help="collapse: linear warmup steps")
    parser.add_argument("--qk-norm", action="store_true", help="collapse: LayerNorm on q and k")
    parser.add_argument("--context", type=int, default=0, help="collapse: context length (default 128)")
    parser.add_argument("--attention", choices=("softmax", "normsoftmax"), default="softmax")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (another reduction order: the same seed's run to other rounding)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    if args.task == "collapse":
        args.lr = 5e-3 if args.lr is None else args.lr
        args.steps = args.steps or 300
        result = record_collapse(args, out)
    else:
        args.lr = 1e-3 if args.lr is None else args.lr
        args.steps = args.steps or 2000
        result = record_eureka(args, out)
    (out / "run.json").write_text(json.dumps({"config": vars(args), **result}))


if __name__ == "__main__":
    main()
