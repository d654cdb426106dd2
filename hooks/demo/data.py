"""The demo's data: the Python standard library's own source as characters (no download), and random batches."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from hooks.demo.model import GPTConfig

__all__ = ["MAX_CHARS", "load_text", "get_batch"]

MAX_CHARS = 2_000_000


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
