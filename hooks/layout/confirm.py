"""Check one captured attention call against the layer's layout before it counts.

A layout that splits heads the wrong way (or pairs key heads with the wrong query
heads) would give spectra and gradient norms of the wrong head, under the tag of
the right one. The first captured forward of a sampled step is the one place
where the model shows how it really splits its heads, so it is checked there:

* always: the call's head count equals ``n_heads``; for SDPA and MHA also the head
  size (``head_dim``) and the key heads (``n_kv_heads``, or ``n_heads`` when the
  model repeated them);
* SDPA, when the module's input ``x`` is visible (first positional argument or
  ``hidden_states``): the per-head, per-token norms of the q the kernel got equal
  those of ``x @ Wq_h^T + bq_h`` sliced with the layout, up to one common factor
  (a model may scale q before the kernel); RoPE rotates within a head and keeps
  norms. Likewise for k, from ``x`` (self-attention) or from the keyword
  ``key_value_states`` / ``encoder_hidden_states`` (cross-attention), or, when k
  has another number of tokens and the key projection is a module of its own, from
  what its ``F.linear`` read at any of its calls whose batch is the kernel's (keys
  from a strided convolution: PVT, Twins), with key
  head ``h // (n_heads / n_kv_heads)`` for query head h when the model repeated
  them. Eager attention: the operands of the 4-D matmul that produced the softmax
  input (``q @ k^T``) are checked the same way; when the logits come from
  elsewhere (einsum, bmm), only the head count is checked.

When the layout disagrees (or was only a generic adapter's proposal, or a per-head check fails with a norm
between projection and kernel), the layout is read from the computation (:mod:`hooks.layout.read`): a
discovered layout is replaced by it, a spec's is refused with the inferred spec in the message.

Runs on sampled forwards only, under no_grad, on the first ``n`` sequences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.layouts.generic import is_provisional
from diag.layouts.infer import same_split
from diag.layouts.patterns import spec_text
from diag.layouts.vocab import QKVLayout, bias_names, split_qkv, split_qkv_bias
from hooks.layout.blocks import local_tensor
from hooks.layout.discover import AttentionLayer
from hooks.layout.read import adopt, query_source, read_layout

__all__ = ["Inputs", "Verdict", "module_inputs", "with_keys_from", "check_call", "spec_hint", "unconfirmed"]

log = logging.getLogger("diag")

_X_KEYS = ("hidden_states", "x", "query", "input", "inputs")
_KV_KEYS = ("key_value_states", "encoder_hidden_states")


@dataclass
class Inputs:
    """The module's input (n, T, E) and, for cross-attention, its key/value source (n, S, E); ``keys_from``:
    what the key projection itself read (n, S, E) at each of its calls in the forward, where it is a module of
    its own and the capture saw it."""

    x: Tensor | None = None
    kv: Tensor | None = None
    keys_from: tuple[Tensor, ...] = ()


@dataclass
class Verdict:
    problem: str | None = None
    checked: str = ""  # "shapes", "heads", "exact", "q", "q,k": what was compared
    # the problem is the call, not the layout: attention statistics are dropped, the weight-side signals stay
    call_only: bool = False


def _first_3d(values, n: int) -> Tensor | None:
    """The first tensor as (n, tokens, E): a channels-last 4-D input (batch, height, width, E), as timm's MaxViT
    passes its windows, is read with its two token axes as one (a view). A DTensor input (tensor parallelism's
    ``PrepareModuleInput``) is read as this rank holds it: a replicated one whole."""
    for v in map(local_tensor, values):
        if isinstance(v, Tensor):
            if not v.is_floating_point() or v.dim() not in (3, 4):
                return None
            return v[:n] if v.dim() == 3 else v[:n].flatten(1, 2)
    return None


def with_keys_from(inputs: Inputs | None, key_inputs: list[Tensor], batch: int | None, n: int,
                   time_first: bool = False) -> Inputs | None:
    """``inputs`` with what the key projection read at each call added, those whose batch is the kernel's
    ``batch`` (read (T, B, E) when ``time_first``): keys projected per image and shared by its windows are
    not the kernel's sequences, and are left out."""
    if inputs is None or not key_inputs or batch is None:
        return inputs
    found = []
    for t in key_inputs:
        t = t.transpose(0, 1) if time_first and t.dim() == 3 else t
        if t.dim() in (3, 4) and t.shape[0] == batch:
            found.append(_first_3d([t], n))
    return Inputs(inputs.x, inputs.kv, tuple(t for t in found if t is not None))


def module_inputs(args: tuple, kwargs: dict, n: int) -> Inputs:
    """References (no copies) to the first ``n`` sequences of the module's inputs."""
    x = _first_3d([a for a in args if isinstance(a, Tensor)] + [kwargs.get(k) for k in _X_KEYS], n)
    kv = _first_3d([kwargs.get(k) for k in _KV_KEYS], n)
    return Inputs(x, kv)


def _spec(layer: AttentionLayer, layout: QKVLayout) -> str:
    return spec_text(dict.fromkeys(layer.patterns, layout))


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


