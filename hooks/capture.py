"""Capture the attention a model really computes, on sampled steps only.

While armed, each monitored attention module gets a forward pre-hook and a
forward hook. Around that module's forward (training mode, grad enabled, first
call since arming) a ``TorchFunctionMode`` watches three functions:

* ``F.scaled_dot_product_attention``: q and k as the kernel receives them (after
  RoPE, grouped-query heads as passed), its mask, ``is_causal`` and scale;
* ``softmax`` over the last dim of a 4-D tensor: the logits of eager attention,
  masks and biases already added (the operands of the 4-D matmul just before it,
  eager attention's ``q @ k^T``, are kept for the layout check);
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): q and k are
  projected from its inputs with its own weights; calls made inside it (its SDPA)
  are not dispatched to the mode again.

Each call is reduced at once to per-head statistics of the first ``n_seqs``
sequences of the batch (:mod:`diag.math.attention`); nothing larger survives the call.
The real call runs first, unchanged: outputs, RNG and autograd are untouched.

Before a call counts, it is checked against the layer's layout (:mod:`hooks.verify`):
head count and head size, self- versus cross-attention, and, where the kernel's q
and k are visible (SDPA), their per-head norms against the module input projected
with the layout. A disagreement refuses the layer's attention statistics with a
message that names the module and the spec to pass. Hugging Face models configured
for another kernel than eager or SDPA (flex, flash) are refused before the mode is
entered, so the capture never reads a call it cannot interpret.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from diag.math.attention import AttentionStats, LazyLogits, stats_from_logits
from hooks.discovery import AttentionLayer
from hooks.verify import Inputs, check_call, module_inputs

__all__ = ["AttentionCapture"]

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class _Unsupported(Exception):
    """The call was seen but its form is not measured; the message says which."""


@dataclass
class Seen:
    """One attention call as the capture saw it.

    logits: (B, H, Q, K) as fed to the softmax (eager), else None.
    q, k: (B, H, Q, D) and (B, G or H, K, D) as the kernel got them (SDPA, MHA), else None.
    exact: q and k were projected here with the module's own weights (MHA).
    """

    heads: int
    stats_logits: Callable[[], Tensor | LazyLogits]
    logits: Tensor | None = None
    q: Tensor | None = None
    k: Tensor | None = None
    exact: bool = False


def _sdpa_args(args: tuple, kwargs: dict) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _slice_mask(mask: Tensor | None, batch: int, n: int) -> Tensor | None:
    if mask is None or mask.dim() < 4 or mask.shape[0] != batch:
        return mask
    return mask[:n]


def _from_sdpa(args: tuple, kwargs: dict, n: int) -> Seen:
    a = _sdpa_args(args, kwargs)
    q, k = a["query"], a["key"]
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if q.dim() != 4:
        raise _Unsupported(f"SDPA with {q.dim()}-D query {tuple(q.shape)} is not measured")
    batch = q.shape[0]
    mask = _slice_mask(a.get("attn_mask"), batch, n)
    return Seen(q.shape[1], lambda: LazyLogits(
        q[:n], k[:n], a.get("scale"), (mask,), bool(a.get("is_causal", False))
    ), q=q, k=k)


def _from_softmax(args: tuple, kwargs: dict, n: int) -> Seen | None:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, Tensor) or x.dim() != 4 or dim not in (-1, 3):
        return None
    return Seen(x.shape[1], lambda: x[:n], logits=x)


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


def _from_mha(args: tuple, kwargs: dict, n: int) -> Seen:
    a = _MHA_SIGNATURE.bind(*args, **kwargs).arguments
    if a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None:
        raise _Unsupported("nn.MultiheadAttention with bias_k/add_zero_attn/static_k is not measured")
    query, key = a["query"], a["key"]
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
    return Seen(heads, lambda: LazyLogits(q, k, None, masks), q=q, k=k, exact=True)


_HANDLERS: dict[Callable, Callable] = {
    F.scaled_dot_product_attention: _from_sdpa,
    F.softmax: _from_softmax,
    torch.softmax: _from_softmax,
    Tensor.softmax: _from_softmax,
    F.multi_head_attention_forward: _from_mha,
}


def _attn_implementation(module) -> str | None:
    """The Hugging Face attention implementation a module is configured for, or None."""
    config = getattr(module, "config", None)
    try:
        impl = getattr(config, "_attn_implementation", None)
    except Exception:  # noqa: BLE001 - a config property that raises is simply not Hugging Face's
        return None
    return impl if isinstance(impl, str) else None


_MATMULS = (torch.matmul, Tensor.matmul, Tensor.__matmul__)


class _Mode(TorchFunctionMode):
    """Watches the calls of one attention module's forward.

    ``scores`` keeps the operands of the latest 4-D matmul (eager attention's
    ``q @ k^T``), so that the softmax after it can be checked against the layout.
    """

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self.capture = capture
        self.scores: tuple[Tensor, Tensor, torch.Size] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _MATMULS:
            a, b = (args + (kwargs.get("other"),))[:2]
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == b.dim() == 4:
                self.scores = (a, b, out.shape)
            return out
        handler = _HANDLERS.get(func)
        if handler is not None:
            self.capture._record(handler, args, kwargs, self.scores)
        return out


class AttentionCapture:
    """Arms hooks for one forward, reduces each attention call to per-head statistics."""

    def __init__(self, layers: list[AttentionLayer], n_seqs: int = 2, rank_rows: int = 256) -> None:
        self.layers = layers
        self.n_seqs = n_seqs
        self.rank_rows = rank_rows
        self.results: dict[int, AttentionStats] = {}
        self.problems: dict[int, str] = {}
        self.checked: dict[int, str] = {}  # layer index -> what the layout check compared
        self.layout_refused: dict[int, str] = {}  # layer index -> why its layout disagrees with the model
        # Layers whose layout a capture confirmed: the packing cannot change, so the (costly, float64)
        # projection check runs once per layer, not at every sampled step.
        self._confirmed: dict[int, str] = {}
        self._handles: list[RemovableHandle] = []
        self._active: AttentionLayer | None = None
        self._inputs: Inputs | None = None
        self._mode: _Mode | None = None

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if self._handles:
            return
        self.results, self.problems, self.checked, self.layout_refused = {}, {}, {}, {}
        for layer in self.layers:
            pre = layer.module.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True)
            post = layer.module.register_forward_hook(self._post_hook(layer), always_call=True)
            self._handles += [pre, post]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._exit_mode()

    def take(self) -> tuple[dict[int, AttentionStats], dict[int, str]]:
        """Results of the armed forward (then disarmed and cleared)."""
        self.disarm()
        results, problems = self.results, self.problems
        self.results, self.problems = {}, {}
        return results, problems

    def _pre_hook(self, layer: AttentionLayer):
        def hook(module, args, kwargs):
            done = layer.index in self.results or layer.index in self.problems
            if done or self._mode is not None or not module.training or not torch.is_grad_enabled():
                return
            impl = _attn_implementation(module)
            if impl not in (None, "eager", "sdpa"):
                self.problems[layer.index] = (
                    f"attention implementation {impl!r} is not measured (its kernel does not show q, k "
                    "or logits); build the model with attn_implementation='sdpa' or 'eager'"
                )
                return
            self._active = layer
            self._inputs = module_inputs(args, kwargs, self.n_seqs)
            self._mode = _Mode(self)
            self._mode.__enter__()

        return hook

    def _post_hook(self, layer: AttentionLayer):
        def hook(module, args, output):
            if self._active is layer:
                self._exit_mode()
                if output is None:  # the forward raised: what it saw does not count
                    self.results.pop(layer.index, None)
                    self.problems.pop(layer.index, None)
                elif layer.index not in self.results and layer.index not in self.problems:
                    self.problems[layer.index] = "no attention call (SDPA, softmax or MHA) was seen"

        return hook

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode, self._active, self._inputs = self._mode, None, None, None
            mode.__exit__(None, None, None)

    def _record(self, handler: Callable, args: tuple, kwargs: dict, scores: tuple | None = None) -> None:
        layer = self._active
        if layer is None or layer.index in self.results or layer.index in self.problems:
            return
        try:
            with torch.no_grad():
                seen = handler(args, kwargs, self.n_seqs)
                if seen is None:
                    return
                if seen.logits is not None and scores is not None and scores[2] == seen.logits.shape:
                    seen.q, seen.k = scores[0], scores[1].transpose(-1, -2)  # the q @ k^T before this softmax
                confirmed = self._confirmed.get(layer.index)
                if confirmed is None:
                    verdict = check_call(layer, seen, self._inputs, self.n_seqs)
                    if verdict.problem is not None:
                        self.problems[layer.index] = self.layout_refused[layer.index] = verdict.problem
                        return
                    confirmed = verdict.checked
                    if confirmed in ("q,k", "exact"):  # q and k compared with values: settled for good
                        self._confirmed[layer.index] = confirmed
                self.checked[layer.index] = confirmed
                self.results[layer.index] = stats_from_logits(seen.stats_logits(), self.rank_rows)
        except _Unsupported as err:
            self.problems[layer.index] = str(err)
        except Exception as err:  # noqa: BLE001 - a fault here must never reach the forward pass
            self.problems[layer.index] = f"capture failed: {err!r}"
