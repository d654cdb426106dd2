"""Every family x every attention implementation it supports, against slow references.

Tiny random-init models built from configs (2 layers, d_model 32, dropout 0). For each
monitored layer, in the order the Monitor labels them (cross-attention as ``Lxx.cross``):

* spectra against the full SVD of the E x E product Wq_h^T Wk_g, float64, with the
  weights sliced by hand per family (written out here, independently of ``diag``);
* attention entropy and rank against the model's own eager probabilities
  (``output_attentions=True``; ``need_weights=True`` for ``nn.MultiheadAttention``);
* (the max logit: tests/math/test_max_logit_matrix.py, one family x implementation matrix
  with the reference-zoo models, its hand computation in tests/support/references.py);
* gradient norms against hand-sliced ``.grad``;
* the capture's layout check ran with the strongest comparison the call allows;
* the update ratios of W_O: an update of each layer's output projection (sliced by hand,
  BERT's beside the module) alone, against the full SVD, with Q/K/V's exactly 0.

Then property tests (two packings of the same weights; GQA with G = H), structural
discovery of a model defined only here, and the refusals.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout
from diag.math.attention import stats_from_probabilities_reference
from diag.outputs.sinks import MemorySink
from hooks.capture.capture import AttentionCapture
from hooks.layout.discover import discover
from hooks.monitor.monitor import Monitor
from tests.support import zoo
from tests.support.references import N_SEQ, allowed_keys, attention_modules, family, hand_sliced, token_rows

REL = 1e-4
MATRIX = [f"{fam}-{impl}" for fam in zoo.FAMILY_BUILDERS for impl in ("eager", "sdpa")] + ["torch-seq2seq-mha"]


def build(name: str) -> zoo.Case:
    if name == "torch-seq2seq-mha":
        return zoo.torch_seq2seq(dropout=0.0)
    family, impl = name.rsplit("-", 1)
    return zoo.FAMILY_BUILDERS[family](impl, dropout=0.0)


# ------------------------------------------------------------------ by hand, per family (the rest: references.py)


def hand_outputs(case: zoo.Case) -> list[nn.Parameter]:
    """Each attention layer's output projection, in :func:`attention_modules` order (BERT's sits beside it)."""
    m, fam = case.model, family(case)
    if fam in ("bert", "roberta"):
        return [layer.attention.output.dense.weight for layer in getattr(m, fam).encoder.layer]
    names = {"vit": "o_proj", "mistral": "o_proj", "qwen3": "o_proj", "gpt-neox": "dense", "t5": "o",
             "bart": "out_proj", "gpt2-cross": "c_proj", "torch-seq2seq": "out_proj"}
    return [getattr(module, names[fam]).weight for module, _ in attention_modules(case)]


def eager_probabilities(case: zoo.Case, batch: dict) -> list[torch.Tensor]:
    """The model's own eager attention probabilities per layer (N, H, Q, K), float64."""
    fam, n = family(case), N_SEQ
    small = {k: v[:n] for k, v in batch.items()}
    if fam == "torch-seq2seq":
        return _mha_weights(case, small)
    model = type(case.model)._from_config(case.model.config, attn_implementation="eager")
    model.load_state_dict(case.model.state_dict())
    model.eval()
    with torch.no_grad():
        out = model(**small, output_attentions=True)
    if fam in ("t5", "bart"):
        dec = [p for pair in zip(out.decoder_attentions, out.cross_attentions) for p in pair]
        probs = list(out.encoder_attentions) + dec
    elif fam == "gpt2-cross":
        probs = [p for pair in zip(out.attentions, out.cross_attentions) for p in pair]
    else:
        probs = list(out.attentions)
    return [p.double() for p in probs]


