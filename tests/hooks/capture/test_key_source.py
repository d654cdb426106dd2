"""Keys projected from another sequence than the module's input, as in Twins' global sub-sampled attention,
PVT-v2 and SegFormer: ``k, v = kv(norm(conv_stride_r(x)))`` while ``q = q(x)``. The key projection is a module
of its own, so the capture keeps what its ``F.linear`` read and checks the kernel's k against it: with zero
configuration such a layer is confirmed on q and k (a layout proposed from the names alone would be refused),
its metrics equal a float64 per-head reference, and a key split that disagrees with the
model is refused instead of being measured on q alone. What the key projection read counts only where its batch
is the kernel's (keys projected per image and shared by its windows are not), and any of its calls in one
forward may be the one the kernel used.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.layouts.vocab import QKVLayout
from diag.math.attention import stats_from_probabilities_reference
from tests.support.harness import assert_sigma1_by_hand, one_step

E, H, SIDE, B = 32, 4, 8, 3  # 64 tokens; keys 16 (ratio 2) and 4 (ratio 4)
D = E // H
REL = 1e-6


class SubSampled(nn.Module):
    """Queries from every token, keys and values from a ``ratio`` x ``ratio`` strided convolution of the token
    grid. ``interleaved``: the kv projection's rows are [K_h | V_h] per head, not [K | V]."""

    def __init__(self, ratio: int, interleaved: bool = False) -> None:
        super().__init__()
        self.num_heads, self.ratio, self.interleaved = H, ratio, interleaved
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, 2 * E)
        self.sr = nn.Conv2d(E, E, ratio, stride=ratio)
        self.norm = nn.LayerNorm(E)
        self.proj = nn.Linear(E, E)

    def keys_from(self, x: torch.Tensor) -> torch.Tensor:
        grid = x.transpose(1, 2).reshape(x.shape[0], E, SIDE, SIDE)
        return self.norm(self.sr(grid).flatten(2).transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).reshape(b, n, H, D).transpose(1, 2)
        kv = self.kv(self.keys_from(x))
        if self.interleaved:
            k, v = kv.reshape(b, -1, H, 2, D).unbind(3)
        else:
            k, v = kv.reshape(b, -1, 2, H, D).unbind(2)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(b, n, E))


class Pyramid(nn.Module):
    def __init__(self, interleaved: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SubSampled(2, interleaved), SubSampled(4, interleaved)])
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs = []
        for block in self.blocks:
            self.inputs.append(x)
            x = x + block(x)
        return x


def _batch() -> torch.Tensor:
    return torch.randn(B, SIDE * SIDE, E, generator=torch.Generator().manual_seed(3))


def test_keys_from_a_strided_convolution_are_checked_against_what_the_key_projection_read():
    torch.manual_seed(0)
    model = Pyramid().train()
    x = _batch()
    monitor, record, checked, caught = one_step(model, lambda: model(x).pow(2).mean())
    assert monitor.refused == {} and checked == {0: "q,k", 1: "q,k"}, (monitor.refused, checked, caught)
    scalars = record.scalars
    for i, block in enumerate(model.blocks):
        label = f"L{i:02d}"
        assert_sigma1_by_hand(scalars, label, block.q.weight.reshape(H, D, E), block.kv.weight[:E].reshape(H, D, E),
                              rel=1e-5)
        with torch.no_grad():  # float64, per head, keys from the block's own sub-sampled grid
            inp = model.inputs[i][:2].double()  # the capture reads the first 2 sequences
            q = inp @ block.q.weight.double().T + block.q.bias.double()
            grid = inp.transpose(1, 2).reshape(2, E, SIDE, SIDE)
            sub = F.conv2d(grid, block.sr.weight.double(), block.sr.bias.double(), stride=block.ratio)
            src = F.layer_norm(sub.flatten(2).transpose(1, 2), (E,), block.norm.weight.double(),
                               block.norm.bias.double(), block.norm.eps)
            k = src @ block.kv.weight[:E].double().T + block.kv.bias[:E].double()
            logits = torch.stack([q[..., h * D:(h + 1) * D] @ k[..., h * D:(h + 1) * D].transpose(-1, -2)
                                  for h in range(H)], dim=1) / math.sqrt(D)
            allowed = torch.ones(2, SIDE * SIDE, k.shape[1], dtype=torch.bool)
            entropy, _ = stats_from_probabilities_reference(logits.softmax(-1), allowed, 256)
        got = [scalars[f"attn_entropy/{label}/H{h:02d}"] for h in range(H)]
        assert got == pytest.approx(entropy.tolist(), rel=REL), label


