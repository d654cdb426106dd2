"""Research coding styles, attached with no spec: the layout is read from the computation and every head's
sigma_1 equals the float64 full SVD of its true W_q^T W_k (read through the model's own projection code)."""

from __future__ import annotations

import pytest
import torch

from hooks.monitor.monitor import Monitor
from tests.support.harness import assert_sigma1_by_hand, one_step
from tests.support.styles import STYLES, E, Net, per_head_weights

REL = 1e-5


def run(model, spec=None, seed: int = 1):
    x = torch.randn(3, 10, E, generator=torch.Generator().manual_seed(seed))
    return one_step(model, lambda: model(x).square().mean(), spec=spec)


def assert_exact(monitor, record) -> None:
    for layer in monitor.layers:
        wq, wk = per_head_weights(layer.module)
        for h in range(wq.shape[0]):
            s = torch.linalg.svdvals(wq[h].T @ wk[h])
            tag = f"{layer.label}/H{h:02d}"
            assert record.scalars[f"qk_sigma1/{tag}"] == pytest.approx(s[0].item(), rel=REL), tag
            stable = (s.square().sum() / s[0] ** 2).item()
            assert record.scalars[f"qk_stable_rank/{tag}"] == pytest.approx(stable, rel=1e-4), tag


@pytest.mark.parametrize("name", sorted(STYLES))
def test_style_is_exact_with_no_spec(name):
    monitor, record, checked, caught = run(Net(STYLES[name]))
    assert [layer.name for layer in monitor.layers] == ["blocks.0.attn", "blocks.1.attn"]
    assert checked == {0: "q,k", 1: "q,k"}, (checked, caught)
    assert not monitor.refused and not [m for m in caught if "not measured" in m]
    assert all(layer.layout.n_heads == 4 for layer in monitor.layers)
    assert all(layer.layout.o is not None for layer in monitor.layers)  # out, proj, wo, o, to_out.0, W_o, ...
    assert_exact(monitor, record)


@pytest.mark.parametrize("name", ["TileSdpa", "TileEinsum"])
def test_the_pairing_h_mod_g_is_read_from_the_kernel(name):
    monitor, record, checked, _ = run(Net(STYLES[name]))
    assert [layer.layout.kv_map for layer in monitor.layers] == [(0, 1, 0, 1)] * 2
    assert monitor.layers[0].layout.adapter == "inferred"


def test_inferred_layouts_round_trip_as_specs():
    """The layout read from the computation, passed back as a spec, gives the same numbers."""
    for name in ("PerGroupRope", "TileSdpa", "Heads3D", "NoAttrSequential", "RawTransposed"):
        monitor, record, _, _ = run(Net(STYLES[name]))
        spec = {"blocks.*.attn": monitor.layers[0].layout}
        again, record2, checked, caught = run(Net(STYLES[name]), spec)
        assert checked == {0: "q,k", 1: "q,k"} and not again.refused, (name, caught)
        assert record2.scalars == pytest.approx(record.scalars, rel=1e-6), name


@pytest.mark.parametrize("name", ["PerGroupRope", "OddQKNorm", "NoAttrSequential"])
def test_training_is_bit_identical_with_the_layout_read_from_the_computation(name):
    """Reading the layout at the first forward draws no random number and changes nothing the model computes."""

    def train(monitored: bool) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
        model = Net(STYLES[name])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(5)
        monitor = Monitor(model, every=1) if monitored else None
        losses = []
        for step in range(3):
            loss = model(torch.randn(3, 10, E, generator=gen)).square().mean()
            loss.backward()
            if monitor is not None:
                monitor.step(step, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if monitor is not None:
            assert not monitor.refused and "qk_sigma1/L01/H03" in monitor.last
            assert any(tag.startswith("attn_entropy/L01") for tag in monitor.last)
            monitor.close()
        return losses, [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    torch.manual_seed(123)
    plain = train(False)
    torch.manual_seed(123)
    watched = train(True)
    assert plain[0] == watched[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    assert torch.equal(plain[2], watched[2])


class _ClassAttention(torch.nn.Module):
    """CaiT/VOLO-style class attention: queries from the class token only (``q`` on ``x[:, :1]``), keys and
    values from every token (``kv``, rows [all K | all V]); ``last=True`` takes the query from the last token
    instead, which no rule should confirm as 'the first tokens'."""

    def __init__(self, heads: int = 4, last: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.last = heads, E // heads, last
        self.q = torch.nn.Linear(E, E)
        self.kv = torch.nn.Linear(E, 2 * E)
        self.proj = torch.nn.Linear(E, E)

    def forward(self, x):
        b, t, _ = x.shape
        k, v = self.kv(x).reshape(b, t, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        token = x[:, -1:] if self.last else x[:, :1]
        q = self.q(token).reshape(b, 1, self.num_heads, self.head_dim).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 1, E)
        return torch.cat([self.proj(y), x[:, 1:]], dim=1)


def test_class_token_queries_are_read_from_the_first_tokens():
    """Queries projected from the first token(s) only, keys from all: the layout check and the inference read
    the queries' source as those first tokens (before: 'the module input is not their source', and a names-only
    layout was refused), and sigma_1 is the full SVD of each head's Wq_h^T Wk_h sliced by hand. A query taken
    from the last token is not confirmed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ClassAttention())
    monitor, record, checked, caught = run(model)
    assert not monitor.refused and checked == {0: "q,k"}, caught
    attn = model[0]
    assert_sigma1_by_hand(record.scalars, "L00", attn.q.weight.reshape(4, E // 4, E),
                          attn.kv.weight[:E].reshape(4, E // 4, E), rel=REL)
    torch.manual_seed(0)
    monitor, _, _, caught = run(torch.nn.Sequential(_ClassAttention(last=True)))
    assert monitor.refused, caught


def test_class_token_queries_at_batch_one_are_not_read_time_first():
    """At batch 1 the class token's single query also fits the (1, T, E) input read time-first, as T sequences
    of one token; that reading was taken, the check compared nothing ('shapes') and a names-only layout was
    refused (timm VOLO's class attention, and CaiT's measured unchecked, at batch 1). A time-first reading
    must hold the kernel's sequences in its first dim."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ClassAttention())
    x = torch.randn(1, 10, E, generator=torch.Generator().manual_seed(2))
    monitor, record, checked, caught = one_step(model, lambda: model(x).square().mean())
    assert not monitor.refused and checked == {0: "q,k"}, caught
    attn = model[0]
    assert_sigma1_by_hand(record.scalars, "L00", attn.q.weight.reshape(4, E // 4, E),
                          attn.kv.weight[:E].reshape(4, E // 4, E), rel=REL)