def _mha_weights(case: zoo.Case, batch: dict) -> list[torch.Tensor]:
    """nn.MultiheadAttention's own weights: each layer called again on its recorded inputs, need_weights=True."""
    calls, mods = [], [m for m, _ in attention_modules(case)]
    hooks = [m.register_forward_pre_hook(lambda mod, a, kw: calls.append((mod, a, kw)), with_kwargs=True)
             for m in mods]
    with torch.no_grad():
        case.loss(case.model, batch)
        for h in hooks:
            h.remove()
        out = []
        for mod, args, kw in calls:
            kw = dict(kw, need_weights=True, average_attn_weights=False)
            out.append(mod(*args, **kw)[1].double())
    return out


# ------------------------------------------------------------------ the run


def per_head(record, metric: str, label: str, n: int) -> np.ndarray:
    return np.array([record.scalars[f"{metric}/{label}/H{h:02d}"] for h in range(n)])


class Ran:
    def __init__(self, case: zoo.Case) -> None:
        import copy

        self.case, sink = case, MemorySink()
        self.batch = case.make_batch(torch.Generator().manual_seed(3))
        case.model.train()
        self.monitor = Monitor(case.model, every=1, sinks=[sink])
        loss = case.loss(case.model, self.batch)
        loss.backward()
        self.checked = dict(self.monitor.capture.checked)
        self.problems = dict(self.monitor.capture.problems)
        self.monitor.step(0, loss=loss)
        self.monitor.close()
        self.record = sink.records[0]
        self.at_step0 = zoo.Case(case.name, copy.deepcopy(case.model), case.make_batch, case.loss)
        mods = attention_modules(case)
        self.weights = [hand_sliced(case, m, "data") for m, _ in mods]
        self.grads = [hand_sliced(case, m, "grad") for m, _ in mods]


@pytest.fixture(scope="module", params=MATRIX)
def ran(request) -> Ran:
    return Ran(build(request.param))


def test_layers_labels_and_layout_checks(ran):
    mods = attention_modules(ran.case)
    layers = ran.monitor.layers
    assert [layer.module for layer in layers] == [m for m, _ in mods]
    assert [layer.cross for layer in layers] == [c for _, c in mods]
    n_self = sum(1 for _, c in mods if not c)
    selfs = [f"L{i:02d}" for i in range(n_self)]
    assert [layer.label for layer in layers if not layer.cross] == selfs
    for layer in layers:
        if layer.cross:  # shares the index of the decoder self-attention just before it
            before = layers[layer.index - 1]
            assert not before.cross and layer.label == before.label + ".cross"
    assert ran.problems == {}
    impl = "mha" if family(ran.case) == "torch-seq2seq" else ran.case.name.rsplit("-", 1)[1]
    expected = {"eager": "q,k", "sdpa": "q,k", "mha": "exact"}[impl]
    if family(ran.case) == "qwen3":
        expected = "shapes"  # QK-norm: the norm check is skipped (docs/layouts.md)
    assert set(ran.checked.values()) == {expected}, ran.checked


def test_spectra_match_full_svd(ran):
    for layer, w in zip(ran.monitor.layers, ran.weights):
        h_count, g_count, d = w["H"], w["G"], w["D"]
        for h in range(h_count):
            g = h // (h_count // g_count)
            product = w["wq"][h * d : (h + 1) * d].double().T @ w["wk"][g * d : (g + 1) * d].double()  # (E, E)
            ref = torch.linalg.svdvals(product).numpy()[:d]
            tag = f"{layer.label}/H{h:02d}"
            assert ran.record.scalars[f"qk_sigma1/{tag}"] == pytest.approx(ref[0], rel=REL)
            energy, p = ref**2, ref / ref.sum()
            assert ran.record.scalars[f"qk_sec/{tag}"] == pytest.approx(energy[:4].sum() / energy.sum(), rel=REL)
            assert ran.record.scalars[f"qk_stable_rank/{tag}"] == pytest.approx(energy.sum() / energy[0], rel=REL)
            assert ran.record.scalars[f"qk_erank/{tag}"] == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=REL)


