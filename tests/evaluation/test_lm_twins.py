"""The nanoGPT's NormSoftmax twin (evaluation.lm): the softmax run's parameters, NormSoftmax in its attention."""

import math

import pytest
import torch

from evaluation.lm import NormSoftmaxAttention, build
from evaluation.spec import RunSpec

TEMPERATURE = 0.5  # evaluation.healthy.TEMPERATURE, written out: the reference must not read the code it checks


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal NormSoftmax per batch, head and query in float64: the logits of the keys the query sees, divided by
    TEMPERATURE times their standard deviation (population), softmax, the values' weighted sum."""
    b, h, t, d = q.shape
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            for r in range(t):
                s = [float(q[i, j, r].double() @ k[i, j, c].double()) / math.sqrt(d) for c in range(r + 1)]
                mean = sum(s) / len(s)
                std = math.sqrt(sum((x - mean) ** 2 for x in s) / len(s) + 1e-6)
                z = [x / (TEMPERATURE * std + 1e-6) for x in s]
                top = max(z)
                w = [math.exp(x - top) for x in z]
                total = sum(w)
                for c in range(r + 1):
                    out[i, j, r] += w[c] / total * v[i, j, c].double()
    return out


def test_the_twin_attends_with_normsoftmax_as_the_reference_does():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=gen) for _ in range(3))
    attn = NormSoftmaxAttention(24, 3)
    assert torch.allclose(attn.attend(q, k, v).double(), reference(q, k, v), atol=1e-5)


@pytest.mark.parametrize("twin", ["", "normsoftmax", "qknorm"])
def test_the_twin_starts_from_the_same_weights_and_only_its_attention_differs(twin):
    spec = RunSpec("lm", 0, 1e-3, 10, twin=twin)
    torch.manual_seed(0)
    base, _ = build(RunSpec("lm", 0, 1e-3, 10), 50)
    torch.manual_seed(0)
    model, cfg = build(spec, 50)
    if twin != "qknorm":  # QK-norm adds LayerNorms: the others hold the same parameters, equal
        assert [n for n, _ in base.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert all(torch.equal(a, b) for a, b in zip(base.parameters(), model.parameters()))
    kinds = {type(block.attn).__name__ for block in model.h}
    assert kinds == ({"NormSoftmaxAttention"} if twin == "normsoftmax" else {"SelfAttention"})
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    same = torch.equal(base(idx, idx), model(idx, idx))
    assert same == (twin == "")


def test_the_normsoftmax_twin_learns():
    torch.manual_seed(0)
    model, _ = build(RunSpec("lm", 0, 1e-3, 10, twin="normsoftmax"), 20)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.arange(32).remainder(20).view(2, 16)  # a periodic sequence: the next token from the context
    first = None
    for _ in range(30):
        loss = model(idx, idx.roll(-1, dims=1))
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isfinite(loss.item()) and loss.item() < 0.5 * first
