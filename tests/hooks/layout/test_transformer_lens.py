"""TransformerLens's ``HookedTransformer`` (3.x), built from a config, with no spec: per-head 3-D ``W_Q``
(heads, d_model, d_head) and, under grouped-query and multi-query attention, ``_W_K``/``_W_V`` with fewer
heads, the attention module's input passed as the keyword ``query_input``. Found by the computation, measured
exactly (spectra by the full SVD of each head's product, attention statistics against the model's own
``hook_attn_scores`` and ``hook_pattern``, gradient norms by hand), and clipped by ``QKClip`` so that no head of
the same batch ends above tau.

TransformerLens 4 drops ``HookedTransformer`` (its ``TransformerBridge`` wraps Hugging Face models, which the
Hugging Face tests cover); the test extra pins ``transformer_lens<4``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformer_lens  # the test extra installs transformer_lens<4

from diag.math.attention import stats_from_probabilities_reference
from hooks import QKClip
from hooks.monitor.monitor import Monitor
from tests.support.harness import assert_sigma1_by_hand, one_step

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, D, E, T, B = 4, 16, 64, 12, 3
N = 2  # the Monitor's attn_seqs
REL = 1e-4


def _model(kv_heads: int | None, positions: str = "rotary", seed: int = 0):
    cfg = transformer_lens.HookedTransformerConfig(
        n_layers=2, d_model=E, n_ctx=32, d_head=D, n_heads=H, n_key_value_heads=kv_heads, d_vocab=50, d_mlp=128,
        act_fn="silu", positional_embedding_type=positions, normalization_type="RMS", seed=seed)
    return transformer_lens.HookedTransformer(cfg)


def _record_attention(model) -> list[dict]:
    """The first N sequences of each layer's masked scores and probabilities, as the model computed them."""
    seen = [{} for _ in model.blocks]
    for i, block in enumerate(model.blocks):
        block.attn.hook_attn_scores.register_forward_hook(
            lambda m, a, out, i=i: seen[i].__setitem__("scores", out[:N].detach().double()))
        block.attn.hook_pattern.register_forward_hook(
            lambda m, a, out, i=i: seen[i].__setitem__("pattern", out[:N].detach().double()))
    return seen


CASES = {"mha-rotary": (None, "rotary"), "mha-learned": (None, "standard"), "gqa-rotary": (2, "rotary"),
         "mqa-rotary": (1, "rotary")}


@pytest.mark.parametrize("name", list(CASES))
def test_found_with_no_spec_and_exact(name):
    kv, positions = CASES[name]
    model = _model(kv, positions)
    seen = _record_attention(model)
    tokens = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(1))
    monitor, record, checked, caught = one_step(model, lambda: model(tokens, return_type="loss"))
    assert not monitor.refused and checked == {0: "q,k", 1: "q,k"}, (monitor.refused, caught)
    g = kv or H
    allowed = torch.ones(N, T, T, dtype=torch.bool).tril()
    for layer, block, s in zip(monitor.layers, model.blocks, seen):
        attn, lay = block.attn, layer.layout
        assert (lay.packing, lay.n_heads, lay.kv_heads, lay.head_dim) == ("heads_3d", H, g, D), lay.describe()
        # W_K of the model's own (H, E, D) view: TransformerLens repeats each key head for its H / G query heads
        assert_sigma1_by_hand(record.scalars, layer.label, attn.W_Q.transpose(1, 2), attn.W_K.transpose(1, 2),
                              rel=1e-5)
        entropy, rank = stats_from_probabilities_reference(s["pattern"], allowed)
        for h in range(H):
            tag = f"{layer.label}/H{h:02d}"
            assert record.scalars[f"attn_entropy/{tag}"] == pytest.approx(entropy[h].item(), rel=REL), tag
            assert record.scalars[f"attn_rank/{tag}"] == pytest.approx(rank[h].item(), rel=REL), tag
            top = s["scores"][:, h].masked_fill(~allowed, -math.inf).max().item()
            assert record.scalars[f"attn_max_logit/{tag}"] == pytest.approx(top, rel=1e-5), tag
        k_param, v_param = (attn._W_K, attn._W_V) if kv else (attn.W_K, attn.W_V)
        for metric, param, count in (("q", attn.W_Q, H), ("k", k_param, g), ("v", v_param, g)):
            ref = [param.grad[h].double().norm().item() for h in range(count)]
            got = [record.scalars[f"grad_norm_{metric}/{layer.label}/H{h:02d}"] for h in range(count)]
            np.testing.assert_allclose(got, ref, rtol=REL, err_msg=f"{layer.label} grad_norm_{metric}")


@pytest.mark.parametrize("kv", [2, 1])
def test_qk_clip_leaves_no_head_above_tau_on_the_same_batch(kv):
    """Q/K weights grown so that some heads' logits are large; one step at a zero learning rate, so the clip alone
    moves the weights. On the input each layer saw in that step, every head's largest logit afterwards (every
    sequence, from the model's own ``hook_attn_scores``) is tau or below, and a head that was under tau keeps its
    logits."""
    model = _model(kv, "rotary", seed=3)
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.W_Q, block.attn._W_K):
                p.mul_(6.0)
    inputs, scores = [None] * len(model.blocks), [None] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: inputs.__setitem__(i, kw["query_input"].detach().clone()), with_kwargs=True)
        block.attn.hook_attn_scores.register_forward_hook(
            lambda m, a, out, i=i: scores.__setitem__(i, out.detach().double()))
    tokens = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(2))
    allowed = torch.ones(B, T, T, dtype=torch.bool).tril()

    def maxima(i: int) -> list[float]:
        return [scores[i][:, h].masked_fill(~allowed, -math.inf).max().item() for h in range(H)]

    with torch.no_grad():  # the logits of the unclipped weights (no dropout: the training forward's too)
        model(tokens, return_type="loss")
    before = [maxima(i) for i in range(len(model.blocks))]
    flat = sorted(v for row in before for v in row)
    tau = (flat[len(flat) // 2 - 1] + flat[len(flat) // 2]) / 2
    monitor = Monitor(model, every=1, signals=("attention",))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClip(model, tau, optimizer=opt, monitor=monitor)
    model(tokens, return_type="loss").backward()
    monitor.step(0)
    opt.step()
    monitor.close()
    clip.remove()
    assert 0 < len(clip.interventions) < len(model.blocks) * H
    for i, block in enumerate(model.blocks):
        assert clip.last[f"L{i:02d}"] == pytest.approx(before[i], rel=1e-5), "the measured largest logits"
        x = inputs[i]
        with torch.no_grad():
            block.attn(query_input=x, key_input=x, value_input=x)
        after = maxima(i)
        for h in range(H):
            if before[i][h] > tau:
                assert after[h] <= tau * (1 + 1e-5) and after[h] == pytest.approx(tau, rel=1e-5), (i, h)
            else:
                assert after[h] == pytest.approx(before[i][h], rel=1e-6), (i, h, "a head under tau keeps its logits")
