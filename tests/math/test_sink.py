"""The sink share (``attn_sink``, ``attn_sink_pos``) and the rank's rows spread through the context, against
per-head loops in float64 and against patterns worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diag.math.attention import attention_logits, sink_reference, spread_rows, stats_from_logits


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_q=st.integers(1, 9), n_k=st.integers(1, 9), padded=st.booleans())
def test_sink_share_matches_per_head_loops(seed, n_q, n_k, padded):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, n_q, n_k, generator=g) * 3
    allowed = torch.rand(2, n_q, n_k, generator=g) > 0.3
    valid = torch.rand(2, n_q, generator=g) > 0.3 if padded else None
    masked = logits.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    stats = stats_from_logits(masked, query_valid=valid)
    sink, pos = sink_reference(torch.softmax(masked.double(), -1), allowed, valid)
    torch.testing.assert_close(stats.sink, sink, rtol=1e-6, atol=1e-9, equal_nan=True)  # no valid row: both NaN
    known = ~torch.isnan(sink)
    assert torch.equal(stats.sink_pos[known], pos[known])


def _from_probabilities(p: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax is ``p`` (zeros become -inf: excluded keys)."""
    return p.log()


def test_a_sink_shared_by_every_sequence_holds_nearly_all_the_mass():
    n = 16
    p = torch.full((2, 1, n, n), 0.02 / (n - 1))
    p[..., 0] = 0.98  # every query of both sequences on key 0
    stats = stats_from_logits(_from_probabilities(p))
    assert stats.sink.item() == pytest.approx(0.98)
    assert stats.sink_pos.item() == 0


def test_a_key_at_another_position_in_each_sequence_is_no_shared_sink():
    """Every query of sequence 0 on key 3, of sequence 1 on key 5 (a token at different positions): per
    sequence one key holds the mass, but no position holds it in both, so the share halves."""
    n = 8
    p = torch.full((2, 1, n, n), 1e-12)
    p[0, :, :, 3] = 1.0
    p[1, :, :, 5] = 1.0
    stats = stats_from_logits(_from_probabilities(p / p.sum(-1, keepdim=True)))
    assert stats.sink.item() == pytest.approx(0.5, abs=1e-9)


def test_causal_attention_to_oneself_spreads_the_mass_over_every_key():
    n = 10
    logits = attention_logits(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), is_causal=True)
    logits = logits + torch.diag(torch.full((n,), 50.0)).double()  # each query on its own key
    stats = stats_from_logits(logits)
    assert stats.sink.item() == pytest.approx(1.0 / n, abs=1e-6)  # key j holds row j's mass only


def test_spread_rows_take_the_first_and_the_last_row_evenly():
    assert spread_rows(10, 4) == [0, 3, 6, 9]
    assert spread_rows(3, 8) == [0, 1, 2]
    assert spread_rows(100, 1) == [0]
    rows = spread_rows(4096, 256)
    assert len(rows) == 256 and rows[0] == 0 and rows[-1] == 4095
    assert max(b - a for a, b in zip(rows, rows[1:])) <= math.ceil(4095 / 255)


def test_the_rank_reads_rows_from_the_whole_context_not_its_prefix():
    """A causal head whose first 32 rows all look at key 0 and whose later rows each look at themselves: the
    prefix of 8 rows has rank 1; rows spread through the context see the later, full-rank part too."""
    n, big = 64, 60.0
    logits = attention_logits(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), is_causal=True).clone()
    logits[..., :32, 0] += big
    later = torch.arange(32, n)
    logits[0, 0, later, later] += big
    stats = stats_from_logits(logits, rank_rows=8)
    picked = spread_rows(n, 8)  # 0, 9, 18, 27 look at key 0; 36, 45, 54, 63 at themselves
    assert sum(r >= 32 for r in picked) == 4
    # singular values: 2 (four equal rows e_0) and 1, 1, 1, 1 (four rows e_i): effective rank exp(H(s / sum s))
    shares = torch.tensor([2.0, 1, 1, 1, 1]) / 6
    assert stats.rank.item() == pytest.approx(math.exp(-(shares * shares.log()).sum().item()), rel=1e-6)
    assert stats.rows.item() == 8
    assert stats_from_logits(logits[..., :8, :], rank_rows=8).rank.item() == pytest.approx(1.0)  # the prefix
