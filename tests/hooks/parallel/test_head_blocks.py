"""Which heads a tensor-parallel rank holds and which of them it computes (hooks/parallel/heads.py,
hooks/parallel/work.py); the placements themselves are exercised under torchrun in
tests/hooks/parallel/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout, split_qkv
from hooks.parallel.heads import _local_layout
from hooks.parallel.work import _chunk, work_of

GQA = QKVLayout(8, 4, "q", "k", "v", n_kv_heads=4, o="o")


def test_a_rank_block_of_a_gqa_layout():
    """Rank i of 2 holds query heads 4i..4i+3 and key/value heads 2i, 2i+1: its layout has 4 and 2 of them."""
    local = _local_layout("attn", GQA, 2, 1)
    assert (local.n_heads, local.kv_heads, local.head_dim, local.q, local.o) == (4, 2, 4, "q", "o")
    assert local.kv_index == (0, 0, 1, 1)
    # the rows of rank 1's block of the whole weights are the heads it holds, paired as in the whole layout
    w = {"q": torch.randn(32, 16), "k": torch.randn(16, 16), "v": torch.randn(16, 16)}
    q, k, _ = split_qkv(w, GQA, paired=True)
    lq, lk, _ = split_qkv({n: t[t.shape[0] // 2:] for n, t in w.items()}, local, paired=True)
    assert torch.equal(lq, q[4:]) and torch.equal(lk, k[2:])
    assert [GQA.kv_index[4 + h] - 2 for h in range(4)] == list(local.kv_index)


def test_kv_map_inside_blocks_is_kept_per_rank():
    """A tiled pairing (query head h <- key head h % G) whose blocks stay on one rank: each rank's own map."""
    tiled = QKVLayout(4, 4, "q", "k", "v", n_kv_heads=2, kv_map=(0, 1, 0, 1))
    with pytest.raises(SpecError, match="pairs query heads with key/value heads of other ranks"):
        _local_layout("attn", tiled, 2, 0)  # rank 0's heads 0, 1 read key heads 0 and 1: rank 1 holds key head 1
    inside = QKVLayout(8, 4, "q", "k", "v", n_kv_heads=4, kv_map=(1, 0, 1, 0, 3, 2, 3, 2))
    assert _local_layout("attn", inside, 2, 1).kv_map == (1, 0, 1, 0)


@pytest.mark.parametrize(("layout", "size", "why"), [
    (QKVLayout(4, 8, "qkv", packing="fused"), 2, "a contiguous block of rows is not a block of whole heads"),
    (QKVLayout(4, 8, "q", "kv", packing="q_kv"), 2, "a contiguous block of rows is not a block of whole heads"),
    (QKVLayout(6, 8, "q", "k", "v", n_kv_heads=3), 2, "do not split evenly across 2 ranks"),
    (QKVLayout(8, 8, "q", "k", "v", n_kv_heads=2), 4, "do not split evenly across 4 ranks"),
])
def test_splits_that_are_not_whole_heads_are_refused_by_name(layout, size, why):
    with pytest.raises(SpecError, match=why) as err:
        _local_layout("model.layers.0.attn", layout, size, 0)
    assert "model.layers.0.attn" in str(err.value) and "leave this layer out" in str(err.value)


def test_fused_per_head_blocks_are_whole_heads():
    """GPT-NeoX's per-head [Q_h | K_h | V_h] rows: a contiguous block of them is whole heads."""
    neox = QKVLayout(4, 8, "qkv", packing="fused_per_head")
    local = _local_layout("attn", neox, 2, 1)
    w = torch.randn(96, 16)
    q, k, v = split_qkv({"qkv": w}, neox)
    lq, lk, lv = split_qkv({"qkv": w[48:]}, local)
    assert torch.equal(lq, q[2:]) and torch.equal(lk, k[2:]) and torch.equal(lv, v[2:])


@pytest.mark.parametrize(("heads", "kv", "replicas"),
                         [(2, 1, 2), (8, 8, 8), (8, 2, 4), (4, 4, 2), (4, 2, 3), (1, 1, 4)])
def test_replicas_of_a_block_share_its_heads_once_each(heads, kv, replicas):
    """Every query head and every key/value head of a block is computed by exactly one of the ranks holding it;
    whole key/value groups where there are enough to go round."""
    layout = QKVLayout(heads, 4, "q", "k", "v", n_kv_heads=kv)
    works = [work_of(layout, i, replicas) for i in range(replicas)]
    assert sorted(h for w in works for h in w.q) == list(range(heads))
    assert sorted(g for w in works for g in w.kv) == list(range(kv))
    if kv >= replicas:
        r = heads // kv
        assert all(w.q.start % r == 0 and w.q.stop % r == 0 for w in works)


@pytest.mark.parametrize(("heads", "kv", "replicas"), [(4, 2, 2), (4, 1, 4), (8, 2, 3)])
def test_work_pairs_each_query_head_with_its_key_head(heads, kv, replicas):
    layout = QKVLayout(heads, 4, "q", "k", "v", n_kv_heads=kv)
    w = {"q": torch.randn(heads * 4, 16), "k": torch.randn(kv * 4, 16), "v": torch.randn(kv * 4, 16)}
    q, k, _ = split_qkv(w, layout, paired=True)
    for i in range(replicas):
        work = work_of(layout, i, replicas)
        wq, wk = work.pair(q, k, layout)
        if len(work.q) == 0:
            continue
        r_here = wq.shape[0] // wk.shape[0]  # the spectra pair row h with key row h // (rows / key rows)
        for j, h in enumerate(work.q):
            assert torch.equal(wq[j], q[h]) and torch.equal(wk[j // r_here], k[layout.kv_index[h]])


def test_chunks_are_torch_chunk():
    for n in range(0, 9):
        for parts in range(1, 5):
            want = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            got = [len(_chunk(n, parts, i)) for i in range(parts)]
            assert [g for g in got if g] == want
