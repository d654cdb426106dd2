"""The pure math of diag against references and properties that follow from it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from diag.layouts.vocab import QKVLayout, split_qkv
from diag.math.attention import LazyLogits, attention_logits, stats_from_logits, stats_from_probabilities_reference
from diag.math.metrics import layer_spectra
from diag.math.spectral import (
    effective_rank,
    qk_singular_values,
    qk_singular_values_reference,
    spectral_energy_concentration,
    stable_rank,
)


def _weights(seed: int, heads: int, kv: int, d: int, e: int, cond: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(heads, d, e, generator=g)
    wk = torch.randn(kv, d, e, generator=g)
    if cond > 1:  # spread the singular values of each head's Wq over [1/cond, 1]
        u, _, vt = torch.linalg.svd(wq, full_matrices=False)
        s = torch.logspace(0, -math.log10(cond), d)
        wq = u @ torch.diag_embed(s.expand(heads, d)) @ vt
    return wq, wk


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    kv=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([2, 4, 8]),
    e=st.sampled_from([8, 16, 24]),
    cond=st.sampled_from([1.0, 1e3]),
)
def test_core_spectrum_equals_full_svd(seed, kv, d, e, cond):
    heads = 4
    wq, wk = _weights(seed, heads, kv, d, e, cond)
    got = qk_singular_values(wq, wk)
    for h in range(heads):
        ref = qk_singular_values_reference(wq[h], wk[h // (heads // kv)])
        torch.testing.assert_close(got[h], ref, rtol=1e-5, atol=1e-12 * float(ref[0]))


def test_scaling_wq_scales_every_singular_value():
    wq, wk = (w.double() for w in _weights(0, 4, 4, 8, 16))
    base = qk_singular_values(wq, wk)
    for c in (-3.0, 0.5, 7.0):
        torch.testing.assert_close(qk_singular_values(c * wq, wk), abs(c) * base, rtol=1e-10, atol=0)


def test_rotation_within_a_head_applied_to_q_and_k_leaves_the_spectrum():
    wq, wk = _weights(1, 4, 4, 8, 16)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    rot = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))).Q
    torch.testing.assert_close(qk_singular_values(wq[:, perm], wk[:, perm]), qk_singular_values(wq, wk))
    rotated = qk_singular_values((rot @ wq.double()), (rot @ wk.double()))
    torch.testing.assert_close(rotated, qk_singular_values(wq, wk), rtol=1e-10, atol=1e-12)


def test_degenerate_and_nonfinite_heads():
    wq, wk = _weights(4, 3, 3, 4, 8)
    wq[0] = 0.0  # a dead head: all singular values zero, no error
    wq[1, 0, 0] = math.nan
    sv = qk_singular_values(wq, wk)
    assert torch.equal(sv[0], torch.zeros(4, dtype=torch.float64))
    assert torch.isnan(sv[1]).all()
    torch.testing.assert_close(sv[2], qk_singular_values_reference(wq[2], wk[2]))


def test_spectrum_summaries_on_known_spectra():
    one = torch.tensor([2.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    flat = torch.ones(4, dtype=torch.float64)
    assert spectral_energy_concentration(one, 1) == 1.0
    assert spectral_energy_concentration(flat, 2) == 0.5
    assert effective_rank(one) == pytest.approx(1.0)
    assert effective_rank(flat) == pytest.approx(4.0)
    assert stable_rank(one) == 1.0
    assert stable_rank(flat) == 4.0


def test_layer_spectra_batched_over_layers_equal_one_at_a_time():
    layers = [_weights(s, 4, 2, 8, 16) for s in range(3)] + [_weights(3, 2, 2, 8, 16)]  # two shapes
    batched = layer_spectra(layers)
    for i, qk in enumerate(layers):
        (single,) = layer_spectra([qk])
        assert set(batched[i]) == set(single) == {"qk_sigma1", "qk_sec", "qk_erank", "qk_stable_rank", "qk_spectrum"}
        for name in single:
            torch.testing.assert_close(batched[i][name], single[name])


# ------------------------------------------------------------------ layouts


def test_fused_transposed_and_separate_packings_agree():
    h, g, d, e = 4, 2, 3, 12
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(rows, e, generator=gen) for rows in (h * d, g * d, g * d))
    separate = split_qkv({"q": q, "k": k, "v": v}, QKVLayout(h, d, q="q", k="k", v="v", n_kv_heads=g))
    fused = split_qkv({"w": torch.cat([q, k, v])}, QKVLayout(h, d, q="w", packing="fused", n_kv_heads=g))
    conv1d = split_qkv({"w": torch.cat([q, k, v]).T.contiguous()},
                       QKVLayout(h, d, q="w", packing="fused", n_kv_heads=g, transposed=True))
    for a, b, c in zip(separate, fused, conv1d):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert separate[0].shape == (h, d, e) and separate[1].shape == (g, d, e)


def test_per_head_interleaved_packing():
    h, d, e = 3, 2, 6
    w = torch.arange(h * 3 * d * e, dtype=torch.float32).reshape(h * 3 * d, e)
    q, k, v = split_qkv({"w": w}, QKVLayout(h, d, q="w", packing="fused_per_head"))
    for head in range(h):
        base = head * 3 * d
        assert torch.equal(q[head], w[base : base + d])
        assert torch.equal(k[head], w[base + d : base + 2 * d])
        assert torch.equal(v[head], w[base + 2 * d : base + 3 * d])


# ---------------------------------------------------------------- attention


def _sdpa_reference_output(q, k, v, **kw):
    logits = attention_logits(q, k, kw.get("scale"), kw.get("attn_mask"), kw.get("is_causal", False))
    p = torch.softmax(logits, -1)
    vv = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return p @ vv


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "gqa", "scale"])
def test_attention_logits_reproduce_sdpa(mask_kind):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    kw: dict = {}
    if mask_kind == "causal":
        kw["is_causal"] = True
    elif mask_kind == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 5, 5, generator=g) > 0.3
        kw["attn_mask"][..., 0] = True
    elif mask_kind == "additive":
        m = torch.zeros(2, 1, 5, 5)
        m[:, :, :, 3:] = torch.finfo(torch.float32).min
        kw["attn_mask"] = m
    elif mask_kind == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw["enable_gqa"] = True
    elif mask_kind == "scale":
        kw["scale"] = 1.0
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    kw.pop("enable_gqa", None)
    torch.testing.assert_close(_sdpa_reference_output(q, k, v, **kw), out.double(), rtol=1e-5, atol=1e-5)


def test_entropy_of_uniform_attention_is_log_n():
    logits = torch.zeros(1, 2, 6, 7)
    stats = stats_from_logits(logits)
    torch.testing.assert_close(stats.entropy, torch.full((2,), math.log(7), dtype=torch.float64))
    torch.testing.assert_close(stats.rank, torch.ones(2, dtype=torch.float64))  # all rows equal: rank 1


def test_causal_uniform_entropy_and_masked_rows_excluded():
    n = 5
    logits = attention_logits(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), is_causal=True)
    stats = stats_from_logits(logits)
    expected = sum(math.log(i + 1) for i in range(n)) / n
    assert stats.entropy.item() == pytest.approx(expected)
    logits[..., 2, :] = -math.inf  # a fully masked row counts for nothing
    stats = stats_from_logits(logits)
    expected = sum(math.log(i + 1) for i in range(n) if i != 2) / (n - 1)
    assert stats.entropy.item() == pytest.approx(expected)


def test_sparse_low_rank_versus_sparse_full_rank():
    n, big = 8, 60.0
    one_key = torch.zeros(1, 1, n, n)
    one_key[..., 0] = big  # every query looks at key 0: malignant pattern
    diagonal = torch.diag(torch.full((n,), big))[None, None]  # each query its own key: benign
    a, b = stats_from_logits(one_key), stats_from_logits(diagonal)
    assert a.entropy.item() < 1e-6 and b.entropy.item() < 1e-6
    assert a.rank.item() == pytest.approx(1.0, abs=1e-6)
    assert b.rank.item() == pytest.approx(n, abs=1e-6)
    assert a.max_logit.item() == big and a.rows.item() == n


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n_q=st.integers(1, 9), n_k=st.integers(1, 9), rank_rows=st.integers(1, 10))
def test_stats_match_per_head_loops(seed, n_q, n_k, rank_rows):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, n_q, n_k, generator=g) * 3
    allowed = torch.rand(2, n_q, n_k, generator=g) > 0.3
    masked = logits.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    if not allowed.any(-1).any():
        return
    stats = stats_from_logits(masked, rank_rows)
    probs = torch.softmax(masked.double(), -1)
    entropy, rank = stats_from_probabilities_reference(probs, allowed, rank_rows)
    torch.testing.assert_close(stats.entropy, entropy, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(stats.rank, rank, rtol=1e-6, atol=1e-9, equal_nan=True)  # no valid row: both NaN


def test_chunked_rows_equal_unchunked(monkeypatch):
    import diag.math.attention as A

    logits = torch.randn(2, 3, 40, 40, generator=torch.Generator().manual_seed(9))
    whole = stats_from_logits(logits, rank_rows=17)
    monkeypatch.setattr(A, "_CHUNK_BYTES", 8 * 3 * 40 * 7)  # 7 rows per chunk
    chunked = stats_from_logits(logits, rank_rows=17)
    for name in ("entropy", "rank", "max_logit", "rows", "sink", "sink_pos"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name))


@pytest.mark.parametrize("kind", ["gaussian", "low-rank", "sign"])
def test_top_singular_value_krylov_path_matches_full_svd(kind):
    from diag.math.norms import top_singular_value

    g = torch.Generator().manual_seed(11)
    w = torch.randn(3, 200, 300, generator=g)
    if kind == "low-rank":
        w = 0.01 * w + torch.randn(3, 200, 2, generator=g) @ torch.randn(3, 2, 300, generator=g)
    elif kind == "sign":  # Adam-like updates: a clustered spectrum, the slow case
        w = torch.sign(w)
    before = torch.get_rng_state()
    got = top_singular_value(w, exact_below=16)  # force the Krylov path
    assert torch.equal(before, torch.get_rng_state())  # a private generator: global RNG untouched
    ref = torch.linalg.matrix_norm(w.double(), ord=2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    assert (got <= ref * (1 + 1e-6)).all()  # a Ritz value does not overshoot (beyond float32 rounding)


def _adam_like_updates(seed: int, n: int = 6, rows: int = 192, cols: int = 160):
    """Weights near a random init and AdamW-like updates (sign-like, a flat spectrum: the slow case)."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(n, rows, cols, generator=g)
    m = torch.randn(n, rows, cols, generator=g) + 0.5 * torch.randn(n, rows, 2, generator=g) @ torch.randn(
        n, 2, cols, generator=g)
    return w, 1e-4 * m / (m.abs() + 1e-3)


