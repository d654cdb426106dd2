"""Check one captured attention call against the layer's layout before it counts.

A layout that splits heads the wrong way (or pairs key heads with the wrong query
heads) would give spectra and gradient norms of the wrong head, under the tag of
the right one. The first captured forward of a sampled step is the one place
where the model shows how it really splits its heads, so it is checked there:

* always: the call's head count equals ``n_heads``; for SDPA and MHA also the head
  size (``head_dim``) and the key heads (``n_kv_heads``, or ``n_heads`` when the
  model repeated them);
* SDPA, when the module's input ``x`` is visible (first positional argument, or a keyword
  such as ``hidden_states`` or TransformerLens's ``query_input``): the per-head, per-token norms
  of the q the kernel got equal those of ``x @ Wq_h^T + bq_h`` sliced with the layout, up to one common factor
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

These are comparisons only: what a disagreement means for the layer (read the layout from the computation,
adopt it, refuse it) is decided by :class:`hooks.layout.book.LayoutBook`, which calls them.

Runs on sampled forwards only, under no_grad, on the first ``n`` sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from diag.layouts.infer import query_source
from diag.layouts.vocab import QKVLayout, qk_heads
from hooks.layout.discover import AttentionLayer
from hooks.parallel.dtensors import local_tensor

__all__ = ["Inputs", "Elementwise", "CapturedCall", "Verdict", "Comparison", "module_inputs", "with_keys_from",
           "readings", "compare", "tolerance", "call_problem", "not_token_attention"]

MATCH_FLOOR = 5e-3  # the least relative deviation a match allows (float32 products of width E, TF32 on GPUs)
_X_KEYS = ("hidden_states", "x", "query", "input", "inputs", "query_input")
_KV_KEYS = ("key_value_states", "encoder_hidden_states")


@dataclass
class Inputs:
    """The module's input (n, T, E) and, for cross-attention, its key/value source (n, S, E); ``keys_from``:
    what the key projection itself read (n, S, E) at each of its calls in the forward, where it is a module of
    its own and the capture saw it."""

    x: Tensor | None = None
    kv: Tensor | None = None
    keys_from: tuple[Tensor, ...] = ()


@dataclass(frozen=True)
class Elementwise:
    """An elementwise, shape-preserving call the module made in its forward with constant bounds (``clamp``,
    ``clip``, ``hardtanh``: activations clipped to a range between projection and kernel). Reading the layout
    from the computation tries the projected blocks through it, as through the module's norms."""

    name: str
    low: float | None
    high: float | None

    def forward(self, z: Tensor) -> Tensor:
        return z.clamp(self.low, self.high)

    def describe(self) -> str:
        return f"{self.name}(min={self.low}, max={self.high})"


@dataclass
class CapturedCall:
    """What the capture saw of one attention call: the call (``seen``: :class:`hooks.capture.kernels.Seen`)
    and the module's inputs read batch-first and time-first (references, first ``n`` sequences), with what the
    key projection read at each of its calls (``key_inputs``) and the elementwise calls the module made
    (``between``)."""

    seen: Any
    batch_first: Inputs | None
    time_first: Inputs | None
    key_inputs: list[Tensor]
    between: tuple[Elementwise, ...] = ()


@dataclass
class Verdict:
    problem: str | None = None
    checked: str = ""  # "shapes", "heads", "exact", "q", "q,k": what was compared
    # the problem is the call, not the layout: attention statistics are dropped, the weight-side signals stay
    call_only: bool = False
    adopt: QKVLayout | None = None  # the layout read from the computation, to replace a discovered one
    observed: str = ""  # what the computation showed, where the layout was read from it
    between: str = ""  # what the module does between its projections and the kernel, where the reading saw it


def tolerance(t: Tensor) -> float:
    """The one tolerance of every layout match (the norm check here, the block profiles of
    :mod:`hooks.layout.read`): relative, for the dtype the kernel's q came in (bf16 and fp16 round at their eps)."""
    return max(MATCH_FLOOR, 8 * torch.finfo(t.dtype).eps)


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


