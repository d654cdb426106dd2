"""Slow, obviously correct references shared by the test files: one copy of each hand computation.

The max attention logit, by hand: the largest of a head's float64 logits over the keys each query may see,
from logits each test recomputes its own way (per family: the module's recorded inputs, hand-sliced weights,
RoPE and biases), compared with the Monitor's ``attn_max_logit/<layer>/H<h>`` scalars.
"""

from __future__ import annotations

import math

import pytest
import torch


def max_logit_by_hand(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[float]:
    """Per head, the largest logit over allowed (query, key) pairs: logits (N, H, Q, K) float64; allowed
    (N, Q, K) or (N, 1, Q, K) bool, None when every pair is allowed (or the excluded ones are already -inf).
    A loop over heads, one ``max`` each."""
    if allowed is not None:
        logits = logits.masked_fill(~(allowed if allowed.dim() == 4 else allowed[:, None]), -math.inf)
    return [logits[:, h].max().item() for h in range(logits.shape[1])]


def assert_max_logits(scalars: dict[str, float], label: str, logits: torch.Tensor, allowed: torch.Tensor | None = None,
                      rel: float = 1e-4, abs: float = 0.0) -> None:  # noqa: A002 - pytest.approx's name
    """Every head's ``attn_max_logit/<label>/H<h>`` equals :func:`max_logit_by_hand` to ``rel`` (and ``abs``)."""
    for h, ref in enumerate(max_logit_by_hand(logits, allowed)):
        got = scalars[f"attn_max_logit/{label}/H{h:02d}"]
        assert got == pytest.approx(ref, rel=rel, abs=abs), (label, h, got, ref)
