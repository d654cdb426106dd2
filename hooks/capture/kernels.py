"""Read one attention kernel call: its q, k, logits and masks, as the model passed them.

The capture's ``TorchFunctionMode`` (:mod:`hooks.capture.capture`) hands every call it sees
inside a monitored module to :func:`read_call`. Four kinds of call are attention:

* ``F.scaled_dot_product_attention``: q, k, mask, ``is_causal``, scale as passed;
* ``softmax`` over the last dim of 4-D ``(B, H, T, S)`` logits (eager attention), of
  3-D ``(B*H, T, S)`` logits (fairseq style, split as ``B`` sequences of ``H`` heads), or of
  5-D grouped-query ``(B, G, R, T, S)`` logits (query head ``g*R + r``);
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): q and k projected
  here from its inputs with its own weights.

A softmax's q and k are those of the latest product of two tensors (of the last few in the
module's forward) whose output has the softmax input's shape (up to a reshape between
``(B*H, ...)`` and ``(B, H, ...)``):
``matmul``/``@`` (3-D to 5-D), ``bmm``, ``baddbmm``, or a two-operand ``einsum`` that
contracts one index (``'bhid,bhjd->bhij'``, ``'bqhd,bkhd->bhqk'``, ``'...id,...jd->...ij'``,
grouped ``'bgrid,bgjd->bgrij'``).
:func:`product_operands` turns each into q ``(.., T, D)`` and k ``(.., S, D)``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from diag.math.attention import LazyLogits, excluded_by_additive_mask

__all__ = ["Unsupported", "Seen", "Product", "product_operands", "read_call", "is_attention_call", "excluded_keys",
           "clamp_call"]

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class Unsupported(Exception):
    """The call was seen but its form is not measured; the message says which."""


@dataclass
class Seen:
    """One attention call as the capture saw it.

    logits: (n, H, Q, K) as fed to the softmax (first n sequences), else None.
    q, k: (B, H, Q, D) and (B, G or H, K, D) that produced the logits (SDPA, MHA, and a
    softmax whose product was seen), else None. exact: q and k were projected here with the
    module's own weights (MHA). self_attn: False when q and k are known to come from two
    sequences. note: why the call's q and k could not be identified (then the layout check
    sees the head count only).
    """

    heads: int
    stats_logits: Callable[[], Tensor | LazyLogits]
    logits: Tensor | None = None
    q: Tensor | None = None
    k: Tensor | None = None
    exact: bool = False
    self_attn: bool = True
    note: str | None = None
    batch: int = 0  # the call's batch size (all sequences, not only the n analysed)
    # other products of the logits' shape before the softmax, latest first, as (q, k): the one that made the
    # logits may be any of them (DeBERTa's relative-position products can have the shape of q @ k^T)
    others: tuple[tuple[Tensor, Tensor], ...] = ()

    def with_qk(self, q: Tensor, k: Tensor) -> Seen:
        """The same call read with another product's operands as its q and k."""
        return replace(self, q=q, k=k, self_attn=q.shape[2] == k.shape[2], others=())


@dataclass
class Product:
    """The operands of a product of two tensors: q (.., T, D), k (.., S, D), and its output shape."""

    q: Tensor
    k: Tensor
    shape: torch.Size
    via: str


_MATMULS = {torch.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.Tensor.__matmul__: "matmul",
            torch.bmm: "bmm", torch.Tensor.bmm: "bmm"}
_BADDBMMS = {torch.baddbmm: "baddbmm", torch.Tensor.baddbmm: "baddbmm"}


def product_operands(func, args: tuple, kwargs: dict, out) -> Product | None:
    """q and k of a 3-D to 5-D product ``q @ k^T`` (matmul, bmm, baddbmm, einsum), else None."""
    if not isinstance(out, Tensor) or out.dim() not in (3, 4, 5):
        return None
    if func in _MATMULS:
        a, b = (args + (kwargs.get("other", kwargs.get("mat2")),))[:2]
    elif func in _BADDBMMS:
        a, b = (args + (kwargs.get("batch1"), kwargs.get("batch2")))[1:3]
    elif func is torch.einsum:
        return _einsum(args, out)
    else:
        return None
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == b.dim() == out.dim()):
        return None
    return Product(a, b.transpose(-1, -2), out.shape, _MATMULS.get(func) or _BADDBMMS[func])


def _expand_ellipsis(spec: str, ndim: int, fresh: str, width: int) -> str | None:
    if "..." not in spec:
        return spec
    n = ndim - (len(spec) - 3)
    return None if n < 0 or n > width else spec.replace("...", fresh[width - n : width])


