"""The inference's pure parts: the per-position Gram profile's invariances, and every packing of the
vocabulary recovered from the blocks its own split reads (with any query -> key pairing)."""

from __future__ import annotations

import pytest
import torch

from diag.layouts.infer import Block, layout_from_blocks, match_heads, profiles, same_split
from diag.layouts.vocab import QKVLayout

H, G, D, E = 4, 2, 3, 10


def _rotate(z: torch.Tensor) -> torch.Tensor:
    """A RoPE-like rotation of pairs (i, i + D/2) by a position-dependent angle, the same for every sequence."""
    t = torch.arange(z.shape[-2], dtype=z.dtype)[:, None]
    a, b = z[..., :2], z[..., 2:4]
    cos, sin = torch.cos(0.3 * t), torch.sin(0.3 * t)
    return torch.cat([a * cos - b * sin, a * sin + b * cos, z[..., 4:]], -1)


def test_profiles_ignore_rotations_per_position_and_a_common_scale_but_not_another_head():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 7, 6, generator=gen, dtype=torch.float64)
    same = profiles(3.0 * _rotate(z))
    torch.testing.assert_close(same, profiles(z))
    hits = match_heads(same, profiles(z), 1e-9)
    assert hits == [[0], [1], [2]]  # each head matches itself and no other


def _blocks(layout: QKVLayout, shapes: dict) -> tuple[list[Block], list[Block], list[int]]:
    """The blocks each head reads, read off the layout's own split of row-numbered weights."""
    from diag.layouts.vocab import split_qkv

    orient = {("heads_3d", True): "heads_t", ("heads_3d", False): "heads"}.get(
        (layout.packing, layout.transposed), "cols" if layout.transposed else "rows")
    tensors = {}
    for name, shape in shapes.items():
        rows = torch.arange(shape[0] if orient in ("rows", "heads", "heads_t") else shape[1])
        if orient == "rows":
            tensors[name] = rows[:, None].expand(shape)
        elif orient == "cols":
            tensors[name] = rows[None, :].expand(shape)
        else:
            tensors[name] = rows[:, None, None].expand(shape)
    q, k, _ = split_qkv(tensors, layout)
    d = layout.head_dim
    first = (lambda t: int(t.flatten()[0]) // d) if orient in ("rows", "cols") else (lambda t: int(t.flatten()[0]))
    qb = [Block(layout.q, orient, first(q[h])) for h in range(layout.n_heads)]
    kname = layout.q if layout.packing.startswith("fused") else layout.k
    kb = [Block(kname, orient, first(k[g])) for g in range(layout.kv_heads)]
    return qb, kb, list(layout.kv_index)


LAYOUTS = [
    QKVLayout(H, D, "w", packing="fused", n_kv_heads=G),
    QKVLayout(H, D, "w", packing="fused", n_kv_heads=G, transposed=True),
    QKVLayout(H, D, "w", packing="fused_per_head"),
    QKVLayout(H, D, "w", packing="fused_per_group", n_kv_heads=G),
    QKVLayout(H, D, "a", "b", packing="q_kv", n_kv_heads=G),
    QKVLayout(H, D, "a", "b", "c", n_kv_heads=G, kv_map=(0, 1, 0, 1)),
    QKVLayout(H, D, "a", "b", "c", n_kv_heads=G, kv_map=(1, 0, 0, 1), transposed=True),
    QKVLayout(H, D, "a", "b", "c", packing="heads_3d", n_kv_heads=G, transposed=True),
]


def _shapes(layout: QKVLayout) -> dict:
    h, g, d = layout.n_heads, layout.kv_heads, layout.head_dim
    rows = {"fused": {"w": (h + 2 * g) * d}, "fused_per_head": {"w": 3 * h * d},
            "fused_per_group": {"w": (h + 2 * g) * d}, "q_kv": {"a": h * d, "b": 2 * g * d},
            "separate": {"a": h * d, "b": g * d, "c": g * d}}
    if layout.packing == "heads_3d":
        return {"a": (h, E, d), "b": (g, E, d), "c": (g, E, d)}
    return {n: ((E, r) if layout.transposed else (r, E)) for n, r in rows[layout.packing].items()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.packing}-{lay.kv_map}-{lay.transposed}")
def test_every_packing_is_recovered_from_its_blocks(layout):
    shapes = _shapes(layout)
    qb, kb, kv_of_query = _blocks(layout, shapes)
    value = layout.v if layout.packing in ("separate", "heads_3d") else None
    found = layout_from_blocks(qb, kb, kv_of_query, shapes, D, value)
    assert found is not None and found.adapter == "inferred"
    assert same_split(found, layout, shapes)
    assert found.kv_map == (None if layout.default_pairing else layout.kv_map)
    assert found.kv_index == layout.kv_index


def test_a_head_order_no_packing_has_gives_none():
    layout = LAYOUTS[0]
    shapes = _shapes(layout)
    qb, kb, kv_of_query = _blocks(layout, shapes)
    assert layout_from_blocks(qb[::-1], kb, kv_of_query, shapes, D, None) is None
