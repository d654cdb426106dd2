"""The demo's data: the Python standard library's own source as characters (no download), and random batches."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from diag.errors import DiagError
from hooks.demo.model import GPTConfig

__all__ = ["MAX_CHARS", "encode", "get_batch", "load_text"]

MAX_CHARS = 2_000_000


def load_text(max_chars: int = MAX_CHARS) -> str:
    """The standard library's ``.py`` files next to ``os``, sorted by name, the first ``max_chars``."""
    folder = Path(os.__file__).parent
    parts, total = [], 0
    for path in sorted(folder.glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if len(text) < min(max_chars, 100_000):  # a Python whose standard library ships compiled or zipped only
        raise DiagError(f"the demo trains on the Python standard library's own source, but {folder} holds only "
                        f"{len(text)} characters of .py files (this Python ships its library compiled or zipped); "
                        "run the demo with a CPython that has its .py sources, e.g. python.org's or a distribution's "
                        "full python3 package")
    return text


def encode(text: str) -> tuple[Tensor, int]:
    """``text`` as character ids, the characters numbered in sorted order, and the vocabulary's size."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    return torch.tensor([stoi[ch] for ch in text], dtype=torch.long), len(chars)  # (N,)


def get_batch(data: Tensor, cfg: GPTConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ix = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=gen).tolist()
    x = torch.stack([data[i : i + cfg.block_size] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + cfg.block_size] for i in ix])  # (B, T): next characters
    return x, y
