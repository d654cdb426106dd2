"""timm's VisionTransformer against slow references; runs in .venv-timm only (``pytest -m timm``).

timm needs torchvision, which does not import beside the CPU torch of the main venv, so
.ci/run builds a second venv (torch 2.14.1, torchvision 0.29.1, timm) for this file. timm is
imported at the top on purpose: without it this file fails, it is never skipped.

Tiny random-init ViTs (img 32, patch 8: 16 patches + the class token; E 32, 4 heads, 2 blocks),
with timm's fused attention (``F.scaled_dot_product_attention``) and without it (explicit
``attn.softmax(dim=-1)``), with and without QK-norm (``qk_norm=True``: a LayerNorm over each
head's q and k, its gains and biases randomised here so that they matter). timm has no
``output_attentions``, so every reference is computed by hand from the attention module's own
input, recorded by a forward pre-hook in the monitored forward itself:

* spectra against the float64 full SVD of the E x E product Wq_h^T Wk_h, sliced by hand from
  ``qkv.weight`` (rows [all Q | all K | all V]);
* attention entropy and rank against probabilities computed in float64 per head, in loops:
  ``x @ qkv`` sliced by hand, the q/k LayerNorms written out, ``scale``, softmax;
* the max logit against the same logits;
* gradient norms against hand-sliced ``qkv.weight.grad``; update ratios against the full SVD of the
  applied update;
* training with dropout on is bit-for-bit the same with and without ``Monitor(every=1)``.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from diag.layouts.adapters import find_layout
from diag.math.attention import stats_from_probabilities_reference
from diag.outputs.sinks import MemorySink
from hooks.layout.discover import module_view
from hooks.monitor.monitor import Monitor
from tests.support import zoo
from tests.support.harness import assert_sigma1_by_hand, one_step
from tests.support.references import assert_max_logits

pytestmark = pytest.mark.timm

REL = 1e-4
N_SEQ = 2  # the Monitor's default attn_seqs
E, H, DEPTH, IMG, PATCH, CLASSES = 32, 4, 2, 32, 8, 10
D = E // H
TOKENS = 1 + (IMG // PATCH) ** 2
CASES = [(fused, qk_norm) for fused in (True, False) for qk_norm in (False, True)]


def case_id(case: tuple[bool, bool]) -> str:
    fused, qk_norm = case
    return ("sdpa" if fused else "softmax") + ("-qknorm" if qk_norm else "")


def build(fused: bool, qk_norm: bool, drop: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=PATCH, embed_dim=E, depth=DEPTH,
        num_heads=H, num_classes=CLASSES, qk_norm=qk_norm, drop_rate=drop, attn_drop_rate=drop,
        proj_drop_rate=drop,
    )
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.fused_attn = fused  # timm reads this flag at every forward
            # timm's init (std 0.02) gives near-uniform attention, which a wrong reference could match too
            block.attn.qkv.weight.copy_(0.2 * torch.randn(block.attn.qkv.weight.shape, generator=gen))
            block.attn.qkv.bias.copy_(0.1 * torch.randn(block.attn.qkv.bias.shape, generator=gen))
            if qk_norm:  # init is gain 1, bias 0: randomise so that a reference that forgot them fails
                for norm in (block.attn.q_norm, block.attn.k_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
                    norm.bias.copy_(0.3 * torch.randn(norm.bias.shape, generator=gen))
    return model


def make_batch(gen: torch.Generator, n: int = 4) -> dict:
    return {"x": torch.randn(n, 3, IMG, IMG, generator=gen), "y": torch.randint(0, CLASSES, (n,), generator=gen)}


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


# ------------------------------------------------------------------ by hand


def hand_sliced(attn: nn.Module, attr: str) -> tuple[torch.Tensor, ...]:
    """(Wq, Wk, Wv) as (H*D, E) and (bq, bk) from timm's qkv Linear: rows [all Q | all K | all V]."""
    w = getattr(attn.qkv.weight, attr)
    a = attn.num_heads * attn.head_dim
    b = attn.qkv.bias.detach()
    return w[:a], w[a : 2 * a], w[2 * a : 3 * a], b[:a], b[a : 2 * a]


def layer_norm_by_hand(v: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """timm's qk_norm LayerNorm over the head dimension, in float64."""
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)
    return (v - mean) / torch.sqrt(var + norm.eps) * norm.weight.detach().double() + norm.bias.detach().double()