def not_token_attention(lay: QKVLayout, seen) -> bool:
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


def call_problem(lay: QKVLayout, seen) -> str | None:
    """Why the call's head count, head size or key heads cannot be this layout's, or None."""
    if seen.heads != lay.n_heads:
        return f"the attention call computes {seen.heads} heads, the layout says n_heads={lay.n_heads}"
    if seen.q is not None and seen.q.shape[-1] != lay.head_dim:
        return f"the kernel's q has head size {seen.q.shape[-1]}, the layout says head_dim={lay.head_dim}"
    if seen.k is not None and seen.k.shape[1] not in (lay.kv_heads, lay.n_heads):
        return f"the kernel's k has {seen.k.shape[1]} heads, the layout says n_kv_heads={lay.kv_heads}"
    return None


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


@dataclass
class Comparison:
    """What one reading of a call says of the layout: ``problem`` where they disagree, else what agreed
    (``checked``: "exact", "q,k", "q", "heads", "shapes"); ``token_attention`` False where the call is no
    (batch, heads, queries, keys) attention this layer's projections could compute; ``visible``: the kernel's q
    and k and the module input were all seen, so the layout can be read from them."""

    problem: str | None = None
    checked: str = ""
    token_attention: bool = True
    visible: bool = False
    inputs: Inputs | None = None  # the reading of the module's inputs compared


def compare(layer: AttentionLayer, obs: CapturedCall, n: int) -> tuple[Comparison, Comparison | None]:
    """The layer's layout against one attention call, with the module's inputs read batch-first (or the one
    reading that fits) and, where the other reading holds the kernel's sequences too, read time-first."""
    first, other = readings(obs, n)
    return _compare(layer, obs.seen, first, n), (None if other is None else _compare(layer, obs.seen, other, n))


def _compare(layer: AttentionLayer, seen, inputs: Inputs | None, n: int) -> Comparison:
    """Shapes always, values where visible (first ``n`` sequences)."""
    found = _compared(layer, seen, inputs, n)
    found.inputs = inputs
    return found


def _compared(layer: AttentionLayer, seen, inputs: Inputs | None, n: int) -> Comparison:
    lay = layer.layout
    x = None if inputs is None else inputs.x
    visible = seen.q is not None and seen.k is not None and x is not None
    problem = call_problem(lay, seen)
    if problem is not None and not_token_attention(lay, seen):
        return Comparison(problem, token_attention=False, visible=visible)
    if problem is None and seen.exact:
        return Comparison(checked="exact")
    if problem is not None:
        return Comparison(problem, visible=visible)
    if visible and lay.verify:
        found = _check_norms(layer, seen.q[:n], seen.k[:n], x, inputs.kv, inputs.keys_from)
        return Comparison(found.problem, found.checked, visible=True)
    return Comparison(checked="heads" if seen.logits is not None and seen.q is None else "shapes", visible=visible)


def readings(obs: CapturedCall, n: int) -> tuple[Inputs | None, Inputs | None]:
    """The module's inputs as the kernel's source: batch-first, and time-first where that reading holds the
    kernel's sequences too (then both are compared); time-first alone where only it fits."""
    seen = obs.seen
    batch = None if seen.k is None else seen.k.shape[0]
    batch_first = with_keys_from(obs.batch_first, obs.key_inputs, batch, n)
    time_first = with_keys_from(obs.time_first, obs.key_inputs, batch, n, time_first=True)
    length = None if seen.q is None else seen.q.shape[2]

    def fits(inputs: Inputs | None) -> bool:  # the input's second dim is the query length
        return inputs is not None and inputs.x is not None and inputs.x.shape[1] == length

    def fits_time_first(inputs: Inputs | None) -> bool:
        # ... and, read (T, B, E), its first dim holds the kernel's sequences: at batch 1 a class token's
        # single query (CaiT, VOLO) would otherwise match a (1, N, E) input read as N sequences of 1 token
        rows = None if seen.q is None else min(seen.q.shape[0], n)
        return fits(inputs) and (rows is None or inputs.x.shape[0] == rows)

    if fits_time_first(time_first) and not fits(batch_first):  # (T, B, E): fairseq, MHA without batch_first
        return time_first, None
    return batch_first, (time_first if fits_time_first(time_first) else None)