def test_entropy_and_rank_match_eager_probabilities(ran):
    probs = eager_probabilities(ran.at_step0, ran.batch)
    assert len(probs) == len(ran.monitor.layers)
    for i, (layer, p) in enumerate(zip(ran.monitor.layers, probs)):
        entropy, rank = stats_from_probabilities_reference(p, allowed_keys(ran.case, ran.batch, i),
                                                           query_valid=token_rows(ran.case, ran.batch, i))
        n = layer.layout.n_heads
        np.testing.assert_allclose(per_head(ran.record, "attn_entropy", layer.label, n), entropy.numpy(), rtol=REL)
        np.testing.assert_allclose(per_head(ran.record, "attn_rank", layer.label, n), rank.numpy(), rtol=REL)


def test_gradient_norms_match_hand_sliced_grad(ran):
    for layer, g in zip(ran.monitor.layers, ran.grads):
        d = g["D"]
        for name, count in (("q", g["H"]), ("k", g["G"]), ("v", g["G"])):
            ref = [g[f"w{name}"][h * d : (h + 1) * d].double().norm().item() for h in range(count)]
            got = per_head(ran.record, f"grad_norm_{name}", layer.label, count)
            np.testing.assert_allclose(got, ref, rtol=REL)


@pytest.mark.parametrize("name", [f"{fam}-eager" for fam in zoo.FAMILY_BUILDERS] + ["torch-seq2seq-mha"])
def test_update_ratio_o_is_each_layers_output_projection(name):
    """Only the W_O of every layer changes (by hand, a different update per layer): update_ratio_o and
    update_fro_o match the full SVD of that change, and every Q/K/V update metric is exactly 0."""
    case = build(name)
    sink = MemorySink()
    monitor = Monitor(case.model, every=2, sinks=[sink], signals=("updates",))
    outputs = hand_outputs(case)
    assert len(monitor.layers) == len(outputs) and all(la.o is o for la, o in zip(monitor.layers, outputs))
    monitor.step(0)
    gen = torch.Generator().manual_seed(11)
    before = [o.detach().double().clone() for o in outputs]
    with torch.no_grad():
        for i, o in enumerate(outputs):
            o += (1e-3 * (i + 1)) * torch.randn(o.shape, generator=gen)
    monitor.close()
    got = {k: v for r in sink.records for k, v in r.scalars.items()}
    for layer, w0, o in zip(monitor.layers, before, outputs):
        dw = o.detach().double() - w0
        ref = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0)[0]
        assert got.pop(f"update_ratio_o/{layer.label}") == pytest.approx(ref.item(), rel=REL)
        assert got.pop(f"update_fro_o/{layer.label}") == pytest.approx((dw.norm() / w0.norm()).item(), rel=REL)
    assert len(got) == 6 * len(monitor.layers) and all(v == 0.0 for v in got.values()), got


class ConvAttention(nn.Module):
    """GPT-2-style Conv1D storage, (in, out), with H*D = 48 != E = 32: W_O is stored (48, 32)."""

    def __init__(self, e: int = 32, h: int = 4, d: int = 12) -> None:
        super().__init__()
        self.h, self.d = h, d
        self.qkv = nn.Parameter(0.2 * torch.randn(e, 3 * h * d))
        self.proj = nn.Parameter(0.2 * torch.randn(h * d, e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.h, self.d).transpose(1, 2) for z in (x @ self.qkv).chunk(3, -1))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1) @ self.proj  # (B, T, E)