def logits_by_hand(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, H, T, T) float64 logits from the module input x (N, T, E), one head at a time.

    Both of timm's paths give these: SDPA scales by head_dim ** -0.5 itself, the explicit path multiplies q
    by ``attn.scale`` (the same number) before ``q @ k^T``.
    """
    wq, wk, _, bq, bk = (t.detach().double() for t in hand_sliced(attn, "data"))
    x = x.double()
    heads = []
    for h in range(attn.num_heads):
        rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        q = x @ wq[rows].T + bq[rows]  # (N, T, D)
        k = x @ wk[rows].T + bk[rows]
        if isinstance(attn.q_norm, nn.LayerNorm):
            q, k = layer_norm_by_hand(q, attn.q_norm), layer_norm_by_hand(k, attn.k_norm)
        else:
            assert isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)
        heads.append(q @ k.transpose(-1, -2) * attn.scale)
    return torch.stack(heads, dim=1)


def softmax_by_hand(logits: torch.Tensor) -> torch.Tensor:
    """Row by row, float64: exp(s - max) / sum."""
    out = torch.empty_like(logits)
    for i in range(logits.shape[0]):
        for h in range(logits.shape[1]):
            for r in range(logits.shape[2]):
                e = torch.exp(logits[i, h, r] - logits[i, h, r].max())
                out[i, h, r] = e / e.sum()
    return out


def per_head(record, metric: str, label: str, n: int = H) -> np.ndarray:
    return np.array([record.scalars[f"{metric}/{label}/H{h:02d}"] for h in range(n)])


# ------------------------------------------------------------------ the run


class Ran:
    """One monitored training step (every=1, dropout 0), the attention inputs recorded in that same forward."""

    def __init__(self, fused: bool, qk_norm: bool) -> None:
        self.fused, self.qk_norm = fused, qk_norm
        self.model = model = build(fused, qk_norm)
        self.attns = [block.attn for block in model.blocks]
        self.inputs: dict[int, torch.Tensor] = {}
        hooks = [a.register_forward_pre_hook(lambda mod, args, i=i: self.inputs.setdefault(i, args[0].detach().clone()))
                 for i, a in enumerate(self.attns)]
        sink = MemorySink()
        model.train()
        self.monitor = Monitor(model, every=1, sinks=[sink])
        batch = make_batch(torch.Generator().manual_seed(3))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no refusal, no fault of the monitor
            loss = loss_fn(model, batch)
            loss.backward()
            self.checked = dict(self.monitor.capture.checked)
            self.problems = dict(self.monitor.capture.problems)
            self.monitor.step(0, loss=loss)
        self.monitor.close()
        for hook in hooks:
            hook.remove()
        self.record = sink.records[0]


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def ran(request) -> Ran:
    return Ran(*request.param)


def test_timm_attention_is_found_with_the_timm_layout(ran):
    layers = ran.monitor.layers
    assert [layer.module for layer in layers] == ran.attns
    assert [layer.label for layer in layers] == ["L00", "L01"]
    for layer in layers:
        lay = layer.layout
        assert (lay.adapter, lay.packing, lay.n_heads, lay.head_dim, lay.q) == ("timm", "fused", H, D, "qkv.weight")
        assert lay.verify is not ran.qk_norm  # QK-norm: the per-head norm check cannot hold
    assert ran.problems == {}
    assert ran.checked == ({0: "shapes", 1: "shapes"} if ran.qk_norm else {0: "q,k", 1: "q,k"})
    assert ran.monitor.refused == {}


def test_spectra_match_full_svd(ran):
    for layer, attn in zip(ran.monitor.layers, ran.attns):
        wq, wk, *_ = hand_sliced(attn, "data")
        for h in range(H):
            rows = slice(h * D, (h + 1) * D)
            ref = torch.linalg.svdvals(wq[rows].double().T @ wk[rows].double()).numpy()[:D]  # (E, E) product
            tag = f"{layer.label}/H{h:02d}"
            energy, p = ref**2, ref / ref.sum()
            assert ran.record.scalars[f"qk_sigma1/{tag}"] == pytest.approx(ref[0], rel=REL)
            assert ran.record.scalars[f"qk_sec/{tag}"] == pytest.approx(energy[:4].sum() / energy.sum(), rel=REL)
            assert ran.record.scalars[f"qk_stable_rank/{tag}"] == pytest.approx(energy.sum() / energy[0], rel=REL)
            assert ran.record.scalars[f"qk_erank/{tag}"] == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=REL)
        assert ran.record.histograms[f"qk_spectrum/{layer.label}"].shape == (H * D,)


def test_entropy_and_rank_match_probabilities_by_hand(ran):
    allowed = torch.ones(N_SEQ, TOKENS, TOKENS, dtype=torch.bool)  # ViT: every token sees every token
    for i, layer in enumerate(ran.monitor.layers):
        x = ran.inputs[i][:N_SEQ]
        assert x.shape == (N_SEQ, TOKENS, E)
        probs = softmax_by_hand(logits_by_hand(ran.attns[i], x))
        entropy, rank = stats_from_probabilities_reference(probs, allowed)
        np.testing.assert_allclose(per_head(ran.record, "attn_entropy", layer.label), entropy.numpy(), rtol=REL)
        np.testing.assert_allclose(per_head(ran.record, "attn_rank", layer.label), rank.numpy(), rtol=REL)
        assert entropy.min() > 0.5 and rank.min() > 1.5  # not a degenerate case that any answer would match


def test_max_logit_matches_logits_by_hand(ran):
    for i, layer in enumerate(ran.monitor.layers):
        logits = logits_by_hand(ran.attns[i], ran.inputs[i][:N_SEQ])
        assert logits.shape[1] == H
        assert_max_logits(ran.record.scalars, layer.label, logits, rel=REL)


def test_gradient_norms_match_hand_sliced_grad(ran):
    for layer, attn in zip(ran.monitor.layers, ran.attns):
        gq, gk, gv, *_ = hand_sliced(attn, "grad")
        means = {}
        for name, g in (("q", gq), ("k", gk), ("v", gv)):
            ref = [g[h * D : (h + 1) * D].double().norm().item() for h in range(H)]
            got = per_head(ran.record, f"grad_norm_{name}", layer.label)
            np.testing.assert_allclose(got, ref, rtol=REL)
            means[name] = np.mean(ref)
        ratio = (means["q"] + means["k"]) / (2 * means["v"])
        assert ran.record.scalars[f"grad_ratio_qk_v/{layer.label}"] == pytest.approx(ratio, rel=REL)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_update_ratios_match_full_svd(case):
    """Step 0 sampled (every=2), an AdamW step, step 1: the update ratios of step 0 against the applied update."""
    model = build(*case)
    model.train()
    sink = MemorySink()
    monitor = Monitor(model, every=2, sinks=[sink])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    attns = [block.attn for block in model.blocks]
    for step in range(2):
        loss = loss_fn(model, make_batch(torch.Generator().manual_seed(3 + step)))
        loss.backward()
        monitor.step(step, loss=loss)
        if step == 0:
            before = [[w.detach().clone() for w in (*hand_sliced(a, "data")[:3], a.proj.weight)] for a in attns]
            opt.step()
            opt.zero_grad()
    monitor.close()
    after = [[*hand_sliced(a, "data")[:3], a.proj.weight] for a in attns]  # W_O: timm's proj (E, H*D)
    updates = {k: v for r in sink.records if r.step == 0 for k, v in r.scalars.items() if k.startswith("update_")}
    assert len(updates) == 8 * len(monitor.layers)  # ratio and fro of q, k, v, o
    for layer, b, a in zip(monitor.layers, before, after):
        for name, w0, w1 in zip("qkvo", b, a):
            dw = (w1.detach() - w0).double()
            spectral = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0.double())[0]
            fro = dw.norm() / w0.double().norm()
            assert spectral.item() > 0
            assert updates[f"update_ratio_{name}/{layer.label}"] == pytest.approx(spectral.item(), rel=REL)
            assert updates[f"update_fro_{name}/{layer.label}"] == pytest.approx(fro.item(), rel=REL)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_is_bit_identical_with_monitor(case):
    """Dropout on (tokens, attention, projections, head), every step sampled: the capture changes nothing."""
    from tests.support.harness import assert_no_function_mode, train

    def make() -> zoo.Case:
        return zoo.Case("timm-vit", build(*case, drop=0.2), make_batch, loss_fn)

    losses_plain, state_plain = train(make(), steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        losses_mon, state_mon = train(make(), steps=3, monitor_kwargs={"every": 1})
    assert all(torch.equal(a, b) for a, b in zip(losses_plain, losses_mon))
    assert len(set(float(x) for x in losses_plain)) == 3  # it trained
    assert state_plain.keys() == state_mon.keys()
    for key in state_plain:
        assert torch.equal(state_plain[key], state_mon[key]), key
    assert_no_function_mode()


def test_dropout_really_draws_in_the_bit_identical_runs():
    """The bit-identical test would be weak if dropout drew nothing: two seeds give two losses."""
    model = build(True, False, drop=0.2)
    model.train()
    batch = make_batch(torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    a = loss_fn(model, batch)
    torch.manual_seed(2)
    b = loss_fn(model, batch)
    assert not torch.equal(a, b)


def test_other_timm_attention_classes_are_not_taken_for_it():
    """Same class name, a qkv of the same (3E, E) shape, other packings: BEiT (q_bias, v_bias), EfficientFormer
    (per-head [Q_h | K_h | V_h] rows and attention biases). The timm adapter must leave them alone."""
    from timm.models.beit import Attention as BeitAttention
    from timm.models.efficientformer import Attention as EfficientFormerAttention

    beit = BeitAttention(E, num_heads=H, qkv_bias=True)
    eff = EfficientFormerAttention(E, key_dim=D, num_heads=H, attn_ratio=1, resolution=4)
    for module in (beit, eff):
        view = module_view("blocks.0.attn", module)
        assert view.cls == "Attention" and view.params["qkv.weight"] == (3 * E, E)
        layout = find_layout(view)
        assert layout is None or layout.adapter != "timm", (type(module), layout)


def test_the_monitor_leaves_the_model_as_it_found_it():
    model = build(False, True)
    before = copy.deepcopy(model.state_dict())
    monitor = Monitor(model, every=1, sinks=[MemorySink()])
    model.train()
    loss_fn(model, make_batch(torch.Generator().manual_seed(9))).backward()
    monitor.step(0)
    monitor.close()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not block.attn._forward_pre_hooks and not block.attn._forward_hooks for block in model.blocks)


def test_timm_checkpoint_analysed_offline_like_live(tmp_path):
    """A timm state dict (no config beside it) with --heads: the same per-head spectra as the Monitor."""
    from safetensors.torch import save_file

    from diag.offline.series import analyze_checkpoints

    model = build(fused=True, qk_norm=False)
    mem = MemorySink()
    with Monitor(model, every=1, sinks=[mem], signals=("spectra",)) as monitor:
        monitor.step(0)
    live = {t: v for t, v in mem.records[0].scalars.items() if t.startswith("qk_")}
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp_path / "vit.safetensors")
    analysis = analyze_checkpoints([tmp_path / "vit.safetensors"], heads=H)
    assert not analysis.failures, analysis.failures
    offline = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith("qk_")}
    assert sorted(offline) == sorted(live) and any("/H03" in t for t in live)
    for tag, value in live.items():
        assert offline[tag] == pytest.approx(value, rel=1e-9, abs=1e-12), tag


def test_timm_vit_example_runs_and_writes_every_signal(tmp_path):
    """examples/06_timm_vit.py as a script: timm's layout found, the four families and the loss at the
    sampled steps, the alerts it printed are the alerts it wrote."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "examples" / "06_timm_vit.py"), "--logdir", str(tmp_path),
                             "--steps", "11"], capture_output=True, text=True, timeout=300, cwd=root,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "L00  blocks.0.attn  adapter timm  4 heads of 16" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for tag in ("qk_sigma1/L01/H03", "attn_entropy/L00/H00", "attn_rank/L01/H02", "grad_norm_v/L00/H01",
                "update_ratio_k/L01", "loss"):
        assert sorted(r["step"] for r in rows if r["tag"] == tag) == [0, 5, 10], tag
    printed = sorted(tuple(line.split()[2:6]) for line in result.stdout.splitlines() if line.startswith("alert "))
    # a run-wide alert (large_early_updates) has no location: its printed line ends after the kind
    written = sorted(tuple(f for f in (str(a["step"]), a["level"], a["kind"], a["where"]) if f)
                     for a in map(json.loads, (tmp_path / "alerts.jsonl").read_text().splitlines()))
    assert printed == written
    assert f"tensorboard --logdir {tmp_path}" in result.stdout


