"""The lines mean the same at any context: attention patterns built at 128, 512 and 1,024 tokens, measured as the
capture measures them (float64 statistics, the rank over rows spread through the context) and judged by the
states' entry tests, land in the same state; and the dwells, in steps, give the same episodes at any cadence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diag.detectors import Observation
from diag.detectors.config import StatesConfig
from diag.detectors.states import STATES, episodes_of
from diag.detectors.states import tests as state_tests
from diag.math.attention import attention_logits, stats_from_logits

BIG = 40.0  # a logit margin that puts a query's mass on its chosen keys


def causal_logits(t: int, chosen) -> torch.Tensor:
    """(1, 1, t, t) causal logits where row i puts its mass on the keys ``chosen(i)`` (equally)."""
    logits = attention_logits(torch.zeros(1, 1, t, 1), torch.zeros(1, 1, t, 1), is_causal=True).clone()
    for i in range(t):
        for j in chosen(i):
            if j <= i:
                logits[0, 0, i, j] += BIG
    return logits


PATTERNS = {
    # every query on the first token: an attention sink
    "sink": lambda i: [0],
    # the queries share three fixed positions (10, 30, 50), each query one of them in turn, as the collapsed heads
    # of the reproductions put theirs on a few fixed positions: sparse, low-rank, no key holding half the mass
    "malignant": lambda i: [[10, 30, 50][i % 3]] if i >= 50 else [0],
    # each query on the token before it: sparse and full-rank
    "benign": lambda i: [max(i - 1, 0)],
}


def state_of(t: int, name: str) -> str:
    stats = stats_from_logits(causal_logits(t, PATTERNS[name]), rank_rows=256)
    e, r, rows = stats.entropy.item(), stats.rank.item(), stats.rows.item()
    u, share = stats.uniform_entropy.item(), stats.sink.item()
    return next((s for s in STATES if state_tests(s, e, r, rows, u, StatesConfig(), share)[0]), "normal")


@pytest.mark.parametrize("t", [128, 512, 1024])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_a_pattern_is_the_same_state_at_every_context(name, t):
    assert state_of(t, name) == name


def test_uniform_attention_is_uniform_at_every_context():
    for t in (128, 512, 1024):
        stats = stats_from_logits(torch.zeros(1, 1, t, t), rank_rows=256)  # every query on every key alike
        assert stats.entropy.item() == pytest.approx(stats.uniform_entropy.item())
        assert state_tests("uniform", stats.entropy.item(), stats.rank.item(), stats.rows.item(),
                           stats.uniform_entropy.item(), StatesConfig())[0]
        assert stats.sink.item() == pytest.approx(1.0 / t)


def _layer(e, r):
    return {"attn_entropy": np.array(e, float), "attn_rank": np.array(r, float), "attn_rows": np.array([128.0]),
            "attn_entropy_uniform": np.array([4.0])}


@pytest.mark.parametrize("every", [1, 2, 5, 10])
def test_dwells_in_steps_give_the_same_episodes_at_any_cadence(every):
    """Both heads malignant from step 40 to 160, then recovered: at every cadence whose samples fall inside, the
    same episodes (since at the first sample inside, ended at the first sample outside), within one interval."""
    obs = [Observation(s, None, {"L00": _layer([0.1, 0.1], [2.0, 2.0]) if 40 <= s < 160 else
                                 _layer([3.0, 3.0], [60.0, 60.0])}) for s in range(0, 300) if s % every == 0]
    episodes = [(e.where, e.since, e.until) for e in episodes_of(obs, StatesConfig()) if e.state == "malignant"]
    assert [w for w, _, _ in episodes] == ["L00", "L00/H00", "L00/H01"]
    for _, since, until in episodes:
        assert 40 <= since < 40 + every and 160 <= until < 160 + every
