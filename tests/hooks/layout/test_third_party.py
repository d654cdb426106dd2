"""Third-party attention code from PyPI (x-transformers, a widely used library of transformer variants), built
from its constructor arguments and attached with NO spec. Every head's sigma_1 equals the float64 full SVD of
Wq_h^T Wk_h sliced by hand, with the pairing x-transformers uses for grouped-query attention: it tiles the key
heads (``repeat(k, 'b h ... -> b (r h) ...')``), so query head h reads key head h % G, not h // (H / G)."""

from __future__ import annotations

import pytest
import torch
import x_transformers  # in the test extra: a missing install is an error here, never a skip

from tests.support.harness import one_step

V, E, NH, D = 50, 32, 4, 8

VARIANTS = {
    "sdpa": dict(attn_flash=True),
    "sdpa-gqa-rotary": dict(attn_flash=True, attn_kv_heads=2, rotary_pos_emb=True),
    "sdpa-qk-l2norm": dict(attn_flash=True, attn_qk_norm=True),
    "einsum": dict(),
    "einsum-gqa": dict(attn_kv_heads=2),
}


def _run(variant: str):
    torch.manual_seed(0)
    model = x_transformers.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=x_transformers.Decoder(
        dim=E, depth=2, heads=NH, attn_dim_head=D, **VARIANTS[variant]))
    model.train()
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(1))
    return one_step(model, lambda: model(ids).logsumexp(-1).mean())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_x_transformers_is_exact_with_no_spec(variant):
    monitor, record, checked, caught = _run(variant)
    assert [layer.name for layer in monitor.layers] == ["attn_layers.layers.0.1", "attn_layers.layers.2.1"]
    g = VARIANTS[variant].get("attn_kv_heads", NH)
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught  # einsum's q and k too
    if g < NH:  # x-transformers tiles the key heads: read from the kernel, not assumed
        assert [layer.layout.kv_map for layer in monitor.layers] == [(0, 1, 0, 1)] * 2
    for layer in monitor.layers:
        wq = layer.module.to_q.weight.detach().double().reshape(NH, D, E)
        wk = layer.module.to_k.weight.detach().double().reshape(g, D, E)
        for h in range(NH):
            sigma = torch.linalg.svdvals(wq[h].T @ wk[h % g])[0].item()
            assert record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=1e-5), h
