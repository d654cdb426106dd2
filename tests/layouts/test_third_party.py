"""Third-party attention code from PyPI (x-transformers, a widely used library of transformer variants), built
from its constructor arguments and attached with NO spec. Every head's sigma_1 equals the float64 full SVD of
Wq_h^T Wk_h sliced by hand, with the pairing x-transformers uses for grouped-query attention: it tiles the key
heads (``repeat(k, 'b h ... -> b (r h) ...')``), so query head h reads key head h % G, not h // (H / G)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from diag.outputs.sinks import MemorySink
from hooks import Monitor

x_transformers = pytest.importorskip("x_transformers")
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
    sink = MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[sink])
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        checked = dict(monitor.capture.checked)
        monitor.step(0, loss=loss)
        monitor.close()
    return monitor, sink.records[0], checked, [str(w.message) for w in caught]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_x_transformers_is_exact_with_no_spec(variant):
    monitor, record, checked, caught = _run(variant)
    assert [layer.name for layer in monitor.layers] == ["attn_layers.layers.0.1", "attn_layers.layers.2.1"]
    g = VARIANTS[variant].get("attn_kv_heads", NH)
    if variant == "einsum-gqa" and not checked:  # einsum logits hide the pairing: refused until captured
        assert set(monitor.refused) == {0, 1}
        message = next(m for m in caught if "not measured at all" in m)
        assert "h % G" in message and "kv_map=(0, 1, 0, 1)" in message
        return
    assert set(checked.values()) <= {"q,k", "heads"} and not monitor.refused, caught
    # einsum: the head count only, or q and k per head where the capture sees einsum's operands
    assert set(checked.values()) in (({"heads"}, {"q,k"}) if variant == "einsum" else ({"q,k"},))
    for layer in monitor.layers:
        wq = layer.module.to_q.weight.detach().double().reshape(NH, D, E)
        wk = layer.module.to_k.weight.detach().double().reshape(g, D, E)
        for h in range(NH):
            sigma = torch.linalg.svdvals(wq[h].T @ wk[h % g])[0].item()
            assert record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=1e-5), h


def test_the_suggested_pairing_spec_works():
    """The refusal of einsum-gqa offers two specs; the h % G one (x-transformers' pairing) attaches and is exact."""
    from hooks import QKVLayout

    monitor, _, checked, caught = _run("einsum-gqa")
    if checked:
        pytest.skip("the capture sees einsum's q and k: the pairing is read, nothing to suggest")
    message = next(m for m in caught if "not measured at all" in m)
    spec_src = re.findall(r"Monitor\(model, spec=(\{.*?\})\) for h", message)[-1]
    spec = eval(spec_src, {"QKVLayout": QKVLayout})  # noqa: S307 - our own message, in a test
    assert len(spec) == 2  # both blocks' attention modules (a '*' would take the feed-forward blocks too)
    torch.manual_seed(0)
    model = x_transformers.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=x_transformers.Decoder(
        dim=E, depth=2, heads=NH, attn_dim_head=D, **VARIANTS["einsum-gqa"]))
    sink = MemorySink()
    with Monitor(model, every=1, sinks=[sink], spec=spec) as again:
        loss = model(torch.randint(0, V, (3, 10))).logsumexp(-1).mean()
        loss.backward()
        again.step(0, loss=loss)
    assert not again.refused and len(again.layers) == 2
    for layer in again.layers:
        wq = layer.module.to_q.weight.detach().double().reshape(NH, D, E)
        wk = layer.module.to_k.weight.detach().double().reshape(2, D, E)
        for h in range(NH):
            sigma = torch.linalg.svdvals(wq[h].T @ wk[h % 2])[0].item()
            assert sink.records[0].scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=1e-5)
