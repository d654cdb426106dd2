"""The largest pre-softmax logit of each query head, read from every attention call of the training forwards.

``MaxLogits`` arms a forward pre-hook and a forward hook on each attention module; around the module's forward
(training mode, grad enabled) a ``TorchFunctionMode`` hands each attention call to the kernel readers of
:mod:`hooks.capture.kernels` (``read_call`` into a ``Seen``: SDPA, a softmax over 3-D to 5-D logits, MHA) and
keeps one number per query head: the largest logit over every sequence of the batch, every valid query row and
every allowed key. Nothing else is computed (no entropy, rank or map), and nothing larger than (heads,) survives
the call. The maxima of all the forwards since the last :meth:`MaxLogits.take` are kept (gradient accumulation:
every micro-batch counts).

* SDPA and ``nn.MultiheadAttention``: ``scale * q . k`` from the call's q, k and scale, in float32 (float64 for
  float64 inputs), a block of query rows of every sequence at a time; the causal flag and the masks decide which
  keys are allowed, an additive mask's values are not added (the maximum of ``q . k`` that QK-clip scales).
* Eager softmax: the logits the softmax receives, as they are (with whatever the model added to them), a block
  of rows at a time in their own precision (float32 at least).

Padded query rows do not count, by the rule of the Monitor's capture (:func:`hooks.capture.forwards.query_rows`):
the model's own ``attention_mask`` (a (B, T) argument of the root module's forward) says which rows are tokens
when it describes the kernel's sequence, else a row whose position is excluded as a key from every row is
padding. The real call runs first, unchanged, and the reading runs under ``torch.no_grad()``
in the outermost mode (its pre-hook is prepended): outputs, RNG and autograd are untouched, and another capture
on the same modules (the Monitor's) never sees these reads.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch
from torch import Tensor, nn

from diag.math.attention import LazyLogits, excluded_by_additive_mask
from hooks.capture.forwards import ArmedForwards, ForwardMode, query_rows
from hooks.capture.kernels import Product, Unsupported, read_call
from hooks.layout.discover import AttentionLayer

__all__ = ["MaxLogits", "head_max"]

CHUNK_BYTES = 32 * 2**20  # float32 logits of one block of query rows (every sequence, every head) at most
_ALL = sys.maxsize // 4  # read_call's "first n sequences": every one


class MaxLogits(ArmedForwards):
    """Per attention layer, the largest logit of each query head since the last :meth:`take`.

    layers: the attention layers (``hooks.layout.discover.discover``); model: the root module, whose forward's
    ``attention_mask`` tells the padded query rows (None: the kernels' masks alone tell).
    """

    prepend = True  # the outermost mode: another capture on the same modules never sees these reads

    def __init__(self, layers: list[AttentionLayer], model: nn.Module | None = None) -> None:
        super().__init__(layers, model)
        self.maxima: dict[int, Tensor] = {}  # layer index -> (H,) float64, on the layer's device
        self.problems: dict[int, str] = {}  # layer index -> why an attention call of it was not read

    def take(self) -> tuple[dict[int, Tensor], dict[int, str]]:
        """The maxima and problems since the last call (then cleared; the hooks stay as they are)."""
        maxima, problems = self.maxima, self.problems
        self.maxima, self.problems = {}, {}
        return maxima, problems

    def _start(self, layer: AttentionLayer, module: nn.Module, args: tuple, kwargs: dict) -> ForwardMode | None:
        if not module.training or not torch.is_grad_enabled():
            return None
        return ForwardMode(layer, partial(self._record, layer))

    def _record(self, layer: AttentionLayer, func, args: tuple, kwargs: dict, products: tuple[Product, ...]) -> None:
        try:
            with torch.no_grad():
                seen = read_call(func, args, kwargs, _ALL, layer.layout.n_heads, products)
                if seen is None:
                    return
                if seen.heads != layer.layout.n_heads:
                    self.problems[layer.index] = (f"its attention call has {seen.heads} query heads, its layout "
                                                  f"{layer.layout.n_heads}")
                    return
                logits = seen.stats_logits()
                best = head_max(logits, query_rows(logits, seen, layer.cross, self._root.mask))
                prev = self.maxima.get(layer.index)
                self.maxima[layer.index] = best if prev is None else torch.maximum(prev, best)
        except Unsupported as err:
            self.problems[layer.index] = str(err)
        except Exception as err:  # noqa: BLE001 - a fault here must never reach the forward pass
            self.problems[layer.index] = f"reading its attention call failed: {err!r}"


def head_max(logits: Tensor | LazyLogits, valid: Tensor | None = None, chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """(H,) float64: the largest logit of each head over every sequence, every valid query row (``valid`` (N, Q)
    bool, None: every row) and every allowed key, a block of query rows of all sequences at a time.

    A :class:`LazyLogits` gives ``scale * q . k`` in float32 (float64 for float64 q), its causal flag and masks
    excluding keys (an additive mask's values are not added); a tensor (N, H, Q, K) is read as it is, excluded
    entries being -inf or an additive mask value (:func:`diag.math.attention.excluded_by_additive_mask`). A head
    with no allowed entry gets -inf; a NaN logit makes its head's maximum NaN."""
    n_seq, n_heads, n_q, n_k = logits.shape
    lazy = isinstance(logits, LazyLogits)
    dev = logits.q.device if lazy else logits.device
    step = max(1, min(n_q, chunk_bytes // max(1, 4 * n_seq * n_heads * n_k)))
    best = torch.full((n_heads,), -math.inf, dtype=torch.float64, device=dev)
    for start in range(0, n_q, step):
        stop = min(n_q, start + step)
        if lazy:
            chunk, excluded = _lazy_block(logits, start, stop)
        else:
            chunk = logits[:, :, start:stop]
            excluded = excluded_by_additive_mask(chunk)  # in the logits' own dtype (its finfo.min)
            chunk = chunk.float() if chunk.element_size() < 4 else chunk
        if valid is not None:
            padded = ~valid[:, None, start:stop, None]
            excluded = padded if excluded is None else excluded | padded
        block = chunk.masked_fill(excluded, -math.inf) if excluded is not None else chunk
        best = torch.maximum(best, block.amax(dim=(0, 2, 3)).double())
    return best


def _lazy_block(lz: LazyLogits, start: int, stop: int) -> tuple[Tensor, Tensor | None]:
    """``scale * q . k`` of query rows start:stop of every sequence (N, H, c, K'), and the keys excluded there
    (broadcastable, or None); K' = the keys up to the block's last row under a causal flag (the later ones are
    excluded from all of it)."""
    q, k = lz.q, lz.k
    n_seq, n_heads, _, d = q.shape
    n_kv = k.shape[1]
    keys = min(stop, k.shape[2]) if lz.is_causal else k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qs = q[:, :, start:stop].to(dtype).reshape(n_seq, n_kv, n_heads // n_kv, stop - start, d)
    kt = k[:, :, :keys].to(dtype).transpose(-1, -2)[:, :, None]  # (N, G, 1, D, K')
    chunk = (qs @ kt).reshape(n_seq, n_heads, stop - start, keys) * lz.scale  # query head h: key head h // (H/G)
    excluded = None
    if lz.is_causal:
        rows = torch.arange(start, stop, device=q.device)[:, None]
        excluded = torch.arange(keys, device=q.device) > rows  # (c, K')
    for mask in lz.masks:
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        m = m[:, :, start:stop] if m.shape[2] > 1 else m
        m = m[..., :keys] if m.shape[3] > 1 else m
        out = ~m if m.dtype == torch.bool else excluded_by_additive_mask(m)
        excluded = out if excluded is None else excluded | out
    return chunk, excluded