def _one_image_step(model: nn.Module, size: int, batch: int = 2, **monitor_kwargs):
    """:func:`harness.one_step` on random images, the loss the mean square of the logits, no images written."""
    x = torch.randn(batch, 3, size, size)
    return one_step(model, lambda: model(x).pow(2).mean(), images=False, **monitor_kwargs)


def test_maxvit_channels_last_windows_with_no_spec():
    """MaxViT's AttentionCl takes its windows channels-last, (batch, height, width, C), and packs qkv as
    [all Q | all K | all V], or per head [Q_h | K_h | V_h] with ``head_first`` (``view(B, -1, heads,
    3 * dim_head).chunk(3)``). The 4-D input is read as (batch, tokens, C), so the kernel's q and k are
    compared with it (before: the names' proposal could not be confirmed and every layer was refused).
    sigma_1 of every head is the full SVD of Wq_h^T Wk_h sliced by hand as each module's flag says."""
    torch.manual_seed(0)
    model = timm.create_model("maxvit_tiny_tf_224", pretrained=False, num_classes=10, img_size=64).train()
    monitor, record, checked, caught = _one_image_step(model, 64)
    assert not monitor.refused and set(checked.values()) == {"q,k"}, [m[:300] for m in caught]
    scalars = record.scalars
    for layer in monitor.layers:
        attn = dict(model.named_modules())[layer.name]
        heads, d = attn.num_heads, attn.dim_head
        w = attn.qkv.weight
        if attn.head_first:  # by hand: per head [Q_h | K_h | V_h]
            wq, wk = w.reshape(heads, 3, d, -1)[:, 0], w.reshape(heads, 3, d, -1)[:, 1]
        else:  # [all Q | all K | all V]
            wq, wk = w.reshape(3, heads, d, -1)[0], w.reshape(3, heads, d, -1)[1]
        assert_sigma1_by_hand(scalars, layer.label, wq, wk, rel=REL)
        assert f"attn_entropy/{layer.label}/H00" in scalars


