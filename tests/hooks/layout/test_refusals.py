"""The negative zoo: models whose layout must be refused, never guessed; and every spec a refusal suggests is
run: the one that fits the model is exact, a candidate that does not is refused at the first forward."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_styles import assert_exact, run
from torch import nn

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support.styles import STYLES, E, Net

H, D = 4, 8


def specs_in(message: str) -> list[dict]:
    """Every ``spec={...}`` dict a message offers, evaluated."""
    out, start = [], 0
    while (i := message.find("spec={", start)) >= 0:
        depth, j = 0, i + 5
        for j in range(i + 5, len(message)):
            depth += {"{": 1, "}": -1}.get(message[j], 0)
            if depth == 0:
                break
        out.append(eval(message[i + 5:j + 1], {"QKVLayout": QKVLayout}))  # noqa: S307 - our own message
        start = j + 1
    return out


class Mixer(nn.Module):
    """Attention under a name no adapter reads: one raw fused parameter ``w`` [Q | K | V] and ``n_heads``."""

    def __init__(self, per_head: bool = False) -> None:
        super().__init__()
        self.n_heads, self.per_head = H, per_head
        self.w = nn.Parameter(torch.randn(3 * E, E) / math.sqrt(E))
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        y = x @ self.w.T
        if self.per_head:
            q, k, v = y.unflatten(-1, (H, 3, D)).transpose(1, 2).unbind(3)
        else:
            q, k, v = (z.unflatten(-1, (H, D)).transpose(1, 2) for z in y.chunk(3, -1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class GatedBlock(nn.Module):
    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.mixer, self.attn_gate = Mixer(per_head), nn.Linear(E, E)  # "attn" in a name that is no attention

    def forward(self, x):
        return x + self.mixer(x) * torch.sigmoid(self.attn_gate(x))


class Gated(nn.Module):
    def __init__(self, per_head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([GatedBlock(per_head), GatedBlock(per_head)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _mixer_weights(mixer: Mixer):
    w = mixer.w.detach().double()
    if mixer.per_head:
        per = w.reshape(H, 3, D, E)
        return per[:, 0], per[:, 1]
    return w[:E].reshape(H, D, E), w[E:2 * E].reshape(H, D, E)


@pytest.mark.parametrize("per_head", [False, True])
def test_the_refusal_names_the_modules_that_compute_attention_and_its_specs_work(per_head):
    """Without a capture (nothing could confirm a proposal) the model is refused at construction, with the
    specs the mixer's shapes imply; each offered spec is checked at the first forward."""
    with pytest.raises(SpecError) as info:
        Monitor(Gated(per_head), signals=("spectra", "grads", "updates"))
    message = str(info.value)
    assert "blocks.0.mixer (Mixer) and 1 like it calls attention" in message
    assert "attn_gate" not in message and "head count attribute: 4" in message
    offered = specs_in(message)  # fused, fused_per_head: this module's, no generic example
    assert [s["blocks.*.mixer"].packing for s in offered] == ["fused", "fused_per_head"]
    right, wrong = (offered[1], offered[0]) if per_head else offered
    monitor, record, checked, caught = run(Gated(per_head), right)
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused
    for layer in monitor.layers:
        wq, wk = _mixer_weights(layer.module)
        for h in range(H):
            sigma = torch.linalg.svdvals(wq[h].T @ wk[h])[0].item()
            assert record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=1e-5)
    monitor, record, checked, caught = run(Gated(per_head), wrong)  # the other candidate: refused, not logged
    assert set(monitor.refused) == {0, 1} and not any("/L00" in t for t in record.scalars)
    inferred = specs_in(next(m for m in caught if "not measured at all" in m))[-1]
    assert inferred["blocks.*.mixer"].packing == right["blocks.*.mixer"].packing  # read from the computation


@pytest.mark.parametrize("per_head", [False, True])
def test_a_module_only_the_computation_finds_is_read_from_its_forward(per_head):
    """With attention captured, names that find no layer do not refuse the model at construction: the module whose
    forward computes attention is proposed from its shapes and the first forward confirms the proposal ([all Q | all K |
    all V]) or reads the right one (per head) from the kernel's q and k."""
    monitor, record, checked, caught = run(Gated(per_head))
    assert [la.name for la in monitor.layers] == ["blocks.0.mixer", "blocks.1.mixer"]
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, caught
    assert [la.record.state for la in monitor.layers] == ["adopted" if per_head else "confirmed"] * 2
    for layer in monitor.layers:
        wq, wk = _mixer_weights(layer.module)
        for h in range(H):
            sigma = torch.linalg.svdvals(wq[h].T @ wk[h])[0].item()
            assert record.scalars[f"qk_sigma1/{layer.label}/H{h:02d}"] == pytest.approx(sigma, rel=1e-5)


