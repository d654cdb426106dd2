"""sigma_1 estimators (diag.math.norms) and the update snapshot/difference routine (diag.math.updates)."""

from __future__ import annotations

import pytest
import torch

from diag.math.norms import largest_row, power_sigma1
from diag.math.updates import stack_by_shape, update_of


def test_power_iteration_is_a_lower_bound_that_converges_when_warm_started():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3, 40, 30, generator=gen, dtype=torch.float64)
    exact = torch.linalg.matrix_norm(a, ord=2)
    v = torch.nn.functional.normalize(torch.randn(3, 2, 30, generator=gen, dtype=torch.float64), dim=2)
    s1, v = power_sigma1(a, v, 1)
    assert (s1 <= exact * (1 + 1e-12)).all()
    for _ in range(200):  # the same matrix, re-estimated step after step from the previous vector
        s, v = power_sigma1(a + 1e-4 * torch.randn(a.shape, generator=gen, dtype=torch.float64), v.unsqueeze(1), 2)
    s, _ = power_sigma1(a, v.unsqueeze(1), 2)
    torch.testing.assert_close(s, exact, rtol=1e-4, atol=0)
    zero, v0 = power_sigma1(torch.zeros(1, 5, 4, dtype=torch.float64), v[:1, None, :4] / v[:1, :4].norm(), 2)
    assert zero.item() == 0 and torch.isfinite(v0).all()
    spike = torch.outer(torch.ones(40, dtype=torch.float64), torch.eye(30, dtype=torch.float64)[7])[None]
    cold = torch.eye(30, dtype=torch.float64)[None, None, 3]  # orthogonal to the spike's direction
    assert power_sigma1(spike, cold, 2)[0].item() == 0  # a warm start can miss a new direction entirely,
    both = torch.cat([cold, largest_row(spike, cold[:, 0])[:, None]], dim=1)
    assert power_sigma1(spike, both, 1)[0].item() == pytest.approx(40 ** 0.5)  # the largest row catches it


def test_stacks_group_by_shape_and_dtype_in_order_and_split_by_bytes():
    gen = torch.Generator().manual_seed(1)
    mats = [torch.randn(6, 4, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(6, 4, generator=gen),
            torch.randn(6, 4, generator=gen).bfloat16(), torch.randn(6, 4, generator=gen, dtype=torch.float64),
            torch.randn(6, 4, generator=gen)]
    stacks = stack_by_shape(list(enumerate(mats)))
    assert [s.members for s in stacks] == [[0, 2, 5], [1], [3], [4]]
    assert [s.before.dtype for s in stacks] == [torch.float32, torch.float32, torch.float32, torch.float64]
    for s in stacks:
        for j, i in enumerate(s.members):
            assert torch.equal(s.before[j], mats[i].to(s.before.dtype))  # a copy, converted exactly
    mats[0].add_(1.0)
    assert not torch.equal(stacks[0].before[0], mats[0])  # a snapshot, not a view
    chunked = stack_by_shape(list(enumerate(mats)), chunk_bytes=2 * 6 * 4 * 4)  # two float32 6 x 4 per stack
    assert [s.members for s in chunked] == [[0, 2], [5], [1], [3], [4]]


def test_the_update_is_after_minus_before_kept_or_in_place():
    gen = torch.Generator().manual_seed(2)
    before = [torch.randn(5, 7, generator=gen) for _ in range(3)]
    after = [w + 1e-3 * torch.randn(5, 7, generator=gen) for w in before]
    kept = stack_by_shape(list(enumerate(before)))[0]
    delta = update_of(kept, after, in_place=False)
    reference = torch.stack([(a.double() - b.double()).float() for a, b in zip(after, before)])  # one rounding
    assert torch.equal(delta, reference)
    assert torch.equal(kept.before, torch.stack(before))  # kept: the base to rescale the step from
    spent = stack_by_shape(list(enumerate(before)))[0]
    minus = update_of(spent, after, in_place=True)
    assert torch.equal(minus, -reference) and spent.before.numel() == 0  # -dW over the snapshot, which is spent