def test_xcit_attention_across_channels_gets_its_spec_offered_and_then_its_weight_side():
    """XCiT's XCA multiplies (batch, heads, channels, tokens) q and k: attention across channels, not tokens.
    No computation can confirm the names' proposal, so with no spec the layer is refused and the message offers
    the proposal as a spec; with that spec the spectra are measured (exact against hand slicing of qkv, rows
    [all Q | all K | all V]) and the attention statistics, which would describe channels, are left out."""
    torch.manual_seed(0)

    def run(spec=None):
        model = timm.create_model("xcit_nano_12_p16_224", pretrained=False, num_classes=10, img_size=64).train()
        monitor, record, _, said = _one_image_step(model, 64, spec=spec)
        return model, monitor, record.scalars, said

    _, monitor, _, said = run()
    xca = [i for i, layer in enumerate(monitor.layers) if type(layer.module).__name__ == "XCA"]
    assert xca and all(i in monitor.refused for i in xca)
    assert any("attention across channels" in m and "spec={'blocks.*.attn': QKVLayout(n_heads=4, head_dim=32, "
               "q='qkv.weight', packing='fused'" in m for m in said), said[:2]
    from diag.layouts.vocab import QKVLayout

    spec = {"blocks.*.attn": QKVLayout(n_heads=4, head_dim=32, q="qkv.weight", packing="fused", o="proj.weight")}
    model, monitor, scalars, said = run(spec)
    assert not any(i in monitor.refused for i in xca), said[:2]
    for i in xca:
        layer = monitor.layers[i]
        w = layer.module.qkv.weight  # by hand: [all Q | all K | all V]
        assert_sigma1_by_hand(scalars, layer.label, w[:128].reshape(4, 32, -1), w[128:256].reshape(4, 32, -1),
                              rel=REL)
        assert f"attn_entropy/{layer.label}/H00" not in scalars