def _refuse(layer: AttentionLayer, what: str, inferred: QKVLayout | None = None, seen: str = "") -> Verdict:
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
        f"{layer.name} ({type(layer.module).__name__}): the layout proposed from names, {lay.describe()}, could "
        "not be confirmed: " + (why or (
            f"the kernel's q and k were not visible to compare with the module input (compared: {checked}; "
            "logits from a product the capture cannot see, or the input not an argument it reads)")) +
        "; it is not guessed. "
        f"If that split is right (packing, head order, query->key pairing), pass it: Monitor(model, {spec})"
    ))


def _unpaired(layer: AttentionLayer) -> Verdict:
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


def _not_token_attention(lay: QKVLayout, seen) -> bool:
    """The call is not (batch, heads, queries, keys) attention over tokens that this layer's projections could
    compute. With q and k visible: heads times head size wider than the projections, or the layout's head size
    on the query axis and another on the last (XCiT's cross-covariance attention multiplies (batch, heads,
    channels, tokens): its "head size" is the token count, whatever the image size). Without them,
    the softmax's second axis is a head count no split of the projections gives (more heads than rows, or a
    count that does not divide their width), or its third axis is the layout's head count while the second
    is not (scores laid out (batch, tokens, heads, window), whatever the number of tokens)."""
    width, heads = lay.n_heads * lay.head_dim, seen.heads
    if seen.q is not None:  # wider than the projections, or the head size on the token axis: (.., D, tokens)
        q = seen.q
        return heads * q.shape[-1] > width or (q.dim() == 4 and q.shape[2] == lay.head_dim != q.shape[3])
    if heads < 1 or heads > width or width % heads != 0:
        return True
    logits = seen.logits
    return logits is not None and logits.dim() == 4 and logits.shape[2] == lay.n_heads != logits.shape[1]


def _not_this_attention(layer: AttentionLayer, seen) -> Verdict:
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


def _shape_problem(lay: QKVLayout, seen) -> str | None:
    if seen.heads != lay.n_heads:
        return f"the attention call computes {seen.heads} heads, the layout says n_heads={lay.n_heads}"
    if seen.q is not None and seen.q.shape[-1] != lay.head_dim:
        return f"the kernel's q has head size {seen.q.shape[-1]}, the layout says head_dim={lay.head_dim}"
    if seen.k is not None and seen.k.shape[1] not in (lay.kv_heads, lay.n_heads):
        return f"the kernel's k has {seen.k.shape[1]} heads, the layout says n_kv_heads={lay.kv_heads}"
    return None


def check_call(layer: AttentionLayer, seen, inputs: Inputs | None, n: int) -> Verdict:
    """Shapes always, values where visible; a Verdict with ``problem`` set refuses the layer.

    A layout that disagrees with the kernel's q and k is read from them instead: adopted when discovery
    proposed it (the layer's layout is replaced), refused with the inferred spec when a spec gave it."""
    lay = layer.layout
    problem = _shape_problem(lay, seen)
    if problem is not None and _not_token_attention(lay, seen):
        if is_provisional(lay):  # nothing to confirm the names' proposal with: offered as a spec, not guessed
            return unconfirmed(layer, "shapes", why=(
                "its attention call is not (batch, heads, queries, keys) over tokens (a head count or head size "
                "no split of its projections gives, e.g. attention across channels), so the computation cannot "
                "confirm a split; with the layout passed as a spec, the weight-side signals are measured and "
                "the attention statistics left out"))
        return _not_this_attention(layer, seen)
    if problem is None and seen.exact:
        return Verdict(checked="exact")
    x = None if inputs is None else inputs.x
    visible = seen.q is not None and seen.k is not None and x is not None
    if problem is None:
        verdict = (_check_norms(layer, seen.q[:n], seen.k[:n], x, inputs.kv, inputs.keys_from)
                   if visible and lay.verify else None)
        if verdict is None or verdict.problem is None:
            checked = verdict.checked if verdict else ("heads" if seen.logits is not None and seen.q is None
                                                       else "shapes")
            if checked == "heads" and 1 < lay.kv_heads < lay.n_heads and lay.adapter != "spec":
                return _unpaired(layer)
            if checked == "q,k" or not is_provisional(lay):
                return Verdict(checked=checked)
            return unconfirmed(layer, checked)
        else:
            problem = verdict.problem
    if not visible:
        return unconfirmed(layer, "heads", seen.heads) if is_provisional(lay) else _refuse(layer, problem)
    try:
        return _from_computation(layer, problem, seen, inputs, n)
    except Exception as err:  # noqa: BLE001 - e.g. sharded weights: the layer is refused, never left unchecked
        return _refuse(layer, f"{problem}; reading the layout from the computation failed ({err!r})")