def test_non_square_output_projection_in_both_orientations():
    """H*D != E: W_O's orientation is checked (o_transposed follows transposed unless given), and its
    update ratio matches the full SVD whether stored (E, H*D) (LLaMA with head_dim 12) or (H*D, E)."""
    torch.manual_seed(0)
    conv = TinyModel(ConvAttention)
    spec = QKVLayout(4, 12, q="qkv", packing="fused", transposed=True, o="proj")
    assert spec.o_is_transposed
    with pytest.raises(SpecError, match=r"'proj' has shape \(48, 32\).*needs 48 columns"):
        Monitor(conv, spec={"blocks.*": dataclasses.replace(spec, o_transposed=False)})
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=64)
    torch.manual_seed(0)
    llama = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    for model, kw, w_o in ((conv, {"spec": {"blocks.*": spec}}, lambda m: m.blocks[1].proj.T),
                           (llama, {}, lambda m: m.model.layers[1].self_attn.o_proj.weight)):
        sink = MemorySink()
        monitor = Monitor(model, every=2, sinks=[sink], signals=("updates",), **kw)
        assert tuple(w_o(model).shape) == (32, 48)
        monitor.step(0)
        w0 = w_o(model).detach().double().clone()
        with torch.no_grad():
            w_o(model).add_(1e-3 * torch.randn(32, 48, generator=torch.Generator().manual_seed(2)))
        monitor.close()
        got = {k: v for r in sink.records for k, v in r.scalars.items()}
        dw = w_o(model).detach().double() - w0
        ref = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0)[0]
        assert got["update_ratio_o/L01"] == pytest.approx(ref.item(), rel=REL)
        assert got["update_ratio_o/L00"] == got["update_ratio_q/L01"] == 0.0


@pytest.mark.parametrize("fam", list(zoo.FAMILY_BUILDERS))
def test_eager_and_sdpa_agree(fam):
    records = {impl: Ran(build(f"{fam}-{impl}")).record for impl in ("eager", "sdpa")}
    tags = [t for t in records["eager"].scalars if t.startswith("attn_")]
    assert tags and records["sdpa"].scalars.keys() == records["eager"].scalars.keys()
    for tag in tags:
        assert records["sdpa"].scalars[tag] == pytest.approx(records["eager"].scalars[tag], rel=1e-5, abs=1e-6), tag


# ------------------------------------------------------------------ models defined only here