def test_sigma1_warm_start_accurate_and_cheaper():
    from diag.math.norms import Sigma1

    sigma = Sigma1(rtol=1e-3, exact_below=64)
    dims = []
    for t in range(4):
        w, d = _adam_like_updates(t // 2)  # the same matrices twice, then new ones
        w = w + t * d
        got = sigma(w, key="w")
        dims.append(sigma.last_dim)
        ref = torch.linalg.matrix_norm(w.double(), ord=2)
        assert ((ref - got) / ref).abs().max() < 2e-3  # rtol=1e-3 between blocks: within 0.2% of the truth
        assert (got <= ref * (1 + 1e-6)).all()  # a Ritz value
    # warm from the previous call: no more blocks than the cold start, which begins with COLD_POWER block power
    # steps (without them a cold start takes 2-3x the blocks)
    assert dims[1] <= dims[0] and dims[3] <= dims[2]


def test_sigma1_nonfinite_matrix_is_nan_others_measured():
    from diag.math.norms import Sigma1

    w, _ = _adam_like_updates(3)
    w[1, 0, 0] = float("nan")
    got = Sigma1(exact_below=64)(w)
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3, 4, 5]]).all()


def test_sigma1_exact_path_nonfinite_matrices_are_nan_others_exact():
    from diag.math.norms import Sigma1

    w = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(3))
    w[1, 2, 3], w[3, 0, 0] = float("nan"), float("inf")
    got = Sigma1()(w)  # 24 <= exact_below: the exact path
    assert torch.isnan(got[1]) and torch.isnan(got[3])
    for i in (0, 2):
        assert float(got[i]) == float(torch.linalg.matrix_norm(w[i].double(), ord=2))


