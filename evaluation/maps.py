"""The full attention maps of a training run, measured at every step for the ground truth of the attention states.

The ground truth (:mod:`evaluation.groundtruth`) reads the attention maps themselves, not the Monitor's per-head
statistics (entropy, effective rank, sink share: computed by ``diag/math/attention.py``, the detectors' own
code). :class:`MapRecorder` recomputes every attention map of the demo's GPT (:class:`hooks.demo.SelfAttention`)
at each training forward, from the module's input and its own weights (``softmax(q k^T / sqrt(d_head))``, causal
where the module is), and keeps of each map what the truth's definition can ask, at fixed levels
(:func:`measure`): how much of each query's mass its top keys hold, how many key columns hold the mass of all
queries, how evenly each query spreads its mass, and the share of one key position shared by every sequence.
``attention.npz`` holds them per step, layer and head (:func:`load_maps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["COLUMN_MASS", "EVEN", "MapRecorder", "Maps", "TOP_KEYS", "TOP_MASS", "demo_attention", "load_maps",
           "measure", "save_maps"]

TOP_KEYS = (1, 2, 3, 4, 6, 8, 12, 16)  # a query's top keys ...
TOP_MASS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)  # ... holding at least this much of its mass
COLUMN_MASS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # the key columns that hold this much of all queries' mass
EVEN = (0.6, 0.7, 0.8, 0.9, 0.95)  # a query's entropy, as a share of uniform attention's over the keys it sees
SEQS = 4  # the sequences of each batch whose maps are measured
KEYS = ("focused", "columns", "even", "shared")  # what is kept of each map, per head
DEMO_ATTENTION = ("c_attn", "n_head", "causal", "q_norm", "k_norm")  # what hooks.demo.SelfAttention has


@dataclass
class Maps:
    """A run's map measurements: ``steps`` (N,), per layer label (N, H, ...) arrays, and the rows (queries)."""

    steps: np.ndarray  # (N,)
    focused: dict[str, np.ndarray]  # (N, H, len(TOP_KEYS), len(TOP_MASS)): share of queries whose top keys hold it
    columns: dict[str, np.ndarray]  # (N, H, len(COLUMN_MASS)): key columns holding that share of all the mass
    even: dict[str, np.ndarray]  # (N, H, len(EVEN)): share of queries spreading their mass at least that evenly
    shared: dict[str, np.ndarray]  # (N, H): the largest share of all mass on one key position, in every sequence
    rows: dict[str, int]  # queries per map

    @property
    def layers(self) -> list[str]:
        return sorted(self.focused)


def measure(probs: Tensor, causal: bool) -> dict[str, Tensor]:
    """What the truth's definition reads of one layer's attention maps ``probs`` (S, H, T, K) (S sequences, T
    queries, K keys; each row sums to 1), per head. A query counts for a statistic of its top ``m`` keys only
    when it sees more than ``m`` keys (a causal map's first queries cannot spread), and for ``even`` when it sees
    at least 2."""
    p = probs.double()  # (S, H, T, K)
    s, h, t, k = p.shape
    seen = torch.arange(1, t + 1, dtype=p.dtype) if causal else torch.full((t,), float(k), dtype=p.dtype)  # (T,)
    most = min(max(TOP_KEYS), k)
    top = probs.float().topk(most, dim=-1).values.double().cumsum(-1)  # (S, H, T, most)
    index = torch.tensor([min(m, most) - 1 for m in TOP_KEYS])
    held = top[..., index]  # (S, H, T, M)
    counted = (seen[:, None] > torch.tensor(TOP_KEYS, dtype=p.dtype)).to(p.dtype)  # (T, M)
    passes = (held[..., None] >= torch.tensor(TOP_MASS, dtype=p.dtype) - 1e-12).to(p.dtype)  # (S, H, T, M, V)
    focused = (passes * counted[:, :, None]).sum((0, 2)) / (s * counted.sum(0)).clamp(min=1)[:, None]  # (H, M, V)
    column = p.sum(2) / t  # (S, H, K): each key column's share of all queries' mass
    cumulative = column.sort(-1, descending=True).values.cumsum(-1)  # (S, H, K)
    levels = torch.tensor(COLUMN_MASS, dtype=p.dtype)
    columns = ((cumulative[..., None] < levels - 1e-12).sum(-2) + 1).to(p.dtype).mean(0)  # (H, P)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # (S, H, T)
    spread = seen >= 2  # (T,)
    ratio = entropy[..., spread] / seen[spread].log()  # (S, H, T')
    even = (ratio[..., None] >= torch.tensor(EVEN, dtype=p.dtype)).to(p.dtype).mean((0, 2))  # (H, V)
    shared = column.min(0).values.max(-1).values  # (H,)
    return {"focused": focused, "columns": columns, "even": even, "shared": shared}