def _from_computation(layer: AttentionLayer, problem: str, seen, inputs: Inputs, n: int) -> Verdict:
    inferred, observed = read_layout(layer.module, seen.q[:n], seen.k[:n], inputs.x, inputs.kv, layer.layout.cross)
    if inferred is None:
        return _refuse(layer, problem, None, observed)
    shapes = {name: tuple(p.shape) for name, p in layer.module.named_parameters()}
    names_known = all(name in shapes for name in layer.layout.param_names)
    if names_known and same_split(inferred, layer.layout, shapes):
        return Verdict(checked="q,k")  # e.g. a norm between projection and kernel: the layout holds
    if layer.layout.adapter == "spec":
        return _refuse(layer, problem, inferred, observed)
    adopted = adopt(layer, inferred)
    log.info("diag: %s: layout read from the computation: %s (%s)", layer.name, adopted.describe(), observed)
    return Verdict(checked="q,k")


def _tolerance(t: Tensor) -> float:
    return max(5e-3, 4 * torch.finfo(t.dtype).eps)


def _deviation(got: Tensor, want: Tensor) -> float:
    """Largest |got - c want| relative to the largest c want, c the least-squares common factor."""
    got, want = got.double(), want.double()
    c = (got * want).sum() / (want * want).sum().clamp_min(1e-300)
    if not bool(c > 0):
        return float("inf")
    return float((got - c * want).abs().max() / (c * want).abs().max().clamp_min(1e-300))


def _projected_norms(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """Per-head norms (n, heads, T) of x @ w_h^T + b_h; x (n, T, E), w (heads, D, E), b (heads, D)."""
    y = torch.einsum("nte,hde->nhtd", x.double(), w.double())
    if b is not None:
        y = y + b.double()[None, :, None, :]
    return y.norm(dim=-1)


def _check_norms(layer: AttentionLayer, q: Tensor, k: Tensor, x: Tensor, kv: Tensor | None,
                 keys_from: tuple[Tensor, ...] = ()) -> Verdict:
    lay = layer.layout
    params = layer.local_parameters()  # under tensor parallelism: this rank's heads, as its kernel computes them
    wq, wk, _ = split_qkv({name: params[name].detach() for name in lay.param_names}, lay)  # K unpaired (G)
    biases = {}
    for name in lay.param_names:
        found = [b for b in bias_names(name) if b in params]
        if found:
            biases[name] = params[found[0]].detach()
    bq, bk = split_qkv_bias(biases, lay)
    xq = query_source(x, q, k, lay.cross)
    if x.shape[-1] != wq.shape[-1] or x.shape[0] != q.shape[0] or xq.shape[1] != q.shape[2]:
        return Verdict(checked="shapes")  # the first input is not what the projections read
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, x, wq, wk)):
        return Verdict(checked="shapes")  # non-finite values cannot confirm or refute a layout
    tol = _tolerance(q)
    dev = _deviation(q.norm(dim=-1), _projected_norms(xq, wq, bq))
    if not dev <= tol:
        return Verdict(problem=f"the per-head norms of the kernel's q differ from the module input projected "
                       f"with the layout (deviation {dev:.3g} > {tol:.3g}): heads are split or ordered differently "
                       "(or the q bias is not named like its weight, or the module transforms its input "
                       "before projecting: then QKVLayout(..., verify=False))")
    source = kv if lay.cross else x

    def fits(t: Tensor | None) -> bool:
        return t is not None and t.shape[-1] == wk.shape[-1] and t.shape[:2] == (k.shape[0], k.shape[2])

    read = False  # the sources are what the key projection itself read, not the module's input
    if fits(source):
        sources = [source]
    else:  # keys projected from another sequence (a strided convolution of the input), when the capture saw it
        sources, read = [t for t in keys_from if fits(t)], True
    if not sources:
        return Verdict(checked="q")  # keys from another sequence (cross-attention not named as such)
    if k.shape[1] == wk.shape[0] and not lay.default_pairing:  # the kernel got G key heads: it pairs h // (H / G)
        return Verdict(problem=f"the kernel got {k.shape[1]} key heads and pairs query head h with key head "
                       f"h // {lay.n_heads // lay.kv_heads}, but the layout says kv_map={lay.kv_map}")
    devs = []
    for src in sources:  # any of them: a key projection may run more than once in one forward
        want = _projected_norms(src, wk, bk)  # (n, G, S)
        if k.shape[1] != wk.shape[0]:
            want = want[:, list(lay.kv_index)]  # the model repeated key heads: query head h <- key head kv_map[h]
        devs.append(_deviation(k.norm(dim=-1), want))
        if devs[-1] <= tol:
            return Verdict(checked="q,k")
    dev = min(devs)
    if read:
        return Verdict(problem=f"the per-head norms of the kernel's k differ from what its key projection read, "
                       f"projected with the layout (deviation {dev:.3g} > {tol:.3g}): key heads are split or "
                       "paired with query heads differently (or the model normalises k after projecting it: then "
                       "QKVLayout(..., verify=False))")
    hint = "" if lay.cross else " (or keys come from another sequence: cross-attention?)"
    return Verdict(problem=f"the per-head norms of the kernel's k differ from the module input projected "
                   f"with the layout (deviation {dev:.3g} > {tol:.3g}): key heads are split or paired with "
                   f"query heads differently{hint}")
