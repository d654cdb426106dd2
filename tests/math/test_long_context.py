"""Attention statistics at long context, and the rank's eigenvalues solved for many calls at once.

Beyond ``entropy_rows`` query rows, the entropy, the uniform entropy and the sink share are read from that many
token rows spread through the sequence, and the max logit over every row in float32; the float64 statistics of
every row (themselves checked against per-head loops in ``test_math.py``) are the reference. The patterns are those
attention really takes: a sink on the first token, sparse heads attending to themselves, uniform heads, random ones.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from diag.math.attention import (
    LazyLogits,
    attention_logits,
    solve_ranks,
    spread_positions,
    spread_rows,
    stats_from_logits,
)

# The error the docs state (docs/metrics.md#attention-at-long-context) for 1,024 rows at 4k-8k tokens.
ENTROPY_ERROR = 0.08  # nats, absolute
NORMALISED_ERROR = 0.01  # entropy over uniform entropy, absolute
SINK_ERROR = 0.002  # share of the queries' mass
MAX_LOGIT_RTOL = 1e-5  # float32 against float64


def _patterns(t: int, d: int = 16, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (batch, 4, t, d): head 0 an attention sink on the first token, head 1 sparse (each query attends
    to its own key), head 2 uniform (q = 0), head 3 random."""
    g = torch.Generator().manual_seed(t)
    q, k = torch.randn(batch, 4, t, d, generator=g), torch.randn(batch, 4, t, d, generator=g)
    k[:, 0, 0] = 0.0
    k[:, 0, 0, 0] = 40.0
    q[:, 0, :, 0] = 1.0
    q[:, 1] = 3.0 * k[:, 1]
    q[:, 2] = 0.0
    return q, k


def _check(got, ref) -> None:
    assert (got.entropy - ref.entropy).abs().max() < ENTROPY_ERROR
    normalised = got.entropy / got.uniform_entropy - ref.entropy / ref.uniform_entropy
    assert normalised.abs().max() < NORMALISED_ERROR
    assert (got.sink - ref.sink).abs().max() < SINK_ERROR
    torch.testing.assert_close(got.sink_pos[0], ref.sink_pos[0])  # the sink head's key: the first token
    torch.testing.assert_close(got.max_logit, ref.max_logit, rtol=MAX_LOGIT_RTOL, atol=1e-6)
    torch.testing.assert_close(got.rank, ref.rank, rtol=1e-9, atol=0)  # the same rank rows either way


@pytest.mark.parametrize("t", [4096, 8192])
def test_long_context_statistics_within_the_stated_error_of_every_row_in_float64(t):
    q, k = _patterns(t)
    ref = stats_from_logits(LazyLogits(q, k, is_causal=True))  # every row, float64
    got = stats_from_logits(LazyLogits(q, k, is_causal=True), entropy_rows=1024)
    _check(got, ref)
    assert ref.sink[0] > 0.2 and ref.entropy[1] < 4 < 7 < ref.entropy[2]  # the patterns are what they say


def test_long_context_eager_logits_with_padding_within_the_stated_error():
    """Logits the model materialised (float32, the mask added as ``finfo.min``), with padded query rows: the
    spread rows are token rows only, and the padding counts for nothing."""
    t = 4096
    q, k = _patterns(t, batch=2)
    tokens = torch.ones(2, t, dtype=torch.bool)
    tokens[1, 3000:] = False  # right padding of the second sequence
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & tokens[:, None, :]
    mask = torch.where(allowed[:, None], 0.0, torch.finfo(torch.float32).min)
    logits = (attention_logits(q, k).float() + mask).float()  # (2, 4, t, t) as an eager model feeds its softmax
    ref = stats_from_logits(logits, query_valid=tokens)
    got = stats_from_logits(logits, query_valid=tokens, entropy_rows=1024)
    _check(got, ref)


def test_half_precision_logits_keep_their_mask_in_the_max_logit():
    """fp16 logits carry finfo(float16).min as the mask: the max logit in float32 still excludes those keys."""
    q, k = _patterns(512)
    logits = attention_logits(q, k, is_causal=True)
    logits = torch.where(torch.isinf(logits), torch.finfo(torch.float16).min, logits).half()
    ref = stats_from_logits(logits)
    got = stats_from_logits(logits, entropy_rows=64)
    torch.testing.assert_close(got.max_logit, ref.max_logit)


@pytest.mark.parametrize("k", [1, 2, 5, 64])
def test_spread_positions_pick_the_rows_spread_rows_picks_among_the_token_rows(k):
    g = torch.Generator().manual_seed(k)
    for n in (1, 3, 7, 64, 100):
        for density in (0.0, 0.2, 0.7, 1.0):
            valid = torch.rand(n, generator=g) < density
            tokens = valid.nonzero().flatten().tolist()
            expected = [tokens[j] for j in spread_rows(len(tokens), k)]
            positions, live = spread_positions(valid, n, k, "cpu")
            assert positions[live].tolist() == expected, (n, k, density)
            assert positions.shape == live.shape == (min(n, k),)
            centred = [tokens[int((j + 0.5) * len(tokens) / k)] for j in range(k)] if len(tokens) > k else tokens
            positions, live = spread_positions(valid, n, k, "cpu", centred=True)
            assert positions[live].tolist() == centred, (n, k, density)
        positions, live = spread_positions(None, n, k, "cpu")
        assert positions[live].tolist() == spread_rows(n, k)


class _Solvers(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "").startswith("linalg_eig")
        return func(*args, **(kwargs or {}))


def test_ranks_of_many_calls_solved_together_equal_each_solved_alone():
    g = torch.Generator().manual_seed(3)
    calls = [(torch.randn(2, 4, 48, 8, generator=g) * s, torch.randn(2, 2, 48, 8, generator=g)) for s in (0.3, 1, 4)]
    alone = [stats_from_logits(LazyLogits(q, k, is_causal=True), rank_rows=20) for q, k in calls]
    pending = [stats_from_logits(LazyLogits(q, k, is_causal=True), rank_rows=20, solve=False) for q, k in calls]
    assert all(s.rank is None and s.pending is not None for s in pending)
    with _Solvers() as one:
        solve_ranks(pending)
    assert one.calls == 1  # every call's Grams in one eigensolver call
    for a, b in zip(alone, pending):
        torch.testing.assert_close(b.rank, a.rank, rtol=1e-12, atol=0)
        assert b.pending is None
    split = [stats_from_logits(LazyLogits(q, k, is_causal=True), rank_rows=20, solve=False) for q, k in calls]
    with _Solvers() as budgeted:
        solve_ranks(split, solve_bytes=1)  # a budget below one call's Grams: one solver call per call
    assert budgeted.calls == 3
    for a, b in zip(alone, split):
        torch.testing.assert_close(b.rank, a.rank, rtol=1e-12, atol=0)