class PackedAttention(nn.Module):
    """Self-attention whose weights are stored in one of several packings; the math is the same.

    The projections are always Wq (H*D, E), Wk, Wv (G*D, E) with heads as row blocks; only
    the storage differs: separate Linear wq/wk/wv, fused rows [Q | K | V], per head
    [Q_h | K_h | V_h] (G = H), or fused and transposed (E, 3E). ``pairing='tile'`` pairs
    query head h with key head h % G instead of h // (H / G) (a model the standard layout
    gets wrong).
    """

    def __init__(self, e: int, h: int, g: int, packing: str, pairing: str = "interleave") -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d, self.packing, self.pairing = h, g, e // h, packing, pairing
        rows = (h + 2 * g) * self.d
        if packing == "separate":
            self.wq = nn.Linear(e, h * self.d)
            self.wk, self.wv = nn.Linear(e, g * self.d), nn.Linear(e, g * self.d)
        else:
            self.qkv = nn.Parameter(torch.zeros(e, rows) if packing == "transposed" else torch.zeros(rows, e))
            self.qkv_bias = nn.Parameter(torch.zeros(rows))
        self.out = nn.Linear(h * self.d, e)

    def load(self, wq, wk, wv, bq, bk, bv) -> PackedAttention:
        with torch.no_grad():
            if self.packing == "separate":
                for lin, w, b in ((self.wq, wq, bq), (self.wk, wk, bk), (self.wv, wv, bv)):
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
                return self
            d = self.d
            if self.packing == "per_head":
                e = wq.shape[1]
                w = torch.stack([wq.view(-1, d, e), wk.view(-1, d, e), wv.view(-1, d, e)], 1).reshape(-1, e)
                b = torch.stack([bq.view(-1, d), bk.view(-1, d), bv.view(-1, d)], 1).reshape(-1)
            else:
                w, b = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
            self.qkv.copy_(w.T if self.packing == "transposed" else w)
            self.qkv_bias.copy_(b)
        return self

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, g, d = self.n_heads, self.n_kv, self.d
        if self.packing == "separate":
            return self.wq(x), self.wk(x), self.wv(x)
        w = self.qkv.T if self.packing == "transposed" else self.qkv
        y = F.linear(x, w, self.qkv_bias)
        if self.packing == "per_head":
            y = y.unflatten(-1, (h, 3, d))
            return y[..., 0, :].flatten(-2), y[..., 1, :].flatten(-2), y[..., 2, :].flatten(-2)
        return y.split([h * d, g * d, g * d], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.projections(x)
        q = q.view(b, t, self.n_heads, self.d).transpose(1, 2)  # (B, H, T, D)
        k, v = (z.view(b, t, self.n_kv, self.d).transpose(1, 2) for z in (k, v))  # (B, G, T, D)
        r = self.n_heads // self.n_kv
        if self.pairing == "tile":
            k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
        else:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class TinyModel(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make(), make()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


E, H = 32, 4


def weights(g: int, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    d = E // H

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    return [(r(H * d, E), r(g * d, E), r(g * d, E), r(H * d), r(g * d), r(g * d)) for _ in range(2)]


def tiny(packing: str, g: int = H, pairing: str = "interleave", seed: int = 0) -> TinyModel:
    torch.manual_seed(0)
    ws = iter(weights(g, seed))
    model = TinyModel(lambda: PackedAttention(E, H, g, packing, pairing).load(*next(ws)))
    for i, block in enumerate(model.blocks):  # the same output projections in every packing
        torch.manual_seed(10 + i)
        block.out.reset_parameters()
    return model


SPECS = {
    "fused": QKVLayout(H, E // H, q="qkv", packing="fused"),
    "per_head": QKVLayout(H, E // H, q="qkv", packing="fused_per_head"),
    "transposed": QKVLayout(H, E // H, q="qkv", packing="fused", transposed=True),
}


def first_record(model: nn.Module, spec=None, seed: int = 1):
    sink = MemorySink()
    x = torch.randn(3, 10, E, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[sink], spec=spec and {"blocks.*": spec})
        loss = model(x).square().mean()
        loss.backward()
        checked = dict(monitor.capture.checked)
        monitor.step(0, loss=loss)
        monitor.close()
    return monitor, sink.records[0], checked, [str(w.message) for w in caught]


def test_structural_discovery_of_a_model_defined_here():
    """wq/wk/wv Linear children and an n_heads attribute: found, checked against the kernel, exact."""
    model = tiny("separate", g=2)
    for block in model.blocks:
        block.n_heads = H  # the only hint: a head count attribute
    monitor, record, checked, caught = first_record(model)
    assert [(la.name, la.layout.adapter, la.layout.kv_heads) for la in monitor.layers] == [
        ("blocks.0", "structural-separate", 2), ("blocks.1", "structural-separate", 2)]
    assert checked == {0: "q,k", 1: "q,k"} and not caught
    d = E // H
    for layer in monitor.layers:
        block = layer.module
        for h in range(H):
            g = h // 2
            product = block.wq.weight[h * d:(h + 1) * d].double().T @ block.wk.weight[g * d:(g + 1) * d].double()
            sigma = torch.linalg.svdvals(product)[0].item()
            assert record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=REL)


@pytest.mark.parametrize("packing", ["fused", "per_head", "transposed"])
def test_two_packings_of_the_same_weights_give_the_same_metrics(packing):
    _, ref, ref_checked, _ = first_record(tiny("separate"), QKVLayout(H, E // H, "wq.weight", "wk.weight",
                                                                      "wv.weight"))
    _, got, checked, caught = first_record(tiny(packing), SPECS[packing])
    assert checked == ref_checked == {0: "q,k", 1: "q,k"} and not caught
    assert got.scalars.keys() == ref.scalars.keys()
    for tag, value in ref.scalars.items():
        assert got.scalars[tag] == pytest.approx(value, rel=1e-5, abs=1e-7), tag


def test_gqa_with_all_kv_heads_equals_plain_mha():
    mha = QKVLayout(H, E // H, "wq.weight", "wk.weight", "wv.weight")
    gqa = QKVLayout(H, E // H, "wq.weight", "wk.weight", "wv.weight", n_kv_heads=H)
    _, ref, _, _ = first_record(tiny("separate"), mha)
    _, got, _, _ = first_record(tiny("separate"), gqa)
    assert got.scalars == pytest.approx(ref.scalars, rel=1e-12)
    mistral = Ran(zoo.mistral("sdpa", kv_heads=H, dropout=0.0))  # a real model: G = H pairs one to one
    assert mistral.problems == {} and mistral.monitor.layers[0].layout.kv_heads == H
    w = mistral.weights[0]
    for h in range(H):
        rows = slice(h * 8, (h + 1) * 8)
        sigma = torch.linalg.svdvals(w["wq"][rows].double().T @ w["wk"][rows].double())[0].item()
        assert mistral.record.scalars[f"qk_sigma1/L00/H{h:02d}"] == pytest.approx(sigma, rel=REL)


# ------------------------------------------------------------------ refusals


def test_unrecognised_model_is_read_from_its_forward_or_refused_clearly_without_one():
    """A fused raw ``qkv`` under no name an adapter reads: with attention captured, the module whose forward
    computes attention is found and its layout confirmed at the first forward, the same metrics as the spec
    gives (before: refused at construction); without a capture, refused with the specs its shapes imply."""
    with pytest.raises(SpecError) as info:
        Monitor(tiny("fused"), signals=("spectra", "grads"))
    message = str(info.value)
    assert "blocks.0 (PackedAttention)" in message and "QKVLayout(" in message and "spec=" in message
    assert "'qkv'" in message and "fused_per_head" in message  # names the weight and both candidate packings
    assert "n_heads=8" not in message  # the specs offered are this module's, never a generic example
    monitor, record, checked, caught = first_record(tiny("fused"))
    assert [la.layout.adapter for la in monitor.layers] == ["computation"] * 2
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused and not caught
    _, ref, _, _ = first_record(tiny("fused"), SPECS["fused"])
    assert record.scalars == pytest.approx(ref.scalars, rel=1e-12)


def test_a_spec_whose_shapes_cannot_fit_is_refused_at_construction():
    model = tiny("fused")
    with pytest.raises(SpecError) as info:
        Monitor(model, spec={"blocks.*": QKVLayout(H, 16, q="qkv", packing="fused")})  # (4+8)*16 rows != 96
    message = str(info.value)
    assert "'blocks.0' (PackedAttention)" in message and "(96, 32)" in message and "needs 192" in message
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("wrong", ["per-head-read-as-fused", "fused-read-as-per-head", "head_dim", "gqa-pairing"])
def test_a_layout_that_disagrees_with_the_model_is_refused(wrong):
    """Quietly wrong is worse than missing: the layer's attention metrics are refused, with the spec to pass."""
    if wrong == "gqa-pairing":  # key head h % G for query head h; the layout says h // (H / G)
        model, spec = tiny("separate", g=2, pairing="tile"), QKVLayout(H, E // H, "wq.weight", "wk.weight",
                                                                         "wv.weight", n_kv_heads=2)
    elif wrong == "head_dim":
        model, spec = tiny("fused"), QKVLayout(2, E // 2, q="qkv", packing="fused")
    else:
        packing = "per_head" if wrong.startswith("per-head") else "fused"
        other = SPECS["fused" if packing == "per_head" else "per_head"]
        model, spec = tiny(packing), other
    monitor, record, checked, caught = first_record(model, spec)
    assert checked == {}
    assert not any(t.startswith("attn_") for t in record.scalars)  # refused, not guessed
    # the head split is suspect, so the weight-side metrics of that layer are refused too
    assert not any("/L00/" in t or t.endswith("/L00") for t in record.scalars)
    refusals = [m for m in caught if "not measured" in m]
    assert len(refusals) == 2
    assert "blocks.0 (PackedAttention)" in refusals[0] and "spec={'blocks.*'" in refusals[0]
    assert "QKVLayout(" in refusals[0]


def test_an_implementation_the_capture_cannot_read_is_refused_before_the_forward():
    """A Hugging Face module configured for flex (or flash) attention: refused, and the mode never entered.

    (A real BERT with attn_implementation='flex_attention' gives the same problem; it is slow on CPU
    and has no backward there, so the module here only carries the config attribute that decides.)
    """
    from types import SimpleNamespace

    from hooks.capture.capture import _Mode

    model = tiny("separate")
    modes = []
    for block in model.blocks:
        block.n_heads = H
        block.config = SimpleNamespace(_attn_implementation="flex_attention")
        block.register_forward_hook(lambda *a: modes.extend(torch.overrides._get_current_function_mode_stack()))
    capture = AttentionCapture(discover(model))
    capture.arm()
    model(torch.randn(2, 6, E)).sum().backward()
    results, problems = capture.take()
    assert results == {} and set(problems) == {0, 1}
    assert "'flex_attention' is not measured" in problems[0] and "sdpa" in problems[0]
    assert not any(isinstance(m, _Mode) for m in modes)


# ------------------------------------------------------------------ safety on the new families


@pytest.mark.parametrize("name", ["bart-sdpa", "t5-eager", "gpt-neox-eager", "gpt2-cross-sdpa", "torch-seq2seq"])
def test_training_is_bit_identical_with_monitor(name):
    """Dropout on, every step sampled: the capture (and its matmul watch) changes nothing."""
    from tests.support.harness import assert_no_function_mode, train

    def make() -> zoo.Case:
        if name == "torch-seq2seq":
            return zoo.torch_seq2seq()
        family_name, impl = name.rsplit("-", 1)
        return zoo.FAMILY_BUILDERS[family_name](impl)

    losses_plain, state_plain = train(make(), steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no refusal, no fault of the monitor
        losses_mon, state_mon = train(make(), steps=3, monitor_kwargs={"every": 1})
    assert all(torch.equal(a, b) for a, b in zip(losses_plain, losses_mon))
    assert state_plain.keys() == state_mon.keys()
    for key in state_plain:
        assert torch.equal(state_plain[key], state_mon[key]), key
    assert_no_function_mode()


def test_gqa_without_padding_takes_sdpa_enable_gqa_and_agrees_with_eager():
    """No attention mask: Hugging Face passes k with G heads and enable_gqa=True; same numbers as eager."""
    records = {}
    for impl in ("eager", "sdpa"):
        base = zoo.mistral(impl, kv_heads=2, dropout=0.0)
        run = Ran(zoo.Case(base.name, base.model, zoo._tokens, zoo._hf_lm_loss))
        assert run.checked == {0: "q,k", 1: "q,k"}
        records[impl] = run.record
    tags = [t for t in records["eager"].scalars if t.startswith("attn_")]
    assert tags
    for tag in tags:
        assert records["sdpa"].scalars[tag] == pytest.approx(records["eager"].scalars[tag], rel=1e-5, abs=1e-6), tag


def test_layer_labels_share_the_block_index_and_never_collide():
    from diag.catalog.tags import layer_labels

    assert layer_labels([False, False, False, True, False, True]) == ["L00", "L01", "L02", "L02.cross", "L03",
                                                                       "L03.cross"]
    assert layer_labels([True, True, False]) == ["L00.cross", "L01.cross", "L02"]  # no self-attention before
    assert layer_labels([False, True, True]) == ["L00", "L00.cross", "L01.cross"]  # a second cross layer
    assert layer_labels([False] * 11 + [True])[-2:] == ["L10", "L10.cross"]


# Every builder of zoo.FAMILY_BUILDERS over a few dozen steps (long enough for AdamW to move every weight far
# from init), dropout on throughout; the families of the 3-step test above with their other implementation.
LONG_STEPS = 24
LONG_CASES = ["bert-sdpa", "roberta-eager", "vit-sdpa", "mistral-eager", "qwen3-sdpa",
              "bart-eager", "t5-sdpa", "gpt-neox-sdpa", "gpt2-cross-eager"]


def test_the_long_bit_identity_test_covers_every_builder():
    assert {name.rsplit("-", 1)[0] for name in LONG_CASES} == set(zoo.FAMILY_BUILDERS)


@pytest.mark.parametrize("name", LONG_CASES)
def test_training_is_bit_identical_with_monitor_over_many_steps(name, tmp_path):
    from tests.support.harness import assert_no_function_mode, assert_no_hooks, assert_states_equal, train

    family_name, impl = name.rsplit("-", 1)
    losses_plain, state_plain = train(zoo.FAMILY_BUILDERS[family_name](impl), steps=LONG_STEPS)
    case = zoo.FAMILY_BUILDERS[family_name](impl)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no refusal, no fault of the monitor
        losses_mon, state_mon = train(case, steps=LONG_STEPS, monitor_kwargs={"every": 1}, tmp_path=tmp_path)
    assert len(losses_plain) == len(losses_mon) == LONG_STEPS
    for step, (a, b) in enumerate(zip(losses_plain, losses_mon)):
        assert torch.equal(a, b), f"loss differs at step {step}: {a.item()!r} vs {b.item()!r}"
    assert_states_equal(state_plain, state_mon)
    assert not torch.equal(losses_plain[0], losses_plain[-1])  # it trained
    text = (tmp_path / "metrics.jsonl").read_text()  # and the monitor measured every step, attention included
    assert '"tag": "attn_entropy/L00/H00"' in text and f'"step": {LONG_STEPS - 1}, "tag": "loss"' in text
    assert_no_hooks(case.model)
    assert_no_function_mode()


def test_layout_check_runs_once_per_layer(monkeypatch):
    """The float64 projection check settles a layer's layout once; later sampled steps skip it."""
    from hooks.layout.book import LayoutBook

    calls = []
    real = LayoutBook._judge

    def counting(self, layer, *args, **kwargs):
        calls.append(layer.index)
        return real(self, layer, *args, **kwargs)

    monkeypatch.setattr(LayoutBook, "_judge", counting)
    case = zoo.nanogpt()
    mem = MemorySink()
    monitor = Monitor(case.model, every=1, sinks=[mem], signals=("attention",))
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        case.loss(case.model, case.make_batch(gen)).backward()
        monitor.step(step)
        case.model.zero_grad()
    monitor.close()
    assert sorted(calls) == [0, 1]
    assert all(any(t.startswith("attn_entropy/L01") for t in r.scalars) for r in mem.records)


def test_unbatched_multihead_attention_with_key_padding_mask_is_measured():
    from diag.outputs.sinks import MemorySink

    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4)

        def forward(self, x, kpm):
            return self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    model = Wrap().train()
    x, kpm = torch.randn(7, 16), torch.tensor([False] * 5 + [True] * 2)  # unbatched: (L, E) and (S,)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink], signals=("attention",))
    model(x, kpm).sum().backward()
    monitor.step(0)
    monitor.close()
    assert not monitor.refused
    with torch.no_grad():
        _, probs = model.attn(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    p = probs.double()  # (H, L, S)
    entropy = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)[:, ~kpm].mean(-1)  # padded query rows do not count
    scalars = sink.records[0].scalars
    logged = [scalars[t] for t in sorted(t for t in scalars if t.startswith("attn_entropy/L00/H"))]
    assert logged == pytest.approx(entropy.tolist(), rel=1e-5)
