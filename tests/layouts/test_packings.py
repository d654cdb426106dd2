"""Packings are registered objects: the vocabulary, the step limit, the capture, the offline assumptions and
the suspects ask the packing, and a new packing is one class (plus a model that stores its weights that way)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.errors import SpecError
from diag.layouts.packings import PACKINGS, Fused, Packing, packing_of, register_packing
from diag.layouts.vocab import QKVLayout, implied_layouts, qk_heads, shape_problem, split_qkv
from hooks.steplimit import SpectralStepLimit
from tests.support.harness import assert_sigma1_by_hand, one_step

E, H, D = 32, 4, 8


def test_the_registry_holds_every_packing_in_order_and_refuses_a_second_of_a_name():
    assert tuple(PACKINGS) == ("separate", "fused", "fused_per_head", "fused_per_group", "q_kv", "heads_3d")
    assert all(packing_of(QKVLayout(H, D, "a", "b", "c", packing=name)).name == name for name in PACKINGS)
    with pytest.raises(SpecError, match="registered already"):
        register_packing(Fused())
    with pytest.raises(SpecError, match="a Packing instance"):
        register_packing("fused")
    with pytest.raises(SpecError, match="expected one of"):
        QKVLayout(H, D, "w", packing="kvq")


def test_what_each_packing_answers():
    """Roles per parameter (the step limit), the key projection's own weight (the capture), what the weights
    cannot tell (the checkpoint analysis) and the layouts one weight's shape allows (the suspects)."""
    sep = QKVLayout(H, D, "q.weight", "k.weight", "v.weight")
    qkv = QKVLayout(H, D, "q.weight", "kv.weight", packing="q_kv")
    fused = QKVLayout(H, D, "qkv.weight", packing="fused")
    assert packing_of(sep).roles(sep) == {"q.weight": ("q",), "k.weight": ("k",), "v.weight": ("v",)}
    assert packing_of(qkv).roles(qkv) == {"q.weight": ("q",), "kv.weight": ("k", "v")}
    assert packing_of(fused).roles(fused) == {"qkv.weight": ("q", "k", "v")}
    assert [packing_of(x).key_weight(x) for x in (sep, qkv, fused)] == ["k.weight", "kv.weight", None]
    assert packing_of(sep).assumed(sep) is None and "[all Q | all K | all V]" in packing_of(fused).assumed(fused)
    implied = [lay.packing for lay in implied_layouts({"w": (E, 3 * E)}, H)]
    assert implied == ["fused", "fused_per_head"]
    three = {"a": (H, E, D), "b": (H, E, D), "c": (H, E, D), "o": (H, D, E)}
    assert [lay.describe() for lay in implied_layouts(three, None)] == [
        "QKVLayout(n_heads=4, head_dim=8, q='a', k='b', v='c', packing='heads_3d', transposed=True)"]
    separate = {"q": (H * D, E), "k": (2 * D, E), "v": (2 * D, E)}
    assert [lay.describe() for lay in implied_layouts(separate, H)] == [
        "QKVLayout(n_heads=4, head_dim=8, q='q', k='k', v='v', n_kv_heads=2)"]


def test_what_tensor_parallelism_asks_of_each_packing():
    """Whether contiguous row blocks are whole heads (ColwiseParallel then gives each rank whole heads), and which
    dim of a weight stacks the heads (the rows, the columns of a transposed weight, dim 0 of a 3-D one)."""
    whole = [name for name, packing in PACKINGS.items() if packing.row_blocks_are_heads]
    assert whole == ["separate", "fused_per_head", "fused_per_group", "heads_3d"]
    sep, conv = QKVLayout(H, D, "q", "k", "v"), QKVLayout(H, D, "qkv", packing="fused", transposed=True)
    heads_3d = QKVLayout(H, D, "q", "k", "v", packing="heads_3d", transposed=True)
    assert [packing_of(x).heads_dim(x) for x in (sep, conv, heads_3d)] == [0, 1, 0]


class FusedKVQ(Fused):
    """A packing the vocabulary did not have: one weight whose rows are [all K | all V | all Q]."""

    name, doc = "test_kvq", "q: one weight, rows [all K | all V | all Q]"

    def _parts(self, fused, layout):
        g, d = layout.kv_heads, layout.head_dim
        k, v, q = fused.split([g * d, g * d, fused.shape[0] - 2 * g * d], dim=0)
        return q, k, v

    def assumed(self, layout):
        return None


class KVQAttention(nn.Module):
    """A module that stores its projections [K | V | Q] in one Linear, SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.kvq, self.out = nn.Linear(E, 3 * H * D), nn.Linear(H * D, E)

    def forward(self, x):
        b, t, _ = x.shape
        k, v, q = (y.reshape(b, t, H, D).transpose(1, 2) for y in self.kvq(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, E))


@pytest.fixture
def kvq():
    packing = register_packing(FusedKVQ())
    yield packing
    PACKINGS.pop(packing.name)


def test_a_new_packing_is_one_class(kvq):
    """Registered, it is a value of QKVLayout.packing: the Monitor confirms it against the kernel's q and k and
    its sigma_1 equals the float64 full SVD of the rows sliced by hand; the step limit bounds its three slices."""
    torch.manual_seed(0)
    model = nn.Sequential(KVQAttention())
    layout = QKVLayout(H, D, "kvq.weight", packing="test_kvq", o="out.weight")
    assert shape_problem(layout, {"kvq.weight": (3 * H * D, E), "out.weight": (E, H * D)}) is None
    x = torch.randn(2, 6, E, generator=torch.Generator().manual_seed(1))
    monitor, record, checked, caught = one_step(model, lambda: model(x).square().mean(), spec={"0": layout})
    assert checked == {0: "q,k"} and not monitor.refused, caught
    w = model[0].kvq.weight
    assert_sigma1_by_hand(record.scalars, "L00", w[2 * H * D:].reshape(H, D, E), w[: H * D].reshape(H, D, E),
                          rel=1e-5)
    wq, wk, bq, bk = qk_heads(dict(model[0].named_parameters()), layout)
    assert torch.equal(bq, model[0].kvq.bias[2 * H * D:].reshape(H, D)) and wk.shape == (H, D, E)
    opt = SpectralStepLimit(torch.optim.SGD(model.parameters(), lr=0.1), model=model, attention=monitor.layers)
    assert [m.role for m in opt.matrices if m.label == "L00"][:3] == ["q", "k", "v"]
    q, _, _ = split_qkv({"kvq.weight": w}, layout)
    assert q.data_ptr() == w[2 * H * D:].data_ptr()  # a view of the Q rows


def test_a_packing_must_split_what_it_names():
    class Broken(Packing):
        name = "test_broken"

    packing = register_packing(Broken())
    try:
        with pytest.raises(NotImplementedError):
            split_qkv({"w": torch.zeros(3 * H * D, E)}, QKVLayout(H, D, "w", packing="test_broken"))
    finally:
        PACKINGS.pop(packing.name)
