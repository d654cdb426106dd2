"""hooks.QKClip: each head's largest logit, measured, against float64 logits by hand; the clipped heads land on
tau and the others keep their weights bit for bit, on every packing; a healthy run is the run without it."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from diag.errors import ConfigError
from diag.layouts.vocab import QKVLayout
from diag.outputs.sinks import MemorySink
from hooks import QKClip
from hooks.layout.discover import discover
from hooks.monitor.monitor import Monitor
from tests.support import references, styles, zoo

CASES = {
    "nanogpt": lambda: zoo.nanogpt(dropout=0.0),
    "gpt2-eager": lambda: zoo.gpt2("eager", dropout=0.0),
    "gpt2-sdpa": lambda: zoo.gpt2("sdpa", dropout=0.0),
    "llama-sdpa-gqa": lambda: zoo.llama("sdpa", kv_heads=2, dropout=0.0),
    "llama-eager-gqa": lambda: zoo.llama("eager", kv_heads=2, dropout=0.0),
    "llama-sdpa-mqa": lambda: zoo.llama("sdpa", kv_heads=1, dropout=0.0),
    "torch-encoder": lambda: zoo.torch_encoder(dropout=0.0),
}


def _grow_qk(layers, factor: float) -> None:
    """Large logits: every Q/K/V weight of the attention layers times ``factor`` (V does not change a logit)."""
    with torch.no_grad():
        for layer in layers:
            for p in layer.params().values():
                p.mul_(factor)


def _between(values: list[float]) -> float:
    """A tau between the two middle values: about half the heads exceed it."""
    flat = sorted(v for v in values if math.isfinite(v))
    k = len(flat) // 2
    return (flat[k - 1] + flat[k]) / 2


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_heads_land_on_tau_and_the_others_keep_their_logits(name, monkeypatch):
    """One step with a zero learning rate, so the clip alone moves the weights: on the inputs each layer saw, the
    float64 logits by hand (every sequence, token rows, allowed keys) of a clipped head top out at tau, those of
    the other heads are unchanged, and the largest logit QKClip measured is the one by hand."""
    monkeypatch.setattr(references, "N_SEQ", zoo.BATCH)  # the whole batch, as QKClip reads it
    case = CASES[name]()
    _grow_qk(discover(case.model), 4.0 if "gpt2" not in name else 40.0)
    batch = case.make_batch(torch.Generator().manual_seed(0))
    before = dataclasses.replace(case, model=copy.deepcopy(case.model))
    ref = [references.max_logit_by_hand(lg) for lg in references.logits_by_hand(before, batch, before)]
    tau = _between([v for row in ref for v in row])
    opt = torch.optim.SGD(case.model.parameters(), lr=0.0)
    clip = QKClip(case.model, tau, optimizer=opt)
    case.loss(case.model, batch).backward()
    opt.step()
    after = [references.max_logit_by_hand(lg) for lg in references.logits_by_hand(before, batch, before, case)]
    labels = [layer.label for layer in clip.layers]
    clipped = {(i.layer, i.head) for i in clip.interventions}
    assert clipped == {(labels[i], h) for i, row in enumerate(ref) for h, s in enumerate(row) if s > tau}
    assert clipped and all(i.step == 0 and i.factor == pytest.approx(tau / i.max_logit) for i in clip.interventions)
    for i, row in enumerate(ref):
        assert clip.last[labels[i]] == pytest.approx(row, rel=1e-5), "the measured largest logits"
        for h, s in enumerate(row):
            if s > tau:
                assert after[i][h] <= tau * (1 + 1e-5) and after[i][h] == pytest.approx(tau, rel=1e-5), (i, h)
            else:
                assert after[i][h] == s, (i, h, "a head under tau keeps its logits")


def test_grouped_query_rule_scales_each_key_head_once(monkeypatch):
    """LLaMA, 4 query heads on 2 key heads, alpha=0.3: a key head is scaled by (max f over its group)^0.7 and
    each query head by f_h / that, read off the hand-sliced weights; a group with a head under tau keeps its
    keys bit for bit."""
    case = zoo.llama("sdpa", kv_heads=2, dropout=0.0)
    _grow_qk(discover(case.model), 4.0)
    batch = case.make_batch(torch.Generator().manual_seed(1))
    before = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.0)
    probe = QKClip(case.model, 1e9)
    case.loss(case.model, batch).backward()
    probe.step()
    probe.remove()
    values = [v for row in probe.last.values() for v in row]
    clip = QKClip(case.model, _between(values), alpha=0.3, optimizer=opt)
    case.loss(case.model, batch).backward()
    opt.step()
    seen_k = set()
    for index, (layer, old) in enumerate(zip(case.model.model.layers, before.model.layers)):
        label = clip.layers[index].label
        f = [min(1.0, clip.tau / s) for s in clip.last[label]]
        new_w = references.hand_sliced(case, layer.self_attn, "data")
        old_w = references.hand_sliced(case, old.self_attn, "data")
        d = new_w["D"]
        for g in range(2):
            k_factor = max(f[2 * g:2 * g + 2]) ** 0.7
            rows = slice(g * d, (g + 1) * d)
            if k_factor == 1.0:
                assert torch.equal(new_w["wk"][rows], old_w["wk"][rows])
            else:
                seen_k.add((label, g))
                torch.testing.assert_close(new_w["wk"][rows], old_w["wk"][rows] * k_factor, rtol=1e-6, atol=0)
            for h in (2 * g, 2 * g + 1):
                rows_q = slice(h * d, (h + 1) * d)
                torch.testing.assert_close(new_w["wq"][rows_q], old_w["wq"][rows_q] * (f[h] / k_factor),
                                           rtol=1e-6, atol=0)
                assert f[h] / k_factor <= 1.0
        assert torch.equal(new_w["wv"], old_w["wv"])
    assert clip.interventions


SPECS = {
    "FusedHeadsAttr": QKVLayout(4, 8, q="qkv.weight", packing="fused"),
    "PerHeadNumHeads": QKVLayout(4, 8, q="qkv.weight", packing="fused_per_head"),
    "PerGroupRope": QKVLayout(4, 8, q="Wqkv.weight", packing="fused_per_group", n_kv_heads=2),
    "Heads3D": QKVLayout(4, 8, q="Wq", k="Wk", v="Wv", packing="heads_3d", transposed=True),
    "QPlusKV": QKVLayout(4, 8, q="to_q.weight", k="to_kv.weight", packing="q_kv", n_kv_heads=2),
    "RawTransposed": QKVLayout(4, 8, q="Wq", k="Wk", v="Wv", n_kv_heads=2, transposed=True),
}


def _style_max_logits(net: styles.Net, inputs: list[torch.Tensor]) -> list[list[float]]:
    """Per block, per query head: the largest causal float64 logit of the module's own q and k (RoPE included)
    on the given inputs, with its key head paired as the module pairs it."""
    out = []
    for block, x in zip(net.blocks, inputs):
        attn = copy.deepcopy(block.attn).double()
        with torch.no_grad():
            q, k = attn.shape_qk(*attn.qk(x.double()))
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        row = []
        for h in range(attn.n_q):
            logits = q[:, h] @ k[:, attn.kv_of(h)].transpose(-1, -2) / math.sqrt(q.shape[-1])
            row.append(logits.masked_fill(~causal, -math.inf).max().item())
        out.append(row)
    return out


@pytest.mark.parametrize("style", list(SPECS))
def test_every_packing_clips_the_rows_of_its_heads(style):
    """Fused, per head, per group with RoPE, q_kv, 3-D per-head and raw transposed weights, through SDPA and
    matmul + softmax: the clipped heads' logits on the same inputs top out at tau, the others are unchanged."""
    net = styles.Net(styles.STYLES[style])
    spec = {"blocks.*.attn": SPECS[style]}
    _grow_qk(discover(net, spec), 3.0)
    x = torch.randn(3, 12, styles.E, generator=torch.Generator().manual_seed(2))
    before = copy.deepcopy(net)
    inputs: list[torch.Tensor] = []
    handles = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in before.blocks]
    with torch.no_grad():
        before(x)
    for handle in handles:
        handle.remove()
    ref = _style_max_logits(before, inputs)
    tau = _between([v for row in ref for v in row])
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    clip = QKClip(net, tau, optimizer=opt, spec=spec)
    net(x).pow(2).mean().backward()
    opt.step()
    after = _style_max_logits(net, inputs)
    assert clip.interventions
    for i, row in enumerate(ref):
        assert clip.last[clip.layers[i].label] == pytest.approx(row, rel=1e-5)
        for h, s in enumerate(row):
            if s > tau:
                assert after[i][h] == pytest.approx(tau, rel=1e-5) and after[i][h] <= tau * (1 + 1e-5)
            else:
                assert after[i][h] == s


