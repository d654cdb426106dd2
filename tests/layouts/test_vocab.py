"""The layout vocabulary: every packing split by hand, kv_map pairing, the JSON round trip."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout, qkv_views, shape_problem, split_qkv, split_qkv_bias

H, G, D, E = 4, 2, 3, 10


def _heads(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, D, E, generator=gen)


@pytest.fixture
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return _heads(gen, H), _heads(gen, G), _heads(gen, G)


def _check(layout: QKVLayout, tensors: dict, want: tuple) -> None:
    assert shape_problem(layout, {n: tuple(t.shape) for n, t in tensors.items()}) is None
    for got, ref in zip(split_qkv(tensors, layout), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_fused_per_group_rows(qkv):
    q, k, v = qkv
    r = H // G
    rows = torch.cat([torch.cat([q[g * r:(g + 1) * r].reshape(-1, E), k[g], v[g]]) for g in range(G)])
    _check(QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G), {"w": rows}, qkv)
    _check(QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G, transposed=True), {"w": rows.T}, qkv)


WRITABLE = {  # every packing, in both storage orientations where it has two: (layout, parameter shapes)
    "separate": (QKVLayout(H, D, "a", "b", "c", n_kv_heads=G), {"a": (H * D, E), "b": (G * D, E), "c": (G * D, E)}),
    "fused": (QKVLayout(H, D, "w", packing="fused", n_kv_heads=G), {"w": ((H + 2 * G) * D, E)}),
    "fused-t": (QKVLayout(H, D, "w", packing="fused", n_kv_heads=G, transposed=True), {"w": (E, (H + 2 * G) * D)}),
    "per-head": (QKVLayout(H, D, "w", packing="fused_per_head"), {"w": (3 * H * D, E)}),
    "per-group": (QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G), {"w": ((H + 2 * G) * D, E)}),
    "per-group-t": (QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G, transposed=True),
                    {"w": (E, (H + 2 * G) * D)}),
    "mqa-per-group": (QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=1), {"w": ((H + 2) * D, E)}),
    "q_kv": (QKVLayout(H, D, "q", "kv", packing="q_kv", n_kv_heads=G), {"q": (H * D, E), "kv": (2 * G * D, E)}),
    "codegen": (QKVLayout(H, D, "w", packing="fused_per_group", groups=2, order="qvk"), {"w": (3 * H * D, E)}),
    "codegen-t": (QKVLayout(H, D, "w", packing="fused_per_group", groups=2, order="qvk", transposed=True),
                  {"w": (E, 3 * H * D)}),
    "groups-gqa": (QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G, groups=2, order="kvq"),
                   {"w": ((H + 2 * G) * D, E)}),
    "heads_3d": (QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G),
                 {"a": (H, D, E), "b": (G, D, E), "c": (G, D, E)}),
    "heads_3d-t": (QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G, transposed=True),
                   {"a": (H, E, D), "b": (G, E, D), "c": (G, E, D)}),
}


@pytest.mark.parametrize("case", sorted(WRITABLE))
def test_qkv_views_write_through_to_the_rows_split_qkv_reads(case):
    """What the step limit writes through qkv_views lands in the weight, in exactly the rows split_qkv reads for
    that role (split_qkv's Q of fused_per_group is a copy: a write through it was lost)."""
    layout, shapes = WRITABLE[case]
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for value, view in zip((1.0, 2.0, 3.0), qkv_views(tensors, layout)):
        view.copy_(torch.full_like(view, value))
    for value, part in zip((1.0, 2.0, 3.0), split_qkv(tensors, layout)):
        assert bool((part == value).all()), (case, value)
    assert sum(int((t != 0).sum()) for t in tensors.values()) == sum(t.numel() for t in tensors.values())


def test_groups_and_order_of_a_fused_weight(qkv):
    """CodeGen's qkv_proj: 4 model-parallel groups, each [Q | V | K] of n_heads / 4 heads, heads numbered group
    by group; here 2 groups of 2 heads (and the same with grouped-query heads, blocks [K | V | Q])."""
    q, _, _ = qkv
    k, v = torch.randn(H, D, E), torch.randn(H, D, E)
    n = H // 2
    rows = torch.cat([torch.cat([q[i * n:(i + 1) * n], v[i * n:(i + 1) * n], k[i * n:(i + 1) * n]]).reshape(-1, E)
                      for i in range(2)])
    _check(QKVLayout(H, D, "w", packing="fused_per_group", groups=2, order="qvk"), {"w": rows}, (q, k, v))
    qg, kg, vg = qkv  # G = 2 key/value heads: one per group
    rows = torch.cat([torch.cat([kg[i][None], vg[i][None], qg[i * n:(i + 1) * n]]).reshape(-1, E) for i in range(2)])
    _check(QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G, groups=2, order="kvq"), {"w": rows}, qkv)
    falcon = QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G)
    assert falcon.groups is None and "groups" not in falcon.describe()  # None: n_kv_heads groups
    from_numpy = QKVLayout(H, D, "w", packing="fused_per_group", groups=np.int64(2), order="qvk")  # from a config
    assert type(from_numpy.groups) is int and json.dumps(from_numpy.to_dict())