def test_a_key_split_that_disagrees_with_the_model_is_refused_not_measured_on_q_alone():
    """The model packs kv per head [K_h | V_h]; a spec reading it as [K | V] splits keys wrongly. Only k shows
    it, and k is projected from the sub-sampled grid: a check of q alone would measure the wrong keys."""
    torch.manual_seed(0)
    model = Pyramid(interleaved=True).train()
    x = _batch()
    spec = {"blocks.*": QKVLayout(n_heads=H, head_dim=D, packing="q_kv", q="q.weight", k="kv.weight")}
    monitor, record, checked, caught = one_step(model, lambda: model(x).pow(2).mean(), spec=spec)
    assert sorted(monitor.refused) == [0, 1], (monitor.refused, checked)
    assert not any(t.startswith(("qk_sigma1/", "attn_entropy/")) for t in record.scalars)
    said = " ".join(caught)
    assert "kernel's k" in said and "blocks.0" in said, said


class TwoKeyCalls(nn.Module):
    """The key projection runs twice (on the even and on the odd tokens); the kernel uses the first."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        k_even, k_odd = self.k_proj(x[:, ::2]), self.k_proj(x[:, 1::2])
        q = self.q_proj(x).reshape(b, n, H, D).transpose(1, 2)
        k = k_even.reshape(b, -1, H, D).transpose(1, 2)
        v = self.v_proj(x[:, ::2]).reshape(b, -1, H, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, E)
        return self.o_proj(out) + 0.0 * k_odd.sum()


class WindowsWithSharedKeys(nn.Module):
    """Queries from windows (batch x windows sequences); keys projected once per image from a context map and
    repeated for each of its windows: what the key projection read has the images' batch, not the kernel's."""

    def __init__(self, windows: int = 4) -> None:
        super().__init__()
        self.num_heads, self.windows = H, windows
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        bw, n, _ = x.shape
        q = self.q_proj(x).reshape(bw, n, H, D).transpose(1, 2)
        k = self.k_proj(context).repeat_interleave(self.windows, 0).reshape(bw, -1, H, D).transpose(1, 2)
        v = self.v_proj(context).repeat_interleave(self.windows, 0).reshape(bw, -1, H, D).transpose(1, 2)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(bw, n, E))


def test_the_key_projection_called_twice_is_confirmed_by_the_call_the_kernel_used():
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": TwoKeyCalls()}).train()
    x = _batch()
    monitor, record, checked, caught = one_step(model, lambda: model["attn"](x).pow(2).mean())
    assert monitor.refused == {} and checked == {0: "q,k"}, (monitor.refused, checked, caught)
    assert_sigma1_by_hand(record.scalars, "L00", model["attn"].q_proj.weight.reshape(H, D, E),
                          model["attn"].k_proj.weight.reshape(H, D, E), rel=1e-5)


def test_keys_shared_by_windows_are_not_compared_with_the_wrong_sequences():
    """The context has 3 images, the kernel 12 windows: the kernel's k is not compared with the context (its
    first sequences are not the kernel's first windows), so the correct layout is kept on q alone, not
    refused."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": WindowsWithSharedKeys()}).train()
    x = torch.randn(4 * B, 9, E, generator=torch.Generator().manual_seed(4))
    context = torch.randn(B, 5, E, generator=torch.Generator().manual_seed(5))
    monitor, record, checked, caught = one_step(model, lambda: model["attn"](x, context).pow(2).mean())
    assert monitor.refused == {} and checked == {0: "q"}, (monitor.refused, checked, caught)
    assert "attn_entropy/L00/H00" in record.scalars