def _einsum(args: tuple, out: Tensor) -> Product | None:
    if not args or not isinstance(args[0], str):
        return None
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    if len(ops) != 2 or "->" not in eq or not all(isinstance(o, Tensor) for o in ops):
        return None
    left, right = eq.split("->")
    specs = left.split(",")
    fresh = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq)
    width = max(o.dim() for o in ops)
    specs = [_expand_ellipsis(s, o.dim(), fresh, width) for s, o in zip(specs, ops)]
    right = _expand_ellipsis(right, out.dim(), fresh, width)
    if None in specs or right is None or any(len(s) != o.dim() for s, o in zip(specs, ops)):
        return None
    (sa, sb), (a, b) = specs, ops
    key, query = right[-1], right[-2]
    if key in sa:  # the softmax's last index belongs to the first operand: it holds the keys
        (sa, a), (sb, b) = (sb, b), (sa, a)
    contracted = [c for c in sa if c in sb and c not in right]
    batch = right[:-2]
    kv_batch = "".join(c for c in batch if c in sb)  # a batch index only q has: query heads sharing a key head
    if (len(contracted) != 1 or query not in sa or query in sb or key not in sb or key in sa
            or any(c not in sa for c in batch) or len(set(sa)) != len(sa) or len(set(sb)) != len(sb)
            or set(sa) != set(batch + query + contracted[0]) or set(sb) != set(kv_batch + key + contracted[0])):
        return None
    d = contracted[0]
    q = a.permute([sa.index(c) for c in batch + query + d])
    k = b.permute([sb.index(c) for c in kv_batch + key + d])
    return Product(q, k, out.shape, "einsum")


def _sdpa_args(args: tuple, kwargs: dict) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _slice_mask(mask: Tensor | None, batch: int, n: int) -> Tensor | None:
    if mask is None or mask.dim() < 4 or mask.shape[0] != batch:
        return mask
    return mask[:n]


def _from_sdpa(args: tuple, kwargs: dict, n: int, heads: int, products: tuple[Product, ...]) -> Seen:
    a = _sdpa_args(args, kwargs)
    q, k = a["query"], a["key"]
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if q.dim() != 4:
        raise Unsupported(f"SDPA with {q.dim()}-D query {tuple(q.shape)} is not measured")
    mask = _slice_mask(a.get("attn_mask"), q.shape[0], n)
    return Seen(q.shape[1], lambda: LazyLogits(
        q[:n], k[:n], a.get("scale"), (mask,), bool(a.get("is_causal", False))
    ), q=q, k=k, self_attn=q.shape[2] == k.shape[2], batch=q.shape[0])


def _by_heads(t: Tensor, batch: int, heads: int) -> Tensor | None:
    """(B, heads, T, D) from (B, heads, T, D) or (B*heads, T, D) (sequence-major, as fairseq and torch split),
    or from grouped (B, G, R, T, D) (query head g*R + r); grouped keys (B, G, 1 or absent, S, D) keep G heads."""
    if t.shape[0] != batch and not (t.dim() == 3 and t.shape[0] == batch * heads):
        return None
    if t.dim() == 5:
        return t[:, :, 0] if t.shape[2] == 1 else t.flatten(1, 2)
    if t.dim() == 4:
        return t
    return t.reshape(batch, heads, *t.shape[1:])


def _from_softmax(args: tuple, kwargs: dict, n: int, heads: int, products: tuple[Product, ...]) -> Seen | None:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, Tensor) or x.dim() not in (3, 4, 5) or dim not in (-1, x.dim() - 1):
        return None
    if x.dim() == 3 and x.shape[0] % heads:
        raise Unsupported(f"softmax over 3-D logits {tuple(x.shape)} whose first dim is not a multiple of "
                          f"n_heads={heads}")
    batch = x.shape[0] if x.dim() > 3 else x.shape[0] // heads
    heads = math.prod(x.shape[1:-2]) if x.dim() > 3 else heads
    if x.dim() == 3:
        logits = x[: n * heads].reshape(-1, heads, *x.shape[1:])  # (n, H, T, S)
    else:  # 5-D: grouped-query logits (B, G, R, T, S), query head g*R + r pairs with key head g
        logits = x[:n] if x.dim() == 4 else x[:n].flatten(1, 2)
    pairs = []  # every product of that shape, latest first: the layout check takes the one the layout explains
    for product in reversed(products):
        if product.shape[-2:] == x.shape[-2:] and math.prod(product.shape) == x.numel():
            q, k = _by_heads(product.q, batch, heads), _by_heads(product.k, batch, heads)
            if q is not None and k is not None:
                pairs.append((q, k))
    q, k = pairs[0] if pairs else (None, None)
    if q is None or k is None:
        if x.dim() == 3:
            raise Unsupported(f"softmax over 3-D (B*H, T, S) logits {tuple(x.shape)} whose q and k were not seen "
                              "(no matmul, bmm, baddbmm or einsum of that shape just before it): its heads cannot "
                              "be told apart from its sequences, so they are not measured")
        note = ("not verifiable: its attention logits reach the softmax from no product of q and k that the capture "
                "recognises (matmul, bmm, baddbmm or a two-operand einsum), so only the head count was checked "
                "against the layout, not the per-head projections")
        return Seen(heads, lambda: logits, logits=logits, note=note, self_attn=x.shape[-1] == x.shape[-2],
                    batch=batch)
    return Seen(heads, lambda: logits, logits=logits, q=q, k=k, self_attn=q.shape[2] == k.shape[2], batch=batch,
                others=tuple(pairs[1:]))