def test_tiny_vit_norm_inside_the_attention_module_with_no_spec():
    """TinyViT's Attention normalises its input itself (``self.norm``) before ``qkv``, packed per head
    [Q_h | K_h | V_h]: the kernel's q and k are the projections of norm(x), not of x. The layout is read from
    the computation through that norm (before: no block fitted and every layer was refused). sigma_1 of every
    head is the full SVD of the raw Wq_h^T Wk_h sliced by hand."""
    torch.manual_seed(0)
    model = timm.create_model("tiny_vit_5m_224", pretrained=False, num_classes=10).train()
    monitor, record, checked, caught = _one_image_step(model, 224, batch=1)
    assert monitor.layers and not monitor.refused and set(checked.values()) == {"q,k"}, [m[:300] for m in caught]
    scalars = record.scalars
    for layer in monitor.layers:
        attn = dict(model.named_modules())[layer.name]
        assert attn.key_dim == attn.val_dim
        w = attn.qkv.weight.reshape(attn.num_heads, 3, attn.key_dim, -1)  # by hand: per head q, k, v
        assert_sigma1_by_hand(scalars, layer.label, w[:, 0], w[:, 1], rel=REL)


@pytest.mark.parametrize("name", ["pvt_v2_b0", "twins_pcpvt_small"])
def test_keys_from_a_sub_sampled_grid_with_no_spec(name):
    """PVT-v2's Attention and Twins' GlobalSubSampleAttn project queries from every token and keys and values
    (``kv``, rows [all K | all V]) from ``norm(sr(x))``, a strided convolution of the token grid: the kernel's
    k has fewer tokens than the module's input. The capture checks k against what ``kv`` itself read (before:
    only q could be compared, the names' proposal was not confirmed and every sub-sampled layer was refused:
    6 of 8 and 13 of 16). sigma_1 against the full SVD of the hand-sliced product; attention entropy against
    float64 per-head probabilities from the inputs ``q`` and ``kv`` really got."""
    torch.manual_seed(0)
    kwargs = {} if name.startswith("pvt") else {"img_size": 64}
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()
    seen: dict[str, dict[str, torch.Tensor]] = {}
    attns = {n: m for n, m in model.named_modules() if hasattr(m, "kv") and hasattr(m, "q")}
    handles = [getattr(m, part).register_forward_pre_hook(
        lambda mod, args, n=n, part=part: seen.setdefault(n, {}).setdefault(part, args[0].detach()))
        for n, m in attns.items() for part in ("q", "kv")]
    try:
        monitor, record, checked, caught = _one_image_step(model, 64)
    finally:
        for handle in handles:
            handle.remove()
    assert len(monitor.layers) == len(attns) and not monitor.refused, [m[:300] for m in caught]
    assert set(checked.values()) == {"q,k"}, checked
    scalars = record.scalars
    for layer in monitor.layers:
        attn = attns[layer.name]
        heads, width = attn.num_heads, attn.q.weight.shape[0]
        d = width // heads
        wk = attn.kv.weight[:width]  # by hand: [all K | all V]
        assert_sigma1_by_hand(scalars, layer.label, attn.q.weight.reshape(heads, d, -1), wk.reshape(heads, d, -1),
                              rel=REL)
        with torch.no_grad():
            x, src = seen[layer.name]["q"][:N_SEQ].double(), seen[layer.name]["kv"][:N_SEQ].double()
            q = x @ attn.q.weight.double().T + attn.q.bias.double()
            k = src @ wk.double().T + attn.kv.bias[:width].double()
            logits = torch.stack([q[..., h * d:(h + 1) * d] @ k[..., h * d:(h + 1) * d].transpose(-1, -2)
                                  for h in range(heads)], dim=1) * attn.scale
            allowed = torch.ones(N_SEQ, q.shape[1], k.shape[1], dtype=torch.bool)
            entropy, rank = stats_from_probabilities_reference(logits.softmax(-1), allowed, 256)
        for h in range(heads):
            assert scalars[f"attn_entropy/{layer.label}/H{h:02d}"] == pytest.approx(float(entropy[h]), rel=REL)
            assert scalars[f"attn_rank/{layer.label}/H{h:02d}"] == pytest.approx(float(rank[h]), rel=REL)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["cait_xxs24_224", "volo_d1_224"])