def _check_norms(layer: AttentionLayer, q: Tensor, k: Tensor, x: Tensor, kv: Tensor | None,
                 keys_from: tuple[Tensor, ...] = ()) -> Comparison:
    lay = layer.layout
    # under tensor parallelism: this rank's heads, as its kernel computes them
    wq, wk, bq, bk = qk_heads({n: p.detach() for n, p in layer.local_parameters().items()}, lay)  # K unpaired (G)
    xq = query_source(x, q, k, lay.cross)
    if x.shape[-1] != wq.shape[-1] or x.shape[0] != q.shape[0] or xq.shape[1] != q.shape[2]:
        return Comparison(checked="shapes")  # the first input is not what the projections read
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, x, wq, wk)):
        return Comparison(checked="shapes")  # non-finite values cannot confirm or refute a layout
    tol = tolerance(q)
    dev = _deviation(q.norm(dim=-1), _projected_norms(xq, wq, bq))
    if not dev <= tol:
        return Comparison(f"the per-head norms of the kernel's q differ from the module input projected "
                          f"with the layout (deviation {dev:.3g} > {tol:.3g}): heads are split or ordered "
                          "differently (or the q bias is not named like its weight, or the module transforms its "
                          "input before projecting: then QKVLayout(..., verify=False))")
    return _check_keys(lay, k, wk, bk, kv if lay.cross else x, keys_from, tol)


def _check_keys(lay: QKVLayout, k: Tensor, wk: Tensor, bk: Tensor | None, source: Tensor | None,
                keys_from: tuple[Tensor, ...], tol: float) -> Comparison:
    """The kernel's k (n, G or H, S, D) against ``source`` (the module input, or the cross-attention's key
    source) projected, or against what the key projection itself read (keys from another sequence)."""
    def fits(t: Tensor | None) -> bool:
        return t is not None and t.shape[-1] == wk.shape[-1] and t.shape[:2] == (k.shape[0], k.shape[2])

    read = False  # the sources are what the key projection itself read, not the module's input
    if fits(source):
        sources = [source]
    else:  # keys projected from another sequence (a strided convolution of the input), when the capture saw it
        sources, read = [t for t in keys_from if fits(t)], True
    if not sources:
        return Comparison(checked="q")  # keys from another sequence (cross-attention not named as such)
    if k.shape[1] == wk.shape[0] and not lay.default_pairing:  # the kernel got G key heads: it pairs h // (H / G)
        return Comparison(f"the kernel got {k.shape[1]} key heads and pairs query head h with key head "
                          f"h // {lay.n_heads // lay.kv_heads}, but the layout says kv_map={lay.kv_map}")
    devs = []
    for src in sources:  # any of them: a key projection may run more than once in one forward
        want = _projected_norms(src, wk, bk)  # (n, G, S)
        if k.shape[1] != wk.shape[0]:
            want = want[:, list(lay.kv_index)]  # the model repeated key heads: query head h <- key head kv_map[h]
        devs.append(_deviation(k.norm(dim=-1), want))
        if devs[-1] <= tol:
            return Comparison(checked="q,k")
    dev = min(devs)
    if read:
        return Comparison(f"the per-head norms of the kernel's k differ from what its key projection read, "
                          f"projected with the layout (deviation {dev:.3g} > {tol:.3g}): key heads are split or "
                          "paired with query heads differently (or the model normalises k after projecting it: "
                          "then QKVLayout(..., verify=False))")
    hint = "" if lay.cross else " (or keys come from another sequence: cross-attention?)"
    return Comparison(f"the per-head norms of the kernel's k differ from the module input projected "
                      f"with the layout (deviation {dev:.3g} > {tol:.3g}): key heads are split or paired with "
                      f"query heads differently{hint}")