def test_update_tracker_matches_exact_per_matrix():
    from diag.math.updates import UpdateTracker

    g = torch.Generator().manual_seed(5)
    layers = [tuple(0.02 * torch.randn(4, 48, 160, generator=g) for _ in range(3)) for _ in range(3)]
    tracker = UpdateTracker(chunk_bytes=4 * 192 * 160 * 4)  # 4 matrices per chunk: chunks span layers
    for _ in range(2):
        snap = tracker.snapshot(layers)
        after = [tuple(w + 1e-4 * torch.sign(torch.randn(w.shape, generator=g)) for w in qkv) for qkv in layers]
        got = tracker.measure(snap, after)
        for i, (before, new) in enumerate(zip(layers, after)):
            for name, b, a in zip("qkv", before, new):
                b2, d2 = b.flatten(0, 1).double(), (a - b).flatten(0, 1).double()
                exact = torch.linalg.matrix_norm(d2, ord=2) / torch.linalg.matrix_norm(b2, ord=2)
                assert float(got[i][f"update_ratio_{name}"]) == pytest.approx(float(exact), rel=2e-3)
                fro = torch.linalg.matrix_norm(d2) / torch.linalg.matrix_norm(b2)
                assert float(got[i][f"update_fro_{name}"]) == pytest.approx(float(fro), rel=1e-6)
        layers = after


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per-head"])
def test_lazy_logits_equal_materialised(monkeypatch, causal, mask_kind):
    import diag.math.attention as A
    from diag.math.attention import LazyLogits

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 37, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g)
    mask = {
        None: None,
        "bool": torch.rand(2, 1, 37, 37, generator=g) > 0.3,
        "additive": torch.where(torch.rand(37, 37, generator=g) > 0.5, 0.0, torch.finfo(torch.float32).min),
        "per-head": torch.randn(2, 4, 37, 37, generator=g),
    }[mask_kind]
    whole = stats_from_logits(attention_logits(q, k, 0.3, mask, causal), 20)
    monkeypatch.setattr(A, "_CHUNK_BYTES", 8 * 4 * 37 * 5)  # 5 rows at a time
    lazy = stats_from_logits(LazyLogits(q, k, 0.3, (mask,), causal), 20)
    for name in ("entropy", "rank", "max_logit", "rows", "uniform_entropy", "maps"):
        torch.testing.assert_close(getattr(lazy, name), getattr(whole, name), equal_nan=True)


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_attention_rank_matches_svdvals_on_causal_blocks(scale):
    """The rank's Gram-eigenvalue route against svdvals on full-size causal attention blocks."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 128, 16, generator=g) * scale, torch.randn(2, 4, 128, 16, generator=g)
    stats = stats_from_logits(LazyLogits(q, k, is_causal=True))
    logits = attention_logits(q, k, is_causal=True)
    ranks = effective_rank(torch.linalg.svdvals(torch.softmax(logits, -1))).mean(0)
    torch.testing.assert_close(stats.rank, ranks, rtol=1e-6, atol=0)


@pytest.mark.parametrize("width", [0, 2, 9])
def test_spectra_of_heads_wider_than_the_model(width):
    """D > E (or E = 0): the Cholesky route fails and the QR route pads the missing D - E zeros."""
    g = torch.Generator().manual_seed(2)
    wq, wk = torch.randn(3, 4, width, generator=g), torch.randn(3, 4, width, generator=g)
    ref = torch.stack([qk_singular_values_reference(wq[h], wk[h]) for h in range(3)])
    ref = F.pad(ref, (0, 4 - ref.shape[-1]))
    torch.testing.assert_close(qk_singular_values(wq, wk), ref, rtol=1e-10, atol=1e-12)
