"""The Hugging Face models' NormSoftmax twin (evaluation.healthy.normsoftmax_attention): its fast path (each query's
logit spread from the keys' moments, then SDPA) computes the same function as the full logit matrix, values and
gradients, causal or not, with grouped-query attention; padding takes the full matrix."""

import math

import pytest
import torch

from evaluation.healthy import _exact, normsoftmax_attention

TEMPERATURE = 0.5  # evaluation.healthy.TEMPERATURE, written out: the reference must not read the code it checks


class Causal:
    is_causal = True


class Bidirectional:
    is_causal = False


def per_query(q, k, v, visible) -> torch.Tensor:
    """NormSoftmax per batch, head and query in float64 over the keys ``visible(b, t)`` lists."""
    b, h, t, d = q.shape
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            for r in range(t):
                keys = visible(i, r)
                s = [float(q[i, j, r].double() @ k[i, j, c].double()) / math.sqrt(d) for c in keys]
                mean = sum(s) / len(s)
                std = math.sqrt(sum((x - mean) ** 2 for x in s) / len(s) + 1e-6)
                z = [x / (TEMPERATURE * std + 1e-6) for x in s]
                w = [math.exp(x - max(z)) for x in z]
                for c, wc in zip(keys, w):
                    out[i, r, j] += wc / sum(w) * v[i, j, c].double()
    return out


def _inputs(seed, b=2, h=4, g=4, t=19, d=8, offset=0.0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(b, g, t, d, generator=gen, dtype=torch.float64) * scale + offset  # keys away from 0
    v = torch.randn(b, g, t, d, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("module", [Causal, Bidirectional])
@pytest.mark.parametrize("seed,groups,offset,scale", [(0, 1, 0.0, 1.0), (1, 2, 3.0, 1.0), (2, 4, 10.0, 4.0)])
def test_the_fast_path_is_the_full_matrix_values_and_gradients(module, seed, groups, offset, scale):
    q, k, v = _inputs(seed, g=4 // groups, offset=offset, scale=scale)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    fast, weights = normsoftmax_attention(module, q, k, v, None)
    assert weights is None  # SDPA computed it
    kr, vr = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    valid = torch.ones(19, 19, dtype=torch.bool)
    valid = valid.tril() if module.is_causal else valid
    full, _ = _exact(q, kr, vr, valid, 8 ** -0.5)
    assert torch.allclose(fast, full, atol=1e-9)
    probe = torch.randn(fast.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = torch.autograd.grad((fast * probe).sum(), (q, k, v))
    want = torch.autograd.grad((full * probe).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-8 * b.abs().max().item())
    if seed == 0:  # and both are NormSoftmax as written out per query
        keys = (lambda i, r: range(r + 1)) if module.is_causal else (lambda i, r: range(19))
        assert torch.allclose(fast.detach(), per_query(q.detach(), k.detach(), v.detach(), keys), atol=1e-9)


def test_padding_takes_the_full_matrix_and_masks_the_padded_keys():
    q, k, v = _inputs(3, b=2, h=2, g=2, t=9, d=4)
    pad = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    pad[1, ..., 6:] = False  # the second sequence's last 3 positions are padding
    out, weights = normsoftmax_attention(Bidirectional, q, k, v, pad)
    assert weights is not None and torch.all(weights[1, ..., 6:] == 0)
    want = per_query(q, k, v, lambda i, r: range(9) if i == 0 else range(6))
    assert torch.allclose(out, want, atol=1e-9)


def test_in_float32_the_fast_path_stays_within_float32_rounding_of_the_function():
    q, k, v = _inputs(4, b=2, h=4, g=4, t=64, d=16, offset=5.0, scale=3.0)
    fast, _ = normsoftmax_attention(Causal, q.float(), k.float(), v.float(), None)
    full, _ = _exact(q, k, v, torch.ones(64, 64, dtype=torch.bool).tril(), 0.25)
    assert (fast.double() - full).abs().max() < 1e-4