def test_class_attention_is_checked_on_q_and_k_at_any_batch(name, batch):
    """CaiT's ClassAttn (``q``, ``k``, ``v``) and VOLO's ClassAttention (``q``, ``kv`` = [all K | all V]) take
    their single query from the class token. At batch 1 that query also fits the (1, T, E) input read
    time-first (T sequences of one token): that reading was taken, so CaiT's class attention was checked on
    shapes only and VOLO's, a proposal from names, was refused. sigma_1 of the class-attention heads against
    the full SVD of the hand-sliced product."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, img_size=64).train()
    monitor, record, checked, caught = _one_image_step(model, 64, batch=batch)
    assert not monitor.refused and set(checked.values()) == {"q,k"}, (checked, [m[:300] for m in caught])
    classes = [layer for layer in monitor.layers if type(layer.module).__name__ in ("ClassAttn", "ClassAttention")]
    assert len(classes) == 2
    for layer in classes:
        attn = layer.module
        heads, width = attn.num_heads, attn.q.weight.shape[0]
        wk = attn.k.weight if hasattr(attn, "k") else attn.kv.weight[:width]  # by hand: kv rows [all K | all V]
        assert_sigma1_by_hand(record.scalars, layer.label, attn.q.weight.reshape(heads, width // heads, -1),
                              wk.reshape(heads, width // heads, -1), rel=REL)
        assert f"attn_entropy/{layer.label}/H00" in record.scalars
