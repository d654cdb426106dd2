"""Per-head sums of squares of FSDP2 shards (hooks.parallel.owners): summed over the shards, they are the squared
per-head norms of the whole tensor as split_qkv splits it, for every packing, shards cut anywhere along dim 0 (a
head's elements on two ranks, or, transposed, every head on every rank)."""

from __future__ import annotations

import pytest
import torch

from diag.layouts.vocab import QKVLayout, split_qkv
from diag.math.norms import frobenius
from hooks.parallel.owners import _head_squares, _segments

E, H, G, D = 12, 4, 2, 3

CASES = {
    "separate_gqa": (QKVLayout(H, D, "q", "k", "v", n_kv_heads=G), {"q": (12, 12), "k": (6, 12), "v": (6, 12)}),
    "separate_transposed": (QKVLayout(H, D, "q", "k", "v", n_kv_heads=G, transposed=True),
                            {"q": (12, 12), "k": (12, 6), "v": (12, 6)}),
    "separate_kv_map": (QKVLayout(H, D, "q", "k", "v", n_kv_heads=G, kv_map=(0, 1, 0, 1)),
                        {"q": (12, 12), "k": (6, 12), "v": (6, 12)}),
    "fused": (QKVLayout(H, D, "c", packing="fused"), {"c": (36, 12)}),
    "fused_conv1d": (QKVLayout(H, D, "c", packing="fused", transposed=True), {"c": (12, 36)}),
    "fused_per_head": (QKVLayout(H, D, "c", packing="fused_per_head"), {"c": (36, 12)}),
    "fused_per_group": (QKVLayout(H, D, "c", packing="fused_per_group", n_kv_heads=G), {"c": (24, 12)}),
    "fused_per_group_qvk": (QKVLayout(H, D, "c", packing="fused_per_group", n_kv_heads=G, groups=1, order="qvk"),
                            {"c": (24, 12)}),
    "q_kv": (QKVLayout(H, D, "q", "kv", packing="q_kv", n_kv_heads=G), {"q": (12, 12), "kv": (12, 12)}),
    "heads_3d": (QKVLayout(H, D, "q", "k", "v", packing="heads_3d", n_kv_heads=G),
                 {"q": (4, 3, 12), "k": (2, 3, 12), "v": (2, 3, 12)}),
    "heads_3d_transposed": (QKVLayout(H, D, "q", "k", "v", packing="heads_3d", n_kv_heads=G, transposed=True),
                            {"q": (4, 12, 3), "k": (2, 12, 3), "v": (2, 12, 3)}),
}


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shard_sums_of_squares_add_up_to_the_per_head_norms(case, world):
    layout, shapes = CASES[case]
    gen = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    segments = _segments(layout, shapes)
    h, g = layout.n_heads, layout.kv_heads
    total = torch.zeros(h + 2 * g + 1, dtype=torch.float64)
    for name, w in whole.items():
        start = 0
        for shard in torch.chunk(w, world, dim=0):  # FSDP2's Shard(0): torch.chunk's split, uneven ones too
            offset = [start] + [0] * (w.dim() - 1)
            total += _head_squares(shard, *segments[name], offset, h + 2 * g + 1)
            start += shard.shape[0]
    q, k, v = split_qkv(whole, layout)
    want = torch.cat([frobenius(x).square() for x in (q, k, v)])
    torch.testing.assert_close(total[:-1], want, rtol=1e-6, atol=0)
    assert total[-1] == 0  # every element belongs to a head
