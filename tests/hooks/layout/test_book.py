"""The layout book: one component holds each layer's layout and state and decides on what the capture saw;
the capture, the Monitor and the step limit ask it."""

from __future__ import annotations

import pytest
import torch

from diag.layouts.vocab import QKVLayout
from hooks.layout.book import LayoutBook
from hooks.monitor.monitor import Monitor
from hooks.steplimit import SpectralStepLimit
from tests.support.harness import one_step
from tests.support.styles import STYLES, E, Net


def _run(model, **kwargs):
    x = torch.randn(3, 10, E, generator=torch.Generator().manual_seed(1))
    return one_step(model, lambda: model(x).square().mean(), **kwargs)


def test_states_given_confirmed_proposed_adopted():
    """A named family's layout is given, then confirmed; a names-only proposal is proposed, then adopted from
    the kernel (PerGroupRope: names say fused, the kernel says per group), its record saying what was seen."""
    model = Net(STYLES["PerGroupRope"])
    monitor = Monitor(model, every=1)
    assert [layer.record.state for layer in monitor.layers] == ["proposed", "proposed"]
    model(torch.randn(2, 6, E)).sum().backward()
    monitor.step(0)
    monitor.close()
    records = [layer.record for layer in monitor.layers]
    assert [r.state for r in records] == ["adopted", "adopted"] and all(r.checked == "q,k" for r in records)
    assert monitor.layers[0].layout.packing == "fused_per_group" and "kernel q" in records[0].why
    assert monitor.layouts.layers == monitor.layers and monitor.capture.layouts is monitor.layouts

    monitor, _, checked, _ = _run(Net(STYLES["FusedHeadsAttr"]), spec={"blocks.*.attn": QKVLayout(
        4, 8, "qkv.weight", packing="fused", o="out.weight")})
    assert [layer.record.state for layer in monitor.layers] == ["confirmed", "confirmed"]


def test_a_wrong_spec_is_refused_in_the_record_and_the_monitor_asks_the_book():
    wrong = QKVLayout(4, 8, "qkv.weight", packing="fused_per_head", o="out.weight")
    monitor, record, _, caught = _run(Net(STYLES["FusedHeadsAttr"]), spec={"blocks.*.attn": wrong})
    assert [layer.record.state for layer in monitor.layers] == ["refused", "refused"]
    assert monitor.refused == monitor.layouts.refused and set(monitor.refused) == {0, 1}
    assert "packing='fused'" in monitor.refused[0]  # the spec read from the computation, offered
    assert not any("/L00" in tag for tag in record.scalars)


def test_without_a_capture_a_proposal_is_refused_at_once():
    model = Net(STYLES["FusedHeadsAttr"])
    book = LayoutBook(Monitor(model, signals=("spectra",)).layers, watching=False)
    assert set(book.refused) == {0, 1} and "signals= leaves out 'attention'" in book.refused[0]


def test_refusing_goes_through_the_book_and_its_view_is_read_only():
    """``refuse`` refuses the book's layer of that index (under tensor parallelism the Monitor's layer is not the
    book's own view of it); ``refused`` is a view that cannot be written, so no refusal is lost."""
    monitor = Monitor(Net(STYLES["FusedHeadsAttr"]), every=1)
    book = monitor.layouts
    book.refuse(monitor.layers[1], "another rank disagrees")
    assert dict(book.refused) == {1: "another rank disagrees"} and dict(monitor.refused) == dict(book.refused)
    assert book.layers[1].record.state == "refused" and not book.settled(book.layers[1])
    with pytest.raises(TypeError):
        book.refused[0] = "lost"  # type: ignore[index]
    monitor.close()


def test_the_step_limit_slices_by_the_layout_the_book_adopted():
    """Built before the first forward, the step limit bounds Q, K and V of each query/key group as the adopted
    per-group layout reads them, not as the fused proposal did."""
    model = Net(STYLES["PerGroupRope"])
    monitor = Monitor(model, every=1)
    opt = SpectralStepLimit(torch.optim.SGD(model.parameters(), lr=0.1), tau=1e-3, model=model, monitor=monitor,
                            exact=True)
    model(torch.randn(2, 6, E)).sum().backward()
    monitor.step(0)
    before = model.blocks[0].attn.Wqkv.weight.detach().clone()
    opt.step()
    monitor.close()
    layout = monitor.layers[0].layout
    rows = before.unflatten(0, (layout.kv_heads, -1, layout.head_dim))  # (G, r + 2, D, E): [Q_1..Q_r | K | V]
    after = model.blocks[0].attn.Wqkv.weight.detach().unflatten(0, rows.shape[:3])
    q_b, q_a = rows[:, :-2].flatten(0, 2), after[:, :-2].flatten(0, 2)
    ratio = torch.linalg.matrix_norm((q_a - q_b).double(), ord=2) / torch.linalg.matrix_norm(q_b.double(), ord=2)
    assert abs(ratio.item() - 1e-3) < 1e-6  # limited to tau, on exactly these rows