@pytest.mark.parametrize("name", ["nanogpt", "llama-sdpa"])
def test_a_healthy_run_is_the_run_without_it_bit_for_bit(name):
    """tau above every logit: the same losses, parameters and optimizer state bit for bit, and the same global
    RNG state after the run (dropout on: the model draws, QKClip draws nothing)."""
    build = {"nanogpt": lambda: zoo.nanogpt(dropout=0.1), "llama-sdpa": lambda: zoo.llama("sdpa", dropout=0.1)}
    results = []
    for with_clip in (True, False):
        case = build[name]()
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
        clip = QKClip(case.model, 1e6, optimizer=opt) if with_clip else None
        gen = torch.Generator().manual_seed(3)
        torch.manual_seed(4)
        losses = []
        for _ in range(4):
            loss = case.loss(case.model, case.make_batch(gen))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if clip is not None:
            assert clip.step_count == 4 and clip.interventions == [] and len(clip.last) == len(clip.layers)
        results.append((losses, [p.detach().clone() for p in case.model.parameters()], opt.state_dict(),
                        torch.get_rng_state()))
    (l1, p1, s1, r1), (l2, p2, s2, r2) = results
    assert l1 == l2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s1["state"].values(), s2["state"].values()) for k in a)
    assert torch.equal(r1, r2)


