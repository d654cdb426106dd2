"""Layers that only the computation explains, measured with no spec and exact against float64 references: the
weight side against the full SVD of each head's Wq_h^T Wk_h sliced by hand, the attention statistics against
probabilities from the kernel's real inputs (recomputed by hand in float64, or the model's own eager ones).

(a) Q/K/V activations clamped to a range between projection and kernel (MPT's and OLMo's ``clip_qkv``), so that
    the per-head norms of the kernel's q differ from the projection's: confirmed through the clamp the forward
    made, and the layer's record says what was seen between them.
(b) DeBERTa-v2 with relative-position terms (``relative_attention=True``, ``pos_att_type=["p2c", "c2p"]``) where
    its relative-position products have the shape of ``q @ k^T`` (2 * position_buckets == tokens): of the
    products, the one the layout explains is taken as the logits' (not the last one of that shape).
(c) per-head 3-D W_Q/W_K/W_V (TransformerLens style), head count only in a config object, einsum scores and its
    own softmax, which no name recognises: found by its computation, and without a capture refused with the
    spec its shapes imply.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from test_refusals import specs_in
from torch import nn

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout
from diag.math.attention import stats_from_probabilities_reference
from hooks.monitor.monitor import Monitor
from tests.support.harness import assert_sigma1_by_hand, one_step
from tests.support.styles import ClampedFused, ClampedRope, ConfigHeads3D, D, E, G, H, Net, rope

N = 2  # the Monitor's attn_seqs
REL = 1e-4


def _inputs(model: nn.Module, modules: list[nn.Module]) -> list[torch.Tensor]:
    """Hooks that record each module's input (first N sequences) at its next forward."""
    seen: list[torch.Tensor] = [None] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0][:N].detach().double()))
    return seen


def _causal(t: int) -> torch.Tensor:
    return torch.ones(N, t, t, dtype=torch.bool).tril()