def _mha_masks(
    attn_mask: Tensor | None, kpm: Tensor | None, shape: tuple[int, ...], n: int
) -> tuple[Tensor, ...]:
    """nn.MultiheadAttention's two masks as additive masks broadcastable to (n, H, L, S), each no
    larger than the mask it comes from (its boolean masks mark excluded keys: the opposite of SDPA's)."""
    batch, heads, n_q, n_k = shape
    out = []
    for m, view in ((attn_mask, "attn"), (kpm, "kpm")):
        if m is None:
            continue
        if view == "attn":
            m = m.reshape(batch, heads, n_q, n_k)[:n] if m.dim() == 3 else m
        else:
            m = m[:n, None, None, :]
        out.append(m.double().masked_fill(m, -math.inf) if m.dtype == torch.bool else m)
    return tuple(out)


def _from_mha(args: tuple, kwargs: dict, n: int, heads: int, products: tuple[Product, ...]) -> Seen:
    a = _MHA_SIGNATURE.bind(*args, **kwargs).arguments
    if a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None:
        raise Unsupported("nn.MultiheadAttention with bias_k/add_zero_attn/static_k is not measured")
    query, key = a["query"], a["key"]
    self_attn = query is key
    kpm = a.get("key_padding_mask")
    if query.dim() == 2:  # unbatched: (L, E), key padding (S,)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        kpm = None if kpm is None else kpm[None]
    heads = a["num_heads"]
    n_q, batch, embed = query.shape
    d = embed // heads
    bias = a.get("in_proj_bias")
    b_q, b_k = (None, None) if bias is None else (bias[:embed], bias[embed : 2 * embed])
    if a.get("use_separate_proj_weight"):
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = a["in_proj_weight"][:embed], a["in_proj_weight"][embed : 2 * embed]
    q = F.linear(query[:, :n], w_q, b_q).reshape(n_q, -1, heads, d).permute(1, 2, 0, 3)  # (n, H, L, D)
    k = F.linear(key[:, :n], w_k, b_k).reshape(key.shape[0], -1, heads, d).permute(1, 2, 0, 3)
    shape = (batch, heads, n_q, key.shape[0])
    masks = _mha_masks(a.get("attn_mask"), kpm, shape, q.shape[0])
    return Seen(heads, lambda: LazyLogits(q, k, None, masks), q=q, k=k, exact=True, self_attn=self_attn,
                batch=batch)


_HANDLERS: dict[Callable, Callable] = {
    F.scaled_dot_product_attention: _from_sdpa,
    F.softmax: _from_softmax,
    torch.softmax: _from_softmax,
    torch.Tensor.softmax: _from_softmax,
    F.multi_head_attention_forward: _from_mha,
}


def is_attention_call(func, args: tuple, kwargs: dict) -> bool:
    """Whether :func:`read_call` would read this call (cheap: no tensor work)."""
    if func not in _HANDLERS:
        return False
    if _HANDLERS[func] is not _from_softmax:
        return True
    x = args[0] if args else None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(x, Tensor) and x.dim() in (3, 4, 5) and dim in (-1, x.dim() - 1)


def read_call(func, args: tuple, kwargs: dict, n: int, heads: int, products: tuple[Product, ...]) -> Seen | None:
    """The call as a :class:`Seen` (None: not attention); ``Unsupported`` for a form not measured.

    n: sequences analysed; heads: the layout's head count (splits 3-D logits); products: the latest
    products seen before this call in the same module's forward, oldest first."""
    handler = _HANDLERS.get(func)
    return None if handler is None else handler(args, kwargs, n, heads, products)


_CLAMPS = {torch.clamp: "clamp", torch.clamp_: "clamp", torch.Tensor.clamp: "clamp", torch.Tensor.clamp_: "clamp",
           torch.clip: "clip", torch.clip_: "clip", torch.Tensor.clip: "clip", torch.Tensor.clip_: "clip",
           F.hardtanh: "hardtanh", F.hardtanh_: "hardtanh"}


def clamp_call(func, args: tuple, kwargs: dict) -> tuple[str, float | None, float | None] | None:
    """(name, low, high) of a clamp of a floating tensor to constant bounds (``clamp``/``clip`` and their
    in-place forms, ``hardtanh``), else None."""
    name = _CLAMPS.get(func)
    if name is None or not args or not isinstance(args[0], Tensor) or not args[0].is_floating_point():
        return None
    keys = ("min_val", "max_val") if name == "hardtanh" else ("min", "max")
    low, high = (list(args[1:3]) + [None, None])[:2]
    low, high = kwargs.get(keys[0], low), kwargs.get(keys[1], high)
    if name == "hardtanh":
        low, high = -1.0 if low is None else low, 1.0 if high is None else high
    if not all(b is None or (isinstance(b, (int, float)) and not isinstance(b, bool)) for b in (low, high)):
        return None  # bounds that are tensors: not one constant range
    return name, None if low is None else float(low), None if high is None else float(high)


def excluded_keys(logits: Tensor | LazyLogits) -> Tensor:
    """(n, Q, K) bool: keys the kernel excludes from each query row, of query head 0."""
    if isinstance(logits, LazyLogits):
        return logits.excluded()
    return excluded_by_additive_mask(logits[:, 0])