def demo_attention(module: nn.Module, x: Tensor) -> Tensor:
    """The attention maps (B, nh, T, T) that a :class:`hooks.demo.SelfAttention` computes on its input ``x``
    (B, T, C): its own q and k (QK-norm where it has it), ``softmax(q k^T / sqrt(d_head))``, causal where it is."""
    b, t, c = x.shape
    n = module.n_head
    q, k, _ = module.c_attn(x).split(c, dim=2)  # 2 x (B, T, C)
    q, k = (z.view(b, t, n, c // n).transpose(1, 2) for z in (q, k))  # (B, nh, T, hs)
    if module.q_norm is not None:
        q, k = module.q_norm(q), module.k_norm(k)
    logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(c // n)  # (B, nh, T, T)
    if module.causal:
        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)


class MapRecorder:
    """Measures every attention map of a demo GPT (or ViT) at every training forward and writes them to ``path``
    (``attention.npz``) at :meth:`close`. Its hooks run before any other hook of the attention modules (before
    the Monitor's capture enters its mode), under no_grad: the training run computes exactly what it would."""

    def __init__(self, model: nn.Module, path: Path) -> None:
        self.path = path
        self.modules = [m for m in model.modules() if all(hasattr(m, a) for a in DEMO_ATTENTION)]
        if not self.modules:
            raise ValueError(f"MapRecorder: {type(model).__name__} has no hooks.demo.SelfAttention; it reads the "
                             "demo's GPT and ViT only")
        n = len(self.modules)
        self.labels = [f"L{i:0{max(2, len(str(n - 1)))}d}" for i in range(n)]
        self.steps: list[int] = []
        self.rows: dict[str, int] = {}
        self.samples: dict[str, list[dict[str, np.ndarray]]] = {label: [] for label in self.labels}
        self.handles = [m.register_forward_pre_hook(self._hook(i), prepend=True) for i, m in enumerate(self.modules)]

    def _hook(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if not module.training or not torch.is_grad_enabled():
                return
            if index == 0:
                self.steps.append(len(self.steps))
            with torch.no_grad():
                probs = demo_attention(module, args[0][:SEQS])
                got = measure(probs, module.causal)
            label = self.labels[index]
            self.rows[label] = probs.shape[-2]
            self.samples[label].append({k: v.float().numpy() for k, v in got.items()})
        return hook

    def close(self) -> None:
        """Remove the hooks and write the file."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        stacked = {key: {label: np.stack([s[key] for s in samples]) for label, samples in self.samples.items()}
                   for key in KEYS}
        save_maps(Maps(np.array(self.steps), **stacked, rows=dict(self.rows)), self.path)


def save_maps(maps: Maps, path: Path) -> None:
    arrays: dict[str, np.ndarray] = {"steps": maps.steps}
    for label in maps.layers:
        for key in KEYS:
            arrays[f"{label}/{key}"] = getattr(maps, key)[label]
        arrays[f"{label}/rows"] = np.array(maps.rows[label])
    np.savez_compressed(path, **arrays)


def load_maps(path: Path) -> Maps:
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    labels = sorted({k.split("/")[0] for k in data if "/" in k})
    return Maps(data["steps"], *({label: data[f"{label}/{key}"] for label in labels} for key in KEYS),
                {label: int(data[f"{label}/rows"]) for label in labels})