class Shuffled(nn.Module):
    """Query heads read in reverse block order against key heads in order: no packing says that."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        q, k, v = (z.unflatten(-1, (H, D)).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        q = q.flip(1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class NoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_like = nn.Linear(E, 3 * E)

    def forward(self, x):
        return self.attn_like(x)


def test_a_head_order_no_packing_describes_is_refused_with_what_was_seen():
    model = nn.Sequential(Shuffled(), Shuffled())
    monitor, record, checked, caught = run(model)
    assert set(monitor.refused) == {0, 1} and not any(t.endswith("/L00") or "/L00/" in t for t in record.scalars)
    message = next(m for m in caught if "not measured at all" in m)
    assert "0 (Shuffled)" in message and "kernel q (2, 4, 10, 8)" in message and "no packing" in message


def test_a_model_without_attention_is_refused_at_construction():
    with pytest.raises(SpecError, match="no module's forward calls an attention kernel"):
        Monitor(nn.Sequential(NoAttention()))


@pytest.mark.parametrize("name", ["TileSdpa", "PerGroupRope", "PerHeadNumHeads"])
def test_a_wrong_spec_is_refused_and_the_inferred_spec_is_exact(name):
    """A spec that splits the heads the wrong way (the default pairing, plain fused rows) is refused; the spec
    the refusal reads from the computation is exact."""
    wrong = {"TileSdpa": QKVLayout(H, D, "W_q.weight", "W_k.weight", "W_v.weight", n_kv_heads=2),
             "PerGroupRope": QKVLayout(H, D, "Wqkv.weight", packing="fused", n_kv_heads=2),
             "PerHeadNumHeads": QKVLayout(H, D, "qkv.weight", packing="fused")}[name]
    monitor, _, checked, caught = run(Net(STYLES[name]), {"blocks.*.attn": wrong})
    assert checked == {} and set(monitor.refused) == {0, 1}
    inferred = specs_in(next(m for m in caught if "not measured at all" in m))[-1]
    monitor, record, checked, _ = run(Net(STYLES[name]), inferred)
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused
    assert_exact(monitor, record)  # against the weights read through the model's own code (tests/support/styles.py)


def test_without_the_attention_signal_a_proposal_from_names_is_refused():
    """Nothing would confirm it: its spectra are not logged under a guess."""
    model = Net(STYLES["PerGroupRope"])
    monitor = Monitor(model, every=1, signals=("spectra", "grads"))
    loss = model(torch.randn(2, 6, E)).square().mean()
    loss.backward()
    with pytest.warns(RuntimeWarning, match="not measured at all"):
        monitor.step(0)
    monitor.close()
    assert set(monitor.refused) == {0, 1}


def test_grouped_heads_whose_product_is_invisible_are_refused_with_both_pairings_and_the_right_one_is_exact():
    """Logits from a broadcast product: the capture sees the softmax but not q and k, so the pairing of a
    grouped-query layout cannot be checked; both pairings are offered as specs, and h % G (this model's) is exact."""
    from tests.support.styles import TileBroadcast

    monitor, record, checked, caught = run(Net(TileBroadcast))
    assert set(monitor.refused) == {0, 1} and not any("/L00" in t for t in record.scalars)
    message = next(m for m in caught if "not measured at all" in m)
    default, tiled = specs_in(message)[-2:]
    assert tiled["blocks.*.attn"].kv_map == (0, 1, 0, 1) and default["blocks.*.attn"].kv_map is None
    monitor, record, checked, caught = run(Net(TileBroadcast), tiled)
    assert checked == {0: "heads", 1: "heads"} and not monitor.refused
    assert_exact(monitor, record)


class GroupedWindows(nn.Module):
    """Twins-SVT's locally grouped attention in small: tokens in 2 groups, one 5-D SDPA call (batch, groups,
    heads, tokens, head size) that the capture does not read; generic names, so only a proposal from them."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.qkv = nn.Linear(E, 3 * H * D)
        self.proj = nn.Linear(H * D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, 2, n // 2, 3, H, D).permute(3, 0, 1, 4, 2, 5)
        out = F.scaled_dot_product_attention(*qkv.unbind(0))  # (b, groups, H, n/2, D)
        return self.proj(out.transpose(2, 3).reshape(b, n, H * D))


def test_an_unread_attention_call_leaves_a_proposal_from_names_refused_and_its_spec_measures_the_weight_side():
    """A 5-D SDPA call the capture cannot read leaves the names' proposal unconfirmed: a guess, so the layer is
    refused with the proposal offered as a spec (as it is with eager attention), never measured under the guess;
    with that spec the weight side is measured, exact against the hand-sliced [all Q | all K | all V] rows, and
    the attention statistics are left out."""
    model = nn.Sequential(GroupedWindows())
    x = torch.randn(3, 8, E)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, images=False, sinks=[MemorySink()])
        model(x).square().mean().backward()
        monitor.step(0)
        monitor.close()
    caught = [str(w.message) for w in record]
    assert set(monitor.refused) == {0}
    message = next(m for m in caught if "not measured at all" in m)
    assert "5-D query" in message
    (offered,) = specs_in(message)
    sink = MemorySink()
    monitor = Monitor(model, every=1, spec=offered, images=False, sinks=[sink])
    model.zero_grad()
    model(x).square().mean().backward()
    with pytest.warns(RuntimeWarning, match="5-D query"):  # the attention statistics, and only they, are left out
        monitor.step(0)
    monitor.close()
    scalars = sink.records[0].scalars
    assert not monitor.refused and "attn_entropy/L00/H00" not in scalars
    w = model[0].qkv.weight.detach().double()
    for h in range(H):
        sigma = torch.linalg.svdvals(w[h * D:(h + 1) * D].T @ w[H * D + h * D:H * D + (h + 1) * D])[0].item()
        assert scalars[f"qk_sigma1/L00/H{h:02d}"] == pytest.approx(sigma, rel=1e-5)
