"""Hugging Face families with packings the named adapters never knew, attached with NO spec: the layout is read
from the attention kernel's q and k at the first forward, and every head's sigma_1 equals the float64 full SVD
of Wq_h^T Wk_h sliced by hand from the family's documented packing (not through the layout vocabulary)."""

from __future__ import annotations

import pytest
import torch
import transformers  # in the test extra: never a skip

from tests.support.harness import assert_sigma1_by_hand, one_step

V, E, NH, D = 50, 32, 4, 8
REL = 1e-5


def _falcon(kv: int):
    cfg = transformers.FalconConfig(vocab_size=V, hidden_size=E, num_attention_heads=NH, num_hidden_layers=2,
                                    new_decoder_architecture=kv > 1, num_kv_heads=kv, multi_query=kv == 1,
                                    alibi=False)
    return transformers.FalconForCausalLM(cfg)


def _bigcode(mqa: bool):
    cfg = transformers.GPTBigCodeConfig(vocab_size=V, n_embd=E, n_head=NH, n_layer=2, multi_query=mqa)
    return transformers.GPTBigCodeForCausalLM(cfg)


def _fused_split(w, g: int, how: str):
    """Hand slicing (H, D, E) queries and (H, D, E) keys paired with each query head, per family."""
    e = w.shape[-1]
    if how == "per_group":  # Falcon new decoder architecture: per KV group [Q_1..Q_r | K | V]
        r = NH // g
        grouped = w.reshape(g, r + 2, D, e)
        return grouped[:, :r].reshape(NH, D, e), grouped[:, r].repeat_interleave(r, 0)
    if how == "per_head":  # BLOOM, GPT-BigCode (multi-head): per head [Q_h | K_h | V_h]
        per = w.reshape(NH, 3, D, e)
        return per[:, 0], per[:, 1]
    q, k = w[: NH * D].reshape(NH, D, e), w[NH * D: (NH + g) * D].reshape(g, D, e)  # [all Q | all K | all V]
    return q, k.repeat_interleave(NH // g, 0)


FAMILIES = {
    # name: (builder, implementations, attention modules, per-layer (Wq_h, Wk_h) by hand)
    "falcon-gqa": (lambda: _falcon(2), ("eager", "sdpa"), lambda m: m.transformer.h,
                   lambda blk: _fused_split(blk.self_attention.query_key_value.weight, 2, "per_group")),
    "falcon-mqa": (lambda: _falcon(1), ("eager", "sdpa"), lambda m: m.transformer.h,
                   lambda blk: _fused_split(blk.self_attention.query_key_value.weight, 1, "fused")),
    "mpt": (lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=V, d_model=E, n_heads=NH, n_layers=2, expansion_ratio=2, max_seq_len=64)), ("eager",),
            lambda m: m.transformer.blocks, lambda blk: _fused_split(blk.attn.Wqkv.weight, NH, "fused")),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=V, hidden_size=E, num_attention_heads=NH, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, pad_token_id=0)), ("eager", "sdpa"), lambda m: m.model.layers,
             lambda blk: _fused_split(blk.self_attn.qkv_proj.weight, 2, "fused")),
    "bigcode-mqa": (lambda: _bigcode(True), ("eager", "sdpa"), lambda m: m.transformer.h,
                    lambda blk: _fused_split(blk.attn.c_attn.weight, 1, "fused")),
    "bigcode-mha": (lambda: _bigcode(False), ("eager", "sdpa"), lambda m: m.transformer.h,
                    lambda blk: _fused_split(blk.attn.c_attn.weight, NH, "per_head")),
    # logits from baddbmm (BLOOM) and bmm (DeBERTa-v2, with its disentangled position terms added)
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=V, hidden_size=E, n_head=NH, n_layer=2)), ("eager",), lambda m: m.transformer.h,
              lambda blk: _fused_split(blk.self_attention.query_key_value.weight, NH, "per_head")),
    "deberta-v2": (lambda: transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=V, hidden_size=E, num_attention_heads=NH, num_hidden_layers=2, intermediate_size=64,
        relative_attention=True, pos_att_type=["p2c", "c2p"], max_position_embeddings=64)), ("eager", "sdpa"),
                   lambda m: m.deberta.encoder.layer,
                   lambda blk: (blk.attention.self.query_proj.weight.reshape(NH, D, E),
                                blk.attention.self.key_proj.weight.reshape(NH, D, E))),
}
CASES = [(name, impl) for name, (_, impls, _, _) in FAMILIES.items() for impl in impls]


def _run(name: str, impl: str):
    torch.manual_seed(0)
    model = FAMILIES[name][0]()
    model.config._attn_implementation = impl
    model.train()
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(1))
    return (model, *one_step(model, lambda: model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss))