def assert_attention(scalars: dict, label: str, logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Entropy, rank and max logit of every head against float64 logits (N, H, Q, K) by hand."""
    logits = logits.masked_fill(~allowed[:, None], -math.inf)
    entropy, rank = stats_from_probabilities_reference(logits.softmax(-1), allowed)
    for h in range(logits.shape[1]):
        tag = f"{label}/H{h:02d}"
        assert scalars[f"attn_entropy/{tag}"] == pytest.approx(entropy[h].item(), rel=REL), tag
        assert scalars[f"attn_rank/{tag}"] == pytest.approx(rank[h].item(), rel=REL), tag
        assert scalars[f"attn_max_logit/{tag}"] == pytest.approx(logits[:, h].max().item(), rel=1e-5), tag


def _run(model: nn.Module, modules: list[nn.Module], spec=None):
    xs = _inputs(model, modules)
    x = torch.randn(3, 10, E, generator=torch.Generator().manual_seed(1))
    monitor, record, checked, caught = one_step(model, lambda: model(x).square().mean(), spec=spec)
    return monitor, record, checked, caught, xs


# ------------------------------------------------------------------ (a) clamped activations


def _clamped_fused_reference(attn: ClampedFused, x: torch.Tensor):
    w, b = attn.Wqkv.weight.detach().double(), attn.Wqkv.bias.detach().double()
    y = (x @ w.T + b).clamp(-attn.clip_qkv, attn.clip_qkv)
    q, k = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in y.chunk(3, -1)[:2])
    return w[: H * D].reshape(H, D, E), w[H * D: 2 * H * D].reshape(H, D, E), q @ k.transpose(-1, -2) / math.sqrt(D)


def _clamped_rope_reference(attn: ClampedRope, x: torch.Tensor):
    wq, wk = attn.q_proj.weight.detach().double(), attn.k_proj.weight.detach().double()
    q = (x @ wq.T + attn.q_proj.bias.detach().double()).clamp(-attn.clip, attn.clip)
    k = (x @ wk.T + attn.k_proj.bias.detach().double()).clamp(-attn.clip, attn.clip)
    q, k = rope(q.unflatten(-1, (H, D)).transpose(1, 2)), rope(k.unflatten(-1, (G, D)).transpose(1, 2))
    pair = [attn.kv_of(h) for h in range(H)]
    logits = q @ k[:, pair].transpose(-1, -2) / math.sqrt(D)
    return wq.reshape(H, D, E), wk.reshape(G, D, E)[pair], logits


@pytest.mark.parametrize("style", ["ClampedFused", "ClampedRope"])
def test_clamped_activations_are_measured_exactly_and_the_record_says_so(style):
    cls, reference = {"ClampedFused": (ClampedFused, _clamped_fused_reference),
                      "ClampedRope": (ClampedRope, _clamped_rope_reference)}[style]
    model = Net(cls)
    attns = [block.attn for block in model.blocks]
    monitor, record, checked, caught, xs = _run(model, attns)
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    for layer, attn, x in zip(monitor.layers, attns, xs):
        assert layer.record.state == "confirmed" and layer.record.between == "clamp(min=-0.5, max=0.5)"
        raw_q = attn.qk(x.float())[0]
        assert (raw_q.abs() > 0.5).float().mean() > 0.2  # the clamp really cut the projections
        wq, wk, logits = reference(attn, x)
        assert_sigma1_by_hand(record.scalars, layer.label, wq, wk, rel=1e-5)
        assert_attention(record.scalars, layer.label, logits, _causal(x.shape[1]))


def _hf_clamped(name: str, attn: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mpt":
        cfg = transformers.MptConfig(d_model=E, n_heads=H, n_layers=2, vocab_size=64, max_seq_len=32,
                                     attn_config={"clip_qkv": 0.03}, attn_implementation=attn)
        return transformers.MptForCausalLM(cfg).train()
    cfg = transformers.OlmoConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=G, num_hidden_layers=2,
                                  intermediate_size=64, vocab_size=64, clip_qkv=0.03, attn_implementation=attn)
    return transformers.OlmoForCausalLM(cfg).train()


@pytest.mark.parametrize("name,attn", [("mpt", "eager"), ("olmo", "sdpa"), ("olmo", "eager")])
def test_hugging_face_clip_qkv_is_measured_exactly(name, attn):
    """MPT (fused ``Wqkv`` clamped, ALiBi) and OLMo (``q_proj``... clamped in place, then RoPE; GQA): refused at
    the first forward before; the spectra against hand-sliced weights, the attention statistics against the
    model's own eager probabilities (an eager twin with the same weights)."""
    model = _hf_clamped(name, attn)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    monitor, record, checked, caught = one_step(model, lambda: model(ids).logits.square().mean())
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    assert all(layer.record.between == "clamp(min=-0.03, max=0.03)" for layer in monitor.layers)
    twin = _hf_clamped(name, "eager")
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        probs = twin(ids, output_attentions=True).attentions
    for layer, p in zip(monitor.layers, probs):
        m = layer.module
        if name == "mpt":
            w = m.Wqkv.weight.detach().double()
            wq, wk = w[:E].reshape(H, D, E), w[E:2 * E].reshape(H, D, E)
        else:
            wq = m.q_proj.weight.detach().double().reshape(H, D, E)
            wk = m.k_proj.weight.detach().double().reshape(G, D, E)[[h // (H // G) for h in range(H)]]
        assert_sigma1_by_hand(record.scalars, layer.label, wq, wk, rel=1e-5)
        entropy, rank = stats_from_probabilities_reference(p[:N], _causal(12))
        for h in range(H):
            tag = f"{layer.label}/H{h:02d}"
            assert record.scalars[f"attn_entropy/{tag}"] == pytest.approx(entropy[h].item(), rel=REL), tag
            assert record.scalars[f"attn_rank/{tag}"] == pytest.approx(rank[h].item(), rel=REL), tag


# ------------------------------------------------------------------ (b) DeBERTa-v2 relative positions


def _deberta(share: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        hidden_size=E, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64, vocab_size=64,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=6, max_position_embeddings=64,
        share_att_key=share, norm_rel_ebd="layer_norm", position_biased_input=False, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    return transformers.DebertaV2Model(cfg).train()


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("with_spec", [False, True])
def test_deberta_relative_positions_are_measured_exactly(share, with_spec):
    """12 tokens, 6 position buckets: the c2p and p2c products are (B*H, 12, 12) like q @ k^T, and were taken
    for it (the layer refused, with no spec and with the spec its refusal offered)."""
    model = _deberta(share)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    spec = {"encoder.layer.*.attention.self": QKVLayout(H, D, "query_proj.weight", "key_proj.weight",
                                                        "value_proj.weight")} if with_spec else None
    monitor, record, checked, caught = one_step(model, lambda: model(ids).last_hidden_state.square().mean(),
                                                spec=spec)
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    with torch.no_grad():
        probs = model(ids, output_attentions=True).attentions  # dropout 0: the probabilities the step used
    allowed = torch.ones(N, 12, 12, dtype=torch.bool)
    for layer, p in zip(monitor.layers, probs):
        m = layer.module
        wq, wk = (lin.weight.detach().double().reshape(H, D, E) for lin in (m.query_proj, m.key_proj))
        assert_sigma1_by_hand(record.scalars, layer.label, wq, wk, rel=1e-5)
        entropy, rank = stats_from_probabilities_reference(p[:N], allowed)
        for h in range(H):
            tag = f"{layer.label}/H{h:02d}"
            assert record.scalars[f"attn_entropy/{tag}"] == pytest.approx(entropy[h].item(), rel=REL), tag
            assert record.scalars[f"attn_rank/{tag}"] == pytest.approx(rank[h].item(), rel=REL), tag


# ------------------------------------------------------------------ (c) per-head 3-D parameters, found by computation


@pytest.mark.parametrize("head_first", [False, True])
def test_per_head_3d_parameters_are_found_by_their_computation(head_first):
    model = Net(lambda: ConfigHeads3D(head_first=head_first))
    attns = [block.attn for block in model.blocks]
    monitor, record, checked, caught, xs = _run(model, attns)
    assert [la.name for la in monitor.layers] == ["blocks.0.attn", "blocks.1.attn"]
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    for layer, attn, x in zip(monitor.layers, attns, xs):
        lay = layer.layout
        assert (lay.packing, lay.n_heads, lay.head_dim, lay.transposed) == ("heads_3d", H, D, not head_first)
        wq, wk = (attn.per_head(w).detach().double().transpose(1, 2) for w in (attn.W_Q, attn.W_K))  # (H, D, E)
        assert_sigma1_by_hand(record.scalars, layer.label, wq, wk, rel=1e-5)
        q, k = (torch.einsum("nte,hed->nhtd", x, attn.per_head(w).detach().double()) + b.detach().double()[:, None]
                for w, b in ((attn.W_Q, attn.b_Q), (attn.W_K, attn.b_K)))
        assert_attention(record.scalars, layer.label, q @ k.transpose(-1, -2) / math.sqrt(D), _causal(x.shape[1]))


def test_without_a_capture_the_refusal_offers_the_spec_the_shapes_imply():
    """Nothing can confirm a layout without a captured forward: refused at construction, offering the spec the
    module's 3-D shapes imply (not another model's example), and that spec is exact."""
    with pytest.raises(SpecError) as info:
        Monitor(Net(ConfigHeads3D), signals=("spectra", "grads"))
    message = str(info.value)
    assert "blocks.0.attn (ConfigHeads3D) and 1 like it calls attention" in message and "W_Q (4, 32, 8)" in message
    offered = specs_in(message)
    assert [s["blocks.*.attn"].describe() for s in offered] == [
        "QKVLayout(n_heads=4, head_dim=8, q='W_Q', k='W_K', v='W_V', packing='heads_3d', transposed=True)"]
    assert "qkv.weight" not in message and "n_heads=8" not in message
    model = Net(ConfigHeads3D)
    monitor, record, checked, caught, xs = _run(model, [b.attn for b in model.blocks], spec=offered[0])
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    for layer in monitor.layers:
        attn = layer.module
        assert_sigma1_by_hand(record.scalars, layer.label, attn.W_Q.detach().double().transpose(1, 2),
                              attn.W_K.detach().double().transpose(1, 2), rel=1e-5)