@pytest.mark.parametrize("kwargs, says", [
    ({"packing": "fused", "groups": 2}, "not packing='fused'"),
    ({"packing": "fused_per_group", "order": "qqk"}, "the letters q, k and v once each"),
    ({"packing": "fused_per_group", "groups": 3}, "divides n_heads=4"),
    ({"packing": "fused_per_group", "groups": 0}, "a whole number >= 1"),
])
def test_groups_and_order_are_checked(kwargs, says):
    with pytest.raises(SpecError, match=re.escape(says)):
        QKVLayout(H, D, "w", **kwargs)


def test_heads_3d_both_orientations(qkv):
    q, k, v = qkv
    _check(QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G), {"a": q, "b": k, "c": v}, qkv)
    t = {"a": q.transpose(1, 2), "b": k.transpose(1, 2), "c": v.transpose(1, 2)}
    _check(QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G, transposed=True), t, qkv)
    bad = QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G)
    assert "3-D per-head weight" in shape_problem(bad, {n: tuple(x.shape) for n, x in t.items()})


def test_fused_per_head_unchanged(qkv):
    q, _, _ = qkv
    k, v = torch.randn(H, D, E), torch.randn(H, D, E)
    rows = torch.stack([q, k, v], dim=1).reshape(-1, E)
    _check(QKVLayout(H, D, "w", packing="fused_per_head"), {"w": rows}, (q, k, v))


def test_kv_map_pairs_query_heads_with_the_named_key_heads(qkv):
    q, k, v = qkv
    lay = QKVLayout(H, D, "a", "b", "c", n_kv_heads=G, kv_map=(0, 1, 0, 1))
    tensors = {"a": q.reshape(-1, E), "b": k.reshape(-1, E), "c": v.reshape(-1, E)}
    _, k_nat, _ = split_qkv(tensors, lay)
    assert k_nat.shape == (G, D, E)
    _, k_pair, v_pair = split_qkv(tensors, lay, paired=True)
    for h in range(H):
        torch.testing.assert_close(k_pair[h], k[h % G], rtol=0, atol=0)
        torch.testing.assert_close(v_pair[h], v[h % G], rtol=0, atol=0)
    default = QKVLayout(H, D, "a", "b", "c", n_kv_heads=G, kv_map=(0, 0, 1, 1))
    assert default.default_pairing and split_qkv(tensors, default, paired=True)[1].shape == (G, D, E)


@pytest.mark.parametrize("bad", [(0, 1, 0), (0, 1, 2, 0), [0, 1, 0, 1], (0, 1, 0, True)])
def test_kv_map_checked(bad):
    with pytest.raises(SpecError, match="kv_map"):
        QKVLayout(H, D, "a", "b", "c", n_kv_heads=G, kv_map=bad)


def test_biases_follow_the_packing():
    b = torch.arange((H + 2 * G) * D, dtype=torch.float64)
    lay = QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G)
    bq, bk = split_qkv_bias({"w": b}, lay)
    w = torch.diag(b)  # row i of the fused weight carries bias i: the split must agree with the weight's
    q, k, _ = split_qkv({"w": w}, lay)
    torch.testing.assert_close(bq, q.sum(-1))
    torch.testing.assert_close(bk, k.sum(-1))


LAYOUTS = [
    QKVLayout(8, 16, "qkv.weight", packing="fused"),
    QKVLayout(8, 16, "a.b.q.weight", "a.b.k.weight", "a.b.v.weight", n_kv_heads=2, kv_map=tuple(h % 2 for h in
              range(8)), cross=True, verify=False, o="../out.weight", o_transposed=True, adapter="inferred"),
    QKVLayout(4, 8, "wqkv", packing="fused_per_group", n_kv_heads=2, transposed=True, o="proj.weight"),
    QKVLayout(4, 8, "Wq", "Wk", "Wv", packing="heads_3d", transposed=True),
    QKVLayout(4, 8, "q_attn.weight", "c_attn.weight", packing="q_kv", transposed=True, cross=True),
    QKVLayout(8, 4, "qkv_proj.weight", packing="fused_per_group", groups=4, order="qvk", o="out_proj.weight"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.packing}-{lay.order}")
def test_json_round_trip_keeps_every_field(layout):
    data = json.loads(json.dumps(layout.to_dict()))
    # groups and order are written only where they are not the defaults: a version before them reads the rest
    defaults = {name for name, default in (("groups", None), ("order", "qkv")) if getattr(layout, name) == default}
    assert set(data) == set(layout.__dataclass_fields__) - defaults
    assert QKVLayout.from_dict(data) == layout


def test_from_dict_says_what_is_wrong():
    with pytest.raises(SpecError, match="unknown field"):
        QKVLayout.from_dict({"n_heads": 2, "head_dim": 4, "q": "w", "packing": "fused", "heads": 3})
    with pytest.raises(SpecError, match="missing"):
        QKVLayout.from_dict({"n_heads": 2, "q": "w"})
    assert QKVLayout.from_dict({"n_heads": 2, "head_dim": 4, "q": "w", "packing": "fused"}).adapter == "spec"
