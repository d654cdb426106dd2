"""Every metric of the Monitor against a slow, obviously correct reference.

On each architecture of the zoo (random init, 2 layers): spectra against the full
SVD of the E x E product in float64; attention entropy and rank against the
model's own eager attention probabilities (``output_attentions=True``, or
``need_weights=True, average_attn_weights=False``) with per-head loops; gradient
norms against hand-sliced ``.grad`` (Q/K/V sliced by tests/support/references.py); update
ratios of W_Q, W_K, W_V and W_O against the full SVD of the applied update, with
W_O sliced by hand too (and shown to be the output projection: an update of it
alone moves ``update_ratio_o`` alone). The max logit of these models is checked in
tests/math/test_max_logit_matrix.py, in the one family x implementation matrix.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from diag.math.attention import stats_from_probabilities_reference
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo
from tests.support.references import attention_modules, hand_sliced

REL = 1e-4
CASES = ["nanogpt", "gpt2-eager", "gpt2-sdpa", "llama-eager", "llama-sdpa", "torch-encoder"]


def build(name: str) -> zoo.Case:
    if name == "nanogpt":
        return zoo.nanogpt(dropout=0.0)
    if name.startswith("gpt2"):
        return zoo.gpt2(name.split("-")[1], dropout=0.0)
    if name.startswith("llama"):
        return zoo.llama(name.split("-")[1], dropout=0.0)
    return zoo.torch_encoder(dropout=0.0)


def hand_o(case: zoo.Case, module: torch.nn.Module) -> torch.Tensor:
    """W_O as (out, in) = (E, H*D), written out per family: the parameter that maps the heads back."""
    if case.name == "nanogpt":
        return module.c_proj.weight
    if case.name.startswith("gpt2"):
        return module.c_proj.weight.T  # Conv1D stores (in, out)
    if case.name.startswith("llama"):
        return module.o_proj.weight
    return module.out_proj.weight


def per_head(record, metric: str, label: str, n: int) -> np.ndarray:
    return np.array([record.scalars[f"{metric}/{label}/H{h:02d}"] for h in range(n)])


@dataclasses.dataclass
class Ran:
    case: zoo.Case
    monitor: Monitor
    record: object  # the Record of step 0
    updates: dict  # update scalars of step 0
    batch: dict
    grads: list  # hand-sliced dict(wq, wk, wv, bq, bk, H, G, D) of .grad per layer at step 0
    before: list  # hand-sliced (Wq, Wk, Wv, Wo) before optimizer step 0
    after: list
    at_step0: zoo.Case  # the same case with a copy of the model as it was at step 0


def run_two_steps(case: zoo.Case) -> Ran:
    """Step 0 sampled (every=2), then an optimizer step, then step 1: update ratios of step 0."""
    sink = MemorySink()
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    batch = case.make_batch(torch.Generator().manual_seed(3))
    case.model.train()
    monitor = Monitor(case.model, every=2, sinks=[sink])
    loss = case.loss(case.model, batch)
    loss.backward()
    monitor.step(0, loss=loss)
    at_step0 = dataclasses.replace(case, model=copy.deepcopy(case.model))
    mods = [m for m, _ in attention_modules(case)]
    grads = [hand_sliced(case, m, "grad") for m in mods]
    before = [_qkvo(case, m) for m in mods]
    opt.step()
    opt.zero_grad()
    loss = case.loss(case.model, case.make_batch(torch.Generator().manual_seed(4)))
    loss.backward()
    monitor.step(1, loss=loss)
    monitor.close()
    after = [_qkvo(case, m) for m in mods]
    main = sink.records[0]
    updates = {k: v for r in sink.records[1:] if r.step == 0 for k, v in r.scalars.items()
               if not k.startswith("alerts/")}  # (the large_early_updates note of step 0 is written at step 0 too)
    return Ran(case, monitor, main, updates, batch, grads, before, after, at_step0)


def _qkvo(case: zoo.Case, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Copies of the hand-sliced (Wq, Wk, Wv, Wo), each (out, in)."""
    w = hand_sliced(case, module, "data")
    return tuple(t.detach().clone() for t in (w["wq"], w["wk"], w["wv"], hand_o(case, module)))


@pytest.fixture(scope="module", params=CASES)
def ran(request) -> Ran:
    return run_two_steps(build(request.param))


