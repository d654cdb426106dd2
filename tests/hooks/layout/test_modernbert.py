"""ModernBERT (Hugging Face ``ModernBertForMaskedLM``: a fused ``Wqkv`` projection, rotary positions, pre-LN),
attached with NO spec: the BERT-style masked language model of the evaluation's healthy runs
(evaluation/healthy.py). Every head's spectral metrics equal the float64 full SVD of
Wq_h^T Wk_h sliced by hand from ``Wqkv`` (rows [q | k | v], each ``num_heads`` blocks of ``head_dim``), its
attention entropy and rank equal the library's eager probabilities (``output_attentions=True``) through the
per-head float64 loops, under both the eager and the fused SDPA kernel, padding included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

from diag.math.attention import stats_from_probabilities_reference
from tests.support.harness import one_step
from tests.support.references import N_SEQ

V, E, NH, LAYERS, T = 60, 32, 4, 2, 12
D = E // NH
REL = 1e-6


def _model(impl: str) -> transformers.ModernBertForMaskedLM:
    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(vocab_size=V, hidden_size=E, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=NH, max_position_embeddings=16, pad_token_id=0,
                                        bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
                                        global_attn_every_n_layers=1, local_attention=16, embedding_dropout=0.0,
                                        mlp_dropout=0.0, attention_dropout=0.0)
    cfg._attn_implementation = impl
    return transformers.ModernBertForMaskedLM(cfg)


def _batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (3, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence padded at the end
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _per_head(scalars: dict, metric: str, label: str) -> np.ndarray:
    return np.array([scalars[f"{metric}/{label}/H{h:02d}"] for h in range(NH)])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_modernbert_is_exact_with_no_spec(impl):
    model = _model(impl)
    model.train()
    batch = _batch()
    monitor, record, checked, caught = one_step(model, lambda: model(**batch).loss)
    assert [layer.name for layer in monitor.layers] == [f"model.layers.{i}.attn" for i in range(LAYERS)], caught
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    s = record.scalars
    model.config._attn_implementation = "eager"  # the reference: the library's own probabilities
    with torch.no_grad():
        probs = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            output_attentions=True).attentions
    # the Monitor reads the first N_SEQ sequences of a batch (the padded one among them); padded keys are
    # masked and padded rows are no attention rows
    valid = batch["attention_mask"].bool()[:N_SEQ]  # (N_SEQ, T)
    allowed = valid[:, None, :].expand(-1, T, -1)
    for i, (layer, p) in enumerate(zip(monitor.layers, probs)):
        label = layer.label
        w = model.model.layers[i].attn.Wqkv.weight.detach().double()  # (3E, E): rows [q | k | v]
        wq, wk = w[:E], w[E : 2 * E]
        for h in range(NH):
            sv = torch.linalg.svdvals(wq[h * D : (h + 1) * D].T @ wk[h * D : (h + 1) * D]).numpy()[:D]  # (E, E)
            energy, share = sv**2, sv / sv.sum()
            tag = f"{label}/H{h:02d}"
            assert s[f"qk_sigma1/{tag}"] == pytest.approx(sv[0], rel=REL)
            assert s[f"qk_sec/{tag}"] == pytest.approx(energy[:4].sum() / energy.sum(), rel=REL)
            assert s[f"qk_stable_rank/{tag}"] == pytest.approx(energy.sum() / energy[0], rel=REL)
            assert s[f"qk_erank/{tag}"] == pytest.approx(math.exp(-(share * np.log(share)).sum()), rel=REL)
        entropy, rank = stats_from_probabilities_reference(p[:N_SEQ], allowed, query_valid=valid)
        np.testing.assert_allclose(_per_head(s, "attn_entropy", label), entropy.numpy(), rtol=REL)
        np.testing.assert_allclose(_per_head(s, "attn_rank", label), rank.numpy(), rtol=REL)
        # the gradient norms: the rows of Wqkv's gradient, sliced by hand
        g = model.model.layers[i].attn.Wqkv.weight.grad.double()
        for name, rows in (("q", g[:E]), ("k", g[E : 2 * E]), ("v", g[2 * E :])):
            ref = [rows[h * D : (h + 1) * D].norm().item() for h in range(NH)]
            np.testing.assert_allclose(_per_head(s, f"grad_norm_{name}", label), ref, rtol=REL)