@pytest.mark.parametrize("name, impl", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_family_is_exact_with_no_spec(name, impl):
    model, monitor, record, checked, caught = _run(name, impl)
    blocks = list(FAMILIES[name][2](model))
    assert len(monitor.layers) == len(blocks) == 2
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    for layer, block in zip(monitor.layers, blocks):
        assert_sigma1_by_hand(record.scalars, layer.label, *FAMILIES[name][3](block), rel=REL)


@pytest.mark.parametrize("tokens", [10, 16])  # 16: its padded token count divides the width (32)
def test_longformer_sliding_window_keeps_its_weight_side_signals(tokens):
    """Longformer's encoder scores are (batch, tokens, heads, window): no head split of the layer reads that
    softmax as (batch, heads, queries, keys). The call, not the layout, is what cannot be read: the attention
    statistics are dropped with a warning that says so, and sigma_1 of every head is still the full SVD of
    Wq_h^T Wk_h (the layer is not refused as a suspect head split)."""
    cfg = transformers.LongformerConfig(vocab_size=V, hidden_size=E, num_attention_heads=NH, num_hidden_layers=2,
                                        intermediate_size=64, max_position_embeddings=80, attention_window=4,
                                        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LongformerModel(cfg).train()
    ids = torch.randint(1, V, (3, tokens), generator=torch.Generator().manual_seed(1))
    monitor, record, _, caught = one_step(model, lambda: model(input_ids=ids).last_hidden_state.pow(2).mean())
    said = [m for m in caught if "diag:" in m]
    assert len(monitor.layers) == 2 and not monitor.refused, said
    assert any("sliding-window" in m and "weight-side signals are measured" in m for m in said), said
    scalars = record.scalars
    assert not any(t.startswith("attn_entropy/") for t in scalars)
    for layer, block in zip(monitor.layers, model.encoder.layer):
        attn = block.attention.self
        assert_sigma1_by_hand(scalars, layer.label, attn.query.weight.reshape(NH, D, E),
                              attn.key.weight.reshape(NH, D, E), rel=REL)
        assert f"grad_norm_q/{layer.label}/H00" in scalars


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_codegen_groups_of_query_value_key_with_no_spec(impl):
    """CodeGen's qkv_proj holds 4 model-parallel groups, each [Q | V | K] of n_heads / 4 heads (V before K),
    which no packing named before could express (the layer was refused, and no spec could fix it). Read from
    the computation as QKVLayout(groups=4, order='qvk'); every head's sigma_1 is the full SVD of Wq_h^T Wk_h
    sliced by hand as transformers' CodeGenAttention splits it."""
    nh, d = 8, 4  # 2 heads per group
    cfg = transformers.CodeGenConfig(vocab_size=V, n_embd=nh * d, n_head=nh, n_layer=2, n_positions=64,
                                     rotary_dim=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.CodeGenModel(cfg)
    model.config._attn_implementation = impl
    model.train()
    ids = torch.randint(1, V, (3, 10), generator=torch.Generator().manual_seed(1))
    monitor, record, checked, caught = one_step(model, lambda: model(input_ids=ids).last_hidden_state.pow(2).mean())
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    layout = monitor.layers[0].layout
    assert (layout.packing, layout.groups, layout.order) == ("fused_per_group", 4, "qvk"), layout.describe()
    e, local = nh * d, nh * d // 4
    for layer, block in zip(monitor.layers, model.h):
        w = block.attn.qkv_proj.weight.reshape(4, 3 * local, e)  # by hand: per group q, v, k
        assert_sigma1_by_hand(record.scalars, layer.label, w[:, :local].reshape(nh, d, e),
                              w[:, 2 * local:].reshape(nh, d, e), rel=REL)


@pytest.mark.parametrize("family", ["segformer", "pvt_v2"])
def test_keys_from_a_sub_sampled_grid_are_checked_with_no_spec(family):
    """SegFormer's and PVT-v2's efficient self-attention project keys from ``layer_norm(sr(x))``, a strided
    convolution of the token grid, so the kernel's k has fewer tokens than the module's input: it is checked
    against what the key projection itself read (before: q alone, "q"). sigma_1 from the query and key weights
    sliced by hand."""
    kwargs = {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [4, 2], "hidden_sizes": [32, 64],
              "num_attention_heads": [2, 2], "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2]}
    if family == "segformer":
        model = transformers.SegformerModel(transformers.SegformerConfig(decoder_hidden_size=32, **kwargs))
    else:
        model = transformers.PvtV2Model(transformers.PvtV2Config(**kwargs))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    monitor, record, checked, caught = one_step(model.train(), lambda: model(x).last_hidden_state.pow(2).mean())
    assert len(monitor.layers) == 2 and not monitor.refused and checked == {0: "q,k", 1: "q,k"}, (checked, caught)
    for layer in monitor.layers:
        heads, attn = layer.layout.n_heads, layer.module
        # transformers 5's SegFormer names them q_proj/k_proj, PVT-v2 query/key
        wq, wk = (attn.q_proj.weight, attn.k_proj.weight) if family == "segformer" else (attn.query.weight,
                                                                                         attn.key.weight)
        d = wq.shape[0] // heads
        assert_sigma1_by_hand(record.scalars, layer.label, wq.reshape(heads, d, -1), wk.reshape(heads, d, -1),
                              rel=REL)
        assert f"attn_entropy/{layer.label}/H00" in record.scalars