def test_spectra_match_full_svd(ran):
    case, record = ran.case, ran.record
    for layer, (wq, wk, _, _) in zip(ran.monitor.layers, ran.before):  # weights of step 0
        w = hand_sliced(case, layer.module, "data")
        n_heads, n_kv, d = w["H"], w["G"], w["D"]
        for h in range(n_heads):
            g = h // (n_heads // n_kv)
            product = wq[h * d : (h + 1) * d].double().T @ wk[g * d : (g + 1) * d].double()  # (E, E)
            ref = torch.linalg.svdvals(product).numpy()[:d]
            got_sigma = record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"]
            assert got_sigma == pytest.approx(ref[0], rel=REL)
            energy, p = ref**2, ref / ref.sum()
            expected = {
                "qk_sec": energy[:4].sum() / energy.sum(),
                "qk_stable_rank": energy.sum() / energy[0],
                "qk_erank": math.exp(-(p * np.log(p)).sum()),
            }
            for metric, value in expected.items():
                assert record.scalars[f"{metric}/{layer.label}/H{h:02d}"] == pytest.approx(value, rel=REL)
        spectrum = record.histograms[f"qk_spectrum/{layer.label}"]
        assert spectrum.shape == (n_heads * d,)


def reference_attention(case: zoo.Case, batch: dict) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The model's own eager probabilities per layer (N, H, Q, K), allowed keys (N, Q, K), and which query
    rows are tokens (N, Q): padded rows (right padding) do not count."""
    model, n = case.model, 2
    ids = batch["input_ids"][:n]
    seq = ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    with torch.no_grad():
        if case.name.startswith(("gpt2", "llama")):
            mask = batch["attention_mask"][:n]
            eager = type(model)._from_config(model.config, attn_implementation="eager")
            eager.load_state_dict(model.state_dict())
            eager.eval()  # output_attentions returns the weights after attention dropout
            out = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
            return [a.double() for a in out.attentions], causal[None] & mask[:, None, :].bool(), mask.bool()
        if case.name == "nanogpt":
            probs, x = [], model.drop(model.wte(ids) + model.wpe(torch.arange(seq)))
            for block in model.h:
                probs.append(block.attn.reference_probs(block.ln_1(x)))
                x = block(x)
            return probs, causal[None].expand(n, -1, -1), torch.ones(n, seq, dtype=torch.bool)
        pad = batch["pad"][:n]
        probs, x = [], model.emb(ids)
        for layer in model.encoder.layers:
            _, w = layer.self_attn(x, x, x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
            probs.append(w.double())
            x = layer(x, src_key_padding_mask=pad)
        return probs, (~pad)[:, None, :].expand(n, seq, seq), ~pad


def test_attention_entropy_and_rank_match_eager_probabilities(ran):
    record = ran.record
    probs, allowed, tokens = reference_attention(ran.at_step0, ran.batch)
    for layer, p in zip(ran.monitor.layers, probs):
        entropy, rank = stats_from_probabilities_reference(p, allowed, query_valid=tokens)
        n = layer.layout.n_heads
        np.testing.assert_allclose(per_head(record, "attn_entropy", layer.label, n), entropy.numpy(), rtol=REL)
        np.testing.assert_allclose(per_head(record, "attn_rank", layer.label, n), rank.numpy(), rtol=REL)


def test_gradient_norms_match_hand_sliced_grad(ran):
    record = ran.record
    for layer, g_ in zip(ran.monitor.layers, ran.grads):
        gq, gk, gv, n_heads, n_kv, d = (g_[k] for k in ("wq", "wk", "wv", "H", "G", "D"))
        for name, g, count in (("q", gq, n_heads), ("k", gk, n_kv), ("v", gv, n_kv)):
            ref = [g[h * d : (h + 1) * d].double().norm().item() for h in range(count)]
            np.testing.assert_allclose(per_head(record, f"grad_norm_{name}", layer.label, count), ref, rtol=REL)
        ratio = (np.mean(per_head(record, "grad_norm_q", layer.label, n_heads))
                 + np.mean(per_head(record, "grad_norm_k", layer.label, n_kv))) / (
            2 * np.mean(per_head(record, "grad_norm_v", layer.label, n_kv)))
        assert record.scalars[f"grad_ratio_qk_v/{layer.label}"] == pytest.approx(ratio, rel=REL)


def test_update_ratios_match_full_svd(ran):
    updates = ran.updates
    assert len(updates) == 8 * len(ran.monitor.layers)  # ratio and fro of q, k, v, o: nothing else
    for layer, b, a in zip(ran.monitor.layers, ran.before, ran.after):
        for name, w0, w1 in zip("qkvo", b, a):
            dw = (w1 - w0).double()
            spectral = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0.double())[0]
            fro = dw.norm() / w0.double().norm()
            assert updates[f"update_ratio_{name}/{layer.label}"] == pytest.approx(spectral.item(), rel=REL)
            assert updates[f"update_fro_{name}/{layer.label}"] == pytest.approx(fro.item(), rel=REL)
            assert spectral.item() > 0


@pytest.mark.parametrize("name", CASES)
def test_an_update_of_the_output_projection_alone_moves_update_ratio_o_alone(name):
    """Between the snapshot and the measurement only W_O of layer 1 changes (by hand, no optimizer):
    update_ratio_o/L01 is the full-SVD ratio of that change and every other update metric is exactly 0."""
    case = build(name)
    sink = MemorySink()
    monitor = Monitor(case.model, every=2, sinks=[sink], signals=("updates",))
    monitor.step(0)
    module = attention_modules(case)[1][0]
    wo = hand_o(case, module)
    w0 = wo.detach().double().clone()
    delta = 1e-3 * torch.randn(wo.shape, generator=torch.Generator().manual_seed(7))
    delta[:, 0] *= 30  # a dominant direction: sigma_1 of the update well separated
    with torch.no_grad():
        wo += delta
    monitor.close()
    got = {k: v for r in sink.records for k, v in r.scalars.items()}
    dw = wo.detach().double() - w0
    ref = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0)[0]
    assert got.pop("update_ratio_o/L01") == pytest.approx(ref.item(), rel=REL)
    assert got.pop("update_fro_o/L01") == pytest.approx((dw.norm() / w0.norm()).item(), rel=REL)
    assert set(got) == {f"update_{m}_{x}/{lab}" for m in ("ratio", "fro") for x in "qkvo" for lab in ("L00", "L01")
                        } - {"update_ratio_o/L01", "update_fro_o/L01"}
    assert all(v == 0.0 for v in got.values()), got


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_and_sdpa_agree(family):
    """The same weights give the same attention metrics whether softmax or fused SDPA is seen."""
    records = {}
    for impl in ("eager", "sdpa"):
        case = build(f"{family}-{impl}")
        records[impl] = run_two_steps(case).record
    tags = [t for t in records["eager"].scalars if t.startswith("attn_")]
    assert tags
    for tag in tags:
        assert records["sdpa"].scalars[tag] == pytest.approx(records["eager"].scalars[tag], rel=1e-5, abs=1e-6)


def test_gqa_with_all_kv_heads_equals_mha():
    """LLaMA with n_kv_heads == n_heads: K heads pair one-to-one, as in plain multi-head attention."""
    ran = run_two_steps(zoo.llama("sdpa", kv_heads=4, dropout=0.0))
    record = ran.record
    module = ran.at_step0.model.model.layers[0].self_attn
    wq, wk = module.q_proj.weight.detach().double(), module.k_proj.weight.detach().double()
    for h in range(4):
        rows = slice(h * 8, (h + 1) * 8)
        ref = torch.linalg.svdvals(wq[rows].T @ wk[rows])[0].item()
        assert record.scalars[f"qk_sigma1/L00/H{h:02d}"] == pytest.approx(ref, rel=REL)


def test_mha_with_separate_kdim_vdim_weights():
    """nn.MultiheadAttention with kdim/vdim != embed_dim stores q/k/v_proj_weight separately."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=10, batch_first=True)
    sink = MemorySink()
    monitor = Monitor(mha, every=1, sinks=[sink])
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 12)
    out, _ = mha(q, kv, torch.randn(2, 7, 10))
    out.sum().backward()
    monitor.step(0)
    monitor.close()
    record = sink.records[0]
    for h in range(2):
        rows = slice(h * 8, (h + 1) * 8)
        ref = torch.linalg.svdvals(mha.q_proj_weight[rows].double().T @ mha.k_proj_weight[rows].double())[0]
        assert record.scalars[f"qk_sigma1/L00/H{h:02d}"] == pytest.approx(ref.item(), rel=REL)
    with torch.no_grad():
        _, w = mha(q, kv, torch.randn(2, 7, 10), need_weights=True, average_attn_weights=False)
    entropy, _ = stats_from_probabilities_reference(w[:2].double(), torch.ones(2, 5, 7, dtype=torch.bool))
    np.testing.assert_allclose(per_head(record, "attn_entropy", "L00", 2), entropy.numpy(), rtol=REL)