def test_interventions_are_logged_through_the_monitor_and_the_state_round_trips():
    case = zoo.nanogpt(dropout=0.0)
    sink = MemorySink()
    monitor = Monitor(case.model, every=1, sinks=[sink], signals=("attention", "spectra"))
    _grow_qk(monitor.layers, 4.0)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.0)
    clip = QKClip(case.model, 5.0, optimizer=opt, monitor=monitor)
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        case.loss(case.model, case.make_batch(gen)).backward()
        monitor.step(step)
        opt.step()
        opt.zero_grad()
    monitor.close()
    scalars = {(r.step, t): v for r in sink.records for t, v in r.scalars.items()}
    first = [i for i in clip.interventions if i.step == 0]
    assert first and scalars[(0, "qk_clip_heads")] == len(first)
    for i in first:
        assert scalars[(0, f"qk_clip_max_logit/{i.layer}/H{i.head:02d}")] == pytest.approx(i.max_logit)
        assert scalars[(0, f"qk_clip_factor/{i.layer}/H{i.head:02d}")] == pytest.approx(5.0 / i.max_logit)
    assert scalars[(0, "alerts/qk_clip")] == 1.0
    alert = next(a for a in monitor.alert_sink.history if a.kind == "qk_clip")
    assert alert.level == "info" and len(alert.heads) == len(first)
    assert (1, "qk_clip_max_logit/L00") in scalars  # a sampled step logs each layer's largest logit
    assert any(t.startswith("attn_max_logit/") for _, t in scalars), "the Monitor's capture ran beside it"
    state = clip.state_dict()
    assert state == {"tau": 5.0, "alpha": 0.5, "step_count": 2, "interventions": len(clip.interventions)}
    resumed = QKClip(zoo.nanogpt(dropout=0.0).model, 5.0)
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.state_dict() == state


def test_qk_norm_layers_are_refused_by_name_and_can_be_excluded():
    case = zoo.qwen3("sdpa", dropout=0.0)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn.*QK-norm.*exclude="):
        QKClip(case.model, 100.0)
    with pytest.raises(ConfigError, match=r"exclude=.*leaves no attention layer"):
        QKClip(case.model, 100.0, exclude=["model.layers.*.self_attn"])


@pytest.mark.parametrize("kwargs, pattern", [
    ({"tau": 0.0}, r"tau=0\.0.*> 0"),
    ({"tau": "100"}, r"tau='100'"),
    ({"tau": float("inf")}, r"tau=inf"),
    ({"alpha": 1.5}, r"alpha=1\.5.*\[0, 1\]"),
    ({"every": 0}, r"every=0.*>= 1"),
    ({"optimizer": "adam"}, r"optimizer=.*torch\.optim\.Optimizer.*clip\.step\(\)"),
    ({"monitor": object()}, r"monitor=.*hooks\.Monitor"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, pattern):
    model = zoo.nanogpt(dropout=0.0).model
    with pytest.raises(ConfigError, match=pattern):
        QKClip(model, **kwargs)


def test_a_guessed_layout_needs_a_spec_or_a_monitor():
    with pytest.raises(ConfigError, match=r"blocks\.0\.attn.*proposed.*monitor=.*spec="):
        QKClip(styles.Net(styles.PerHeadNumHeads), 10.0)
    with pytest.raises(ConfigError, match=r"model=.*nn\.Module"):
        QKClip(nn.Linear(2, 2).weight, 10.0)


def test_every_reads_and_clips_only_on_its_steps():
    """every=2: the forwards of steps 0 and 2 are read and clipped, step 1's is not read at all."""
    case = zoo.nanogpt(dropout=0.0)
    _grow_qk(discover(case.model), 4.0)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.0)
    clip = QKClip(case.model, 5.0, optimizer=opt, every=2)
    gen = torch.Generator().manual_seed(6)
    armed = []
    for _ in range(3):
        armed.append(clip.reader.armed)
        case.loss(case.model, case.make_batch(gen)).backward()
        opt.step()
    assert armed == [True, False, True]
    assert {i.step for i in clip.interventions} <= {0, 2} and any(i.step == 0 for i in clip.interventions)
