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
  ``key_value_states`` / ``encoder_hidden_states`` (cross-attention), with key
  head ``h // (n_heads / n_kv_heads)`` for query head h when the model repeated
  them. Eager attention: the operands of the 4-D matmul that produced the softmax
  input (``q @ k^T``) are checked the same way; when the logits come from
  elsewhere (einsum, bmm), only the head count is checked.

Runs on sampled forwards only, under no_grad, on the first ``n`` sequences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.layouts.vocab import bias_names, split_qkv, split_qkv_bias
from hooks.discovery import AttentionLayer

__all__ = ["Inputs", "Verdict", "module_inputs", "check_call", "spec_hint"]

_X_KEYS = ("hidden_states", "x", "query", "input", "inputs")
_KV_KEYS = ("key_value_states", "encoder_hidden_states")


@dataclass
class Inputs:
    """The module's input (n, T, E) and, for cross-attention, its key/value source (n, S, E)."""

    x: Tensor | None = None
    kv: Tensor | None = None


@dataclass
class Verdict:
    problem: str | None = None
    checked: str = ""  # "shapes", "heads", "exact", "q", "q,k": what was compared


def _first_3d(values, n: int) -> Tensor | None:
    for v in values:
        if isinstance(v, Tensor):
            return v[:n] if v.dim() == 3 and v.is_floating_point() else None
    return None


def module_inputs(args: tuple, kwargs: dict, n: int) -> Inputs:
    """References (no copies) to the first ``n`` sequences of the module's inputs."""
    x = _first_3d([a for a in args if isinstance(a, Tensor)] + [kwargs.get(k) for k in _X_KEYS], n)
    kv = _first_3d([kwargs.get(k) for k in _KV_KEYS], n)
    return Inputs(x, kv)


def spec_hint(layer: AttentionLayer) -> str:
    pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", layer.name)
    return (
        f"its layout {layer.layout.describe()} (adapter {layer.layout.adapter!r}) disagrees with the model; "
        f"pass the right one, e.g. Monitor(model, spec={{{pattern!r}: QKVLayout(n_heads=..., head_dim=..., "
        "q=..., packing='fused' | 'fused_per_head' | 'separate' | 'q_kv', n_kv_heads=..., transposed=..., "
        "cross=...)}) (docs/layouts.md)"
    )


def _refuse(layer: AttentionLayer, what: str) -> Verdict:
    return Verdict(problem=f"{layer.name} ({type(layer.module).__name__}): {what}; {spec_hint(layer)}")


def check_call(layer: AttentionLayer, seen, inputs: Inputs | None, n: int) -> Verdict:
    """Shapes always, values where visible; a Verdict with ``problem`` set refuses the layer."""
    lay = layer.layout
    if seen.heads != lay.n_heads:
        return _refuse(layer, f"the attention call computes {seen.heads} heads, the layout says "
                       f"n_heads={lay.n_heads}")
    if seen.q is not None and seen.q.shape[-1] != lay.head_dim:
        return _refuse(layer, f"the kernel's q has head size {seen.q.shape[-1]}, the layout says "
                       f"head_dim={lay.head_dim}")
    if seen.k is not None and seen.k.shape[1] not in (lay.kv_heads, lay.n_heads):
        return _refuse(layer, f"the kernel's k has {seen.k.shape[1]} heads, the layout says "
                       f"n_kv_heads={lay.kv_heads}")
    if seen.logits is not None and seen.q is None:
        return Verdict(checked="heads")  # eager logits without a visible q @ k^T: shapes only
    if seen.exact:
        return Verdict(checked="exact")
    x = None if inputs is None else inputs.x
    if not lay.verify or x is None or seen.q is None:
        return Verdict(checked="shapes")
    return _check_norms(layer, seen.q[:n], seen.k[:n], x, inputs.kv)


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


def _check_norms(layer: AttentionLayer, q: Tensor, k: Tensor, x: Tensor, kv: Tensor | None) -> Verdict:
    lay = layer.layout
    params = dict(layer.module.named_parameters())
    wq, wk, _ = split_qkv({name: params[name].detach() for name in lay.param_names}, lay)
    biases = {}
    for name in lay.param_names:
        found = [b for b in bias_names(name) if b in params]
        if found:
            biases[name] = params[found[0]].detach()
    bq, bk = split_qkv_bias(biases, lay)
    if x.shape[-1] != wq.shape[-1] or x.shape[0] != q.shape[0] or x.shape[1] != q.shape[2]:
        return Verdict(checked="shapes")  # the first input is not what the projections read
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, x, wq, wk)):
        return Verdict(checked="shapes")  # non-finite values cannot confirm or refute a layout
    tol = _tolerance(q)
    dev = _deviation(q.norm(dim=-1), _projected_norms(x, wq, bq))
    if not dev <= tol:
        return _refuse(layer, f"the per-head norms of the kernel's q differ from the module input projected "
                       f"with the layout (deviation {dev:.3g} > {tol:.3g}): heads are split or ordered differently "
                       "(or the q bias is not named like its weight, or the module transforms its input "
                       "before projecting: then QKVLayout(..., verify=False))")
    source = kv if lay.cross else x
    if source is None or source.shape[-1] != wk.shape[-1] or source.shape[0] != k.shape[0]:
        return Verdict(checked="q")
    if source.shape[1] != k.shape[2]:
        return Verdict(checked="q")  # keys from another sequence (cross-attention not named as such)
    want = _projected_norms(source, wk, bk)  # (n, G, S)
    if k.shape[1] != want.shape[1]:
        want = want.repeat_interleave(k.shape[1] // want.shape[1], dim=1)  # query head h <- key head h // r
    dev = _deviation(k.norm(dim=-1), want)
    if not dev <= tol:
        hint = "" if lay.cross else " (or keys come from another sequence: cross-attention?)"
        return _refuse(layer, f"the per-head norms of the kernel's k differ from the module input projected "
                       f"with the layout (deviation {dev:.3g} > {tol:.3g}): key heads are split or paired with "
                       f"query heads differently{hint}")
    return Verdict(checked="q,k")
