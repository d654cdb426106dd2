"""What a refusal says: the layer, what disagreed, what the computation showed, and the spec to pass.

The wording of every layout refusal (and of the one verdict that drops only a call's attention statistics),
one function per kind, each returning the :class:`hooks.layout.confirm.Verdict` that
:class:`hooks.layout.book.LayoutBook` records. Each offers a spec built from what is known (the layout read
from the computation, the names' proposal with the kernel's head count), ready to paste.
"""

from __future__ import annotations

from diag.layouts.generic import is_provisional
from diag.layouts.patterns import spec_text
from diag.layouts.vocab import QKVLayout
from hooks.layout.confirm import Verdict
from hooks.layout.discover import AttentionLayer

__all__ = ["spec_hint", "refuse", "unconfirmed", "unpaired", "not_this_attention", "unconfirmable"]


def _spec(layer: AttentionLayer, layout: QKVLayout) -> str:
    return spec_text(dict.fromkeys(layer.patterns, layout))


def _source(layout: QKVLayout) -> str:
    """Where a provisional layout came from, for messages."""
    return "its weights' shapes (names found no attention layer)" if layout.adapter == "computation" else "names"


def spec_hint(layer: AttentionLayer, inferred: QKVLayout | None = None) -> str:
    """The fix to offer: the spec read from the computation where there is one, else a template."""
    given = f"its layout {layer.layout.describe()} (adapter {layer.layout.adapter!r}) disagrees with the model"
    if inferred is not None:
        return f"{given}; the computation says: pass Monitor(model, {_spec(layer, inferred)})"
    return (
        f"{given}; pass the right one, e.g. Monitor(model, spec={{{layer.patterns[0]!r}: QKVLayout(n_heads=..., "
        "head_dim=..., q=..., packing='fused' | 'fused_per_head' | 'fused_per_group' | 'separate' | 'q_kv' | "
        "'heads_3d', n_kv_heads=..., kv_map=..., groups=..., order=..., transposed=..., cross=...)}) "
        "(docs/layouts.md)"
    )


def refuse(layer: AttentionLayer, what: str, inferred: QKVLayout | None = None, seen: str = "") -> Verdict:
    observed = f" (observed: {seen})" if seen else ""
    return Verdict(problem=f"{layer.name} ({type(layer.module).__name__}): {what}{observed}; "
                   f"{spec_hint(layer, inferred)}")


def unconfirmed(layer: AttentionLayer, checked: str, heads: int | None = None, why: str | None = None) -> Verdict:
    """A generic adapter's proposal that the computation could not confirm: refused, never guessed; the
    message offers the proposal (with the kernel's head count) as a spec, to pass only if it is right."""
    lay = layer.layout
    width, kv_width = lay.n_heads * lay.head_dim, lay.kv_heads * lay.head_dim
    if heads and heads != lay.n_heads and width % heads == 0 and kv_width % (width // heads) == 0:
        d = width // heads
        lay = QKVLayout.from_dict({**lay.to_dict(), "n_heads": heads, "head_dim": d, "n_kv_heads": kv_width // d})
    spec = _spec(layer, QKVLayout.from_dict({**lay.to_dict(), "adapter": "spec"}))
    return Verdict(problem=(
        f"{layer.name} ({type(layer.module).__name__}): the layout proposed from {_source(lay)}, {lay.describe()}, "
        "could not be confirmed: " + (why or (
            f"the kernel's q and k were not visible to compare with the module input (compared: {checked}; "
            "logits from a product the capture cannot see, or the input not an argument it reads)")) +
        "; it is not guessed. "
        f"If that split is right (packing, head order, query->key pairing), pass it: Monitor(model, {spec})"
    ))


def unpaired(layer: AttentionLayer) -> Verdict:
    """Grouped-query heads whose pairing the call does not show (logits without a visible q @ k^T): the
    pairing h // (H / G) would be a guess (models tile h % G too), so the layer is refused."""
    lay = layer.layout
    tiled = QKVLayout.from_dict({**lay.to_dict(), "adapter": "spec",
                                 "kv_map": [h % lay.kv_heads for h in range(lay.n_heads)]})
    default = QKVLayout.from_dict({**lay.to_dict(), "adapter": "spec"})
    return Verdict(problem=(
        f"{layer.name} ({type(layer.module).__name__}): grouped-query attention ({lay.n_heads} query heads, "
        f"{lay.kv_heads} key heads) whose logits come from a product the capture cannot see, so which key "
        "head each query head reads cannot be checked; it is not guessed. Pass the pairing the model uses: "
        f"Monitor(model, {_spec(layer, default)}) for h // (H / G), or "
        f"Monitor(model, {_spec(layer, tiled)}) for h % G"
    ))


def not_this_attention(layer: AttentionLayer, seen) -> Verdict:
    """A softmax call that cannot be this layer's (batch, heads, queries, keys) attention under any head split
    of its projections: a kernel laid out another way (Longformer's sliding window scores are (batch, tokens,
    heads, window)). The call says nothing about the layout, which came from a named family's adapter, so the
    weight-side signals stay and only the attention statistics are dropped."""
    lay = layer.layout
    shape = "" if seen.logits is None else f" (logits {tuple(seen.logits.shape)})"
    source = "your spec" if lay.adapter == "spec" else f"the family's adapter {lay.adapter!r}"
    return Verdict(call_only=True, problem=(
        f"{layer.name} ({type(layer.module).__name__}) computes its attention in a form the capture cannot read as "
        f"(batch, heads, queries, keys) over tokens with its {lay.n_heads} heads: its call{shape} has them on "
        f"another axis, or a head count or head size no split of its {lay.n_heads * lay.head_dim}-wide "
        f"projections gives (a sliding-window or chunked kernel, or attention across channels); its attention "
        f"statistics are not measured. Its weight-side signals "
        f"are measured with the layout from {source}, {lay.describe()}, which no computation confirmed"))


def unconfirmable(layers: list[AttentionLayer]) -> dict[int, str]:
    """Layers whose layout only a captured forward can confirm (a generic adapter's proposal), for a Monitor
    that captures no attention: refused, with the spec to pass if the proposal is right."""
    return {
        layer.index: (f"{layer.name}: the layout proposed from {_source(layer.layout)}, {layer.layout.describe()}, "
                      "is confirmed "
                      "only against the attention kernel's q and k, and signals= leaves out 'attention'; add it, "
                      f"or pass the layout as a spec if it is right: spec={{{layer.patterns[0]!r}: ...}}")
        for layer in layers if is_provisional(layer.layout)
    }
