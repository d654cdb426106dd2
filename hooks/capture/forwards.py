"""Hooks around the attention modules' forwards: what the Monitor's capture and QK-clip's max-logit reader share.

Both arm a forward pre-hook and a forward hook on each attention module (and, given the root module, the
:class:`ModelMask` hooks on it), enter a :class:`ForwardMode` for the module's forward and leave it when the
forward ends. The mode runs every call first, unchanged, remembers the latest few products (the q and k of a
softmax after them) and hands each attention call (:func:`hooks.capture.kernels.is_attention_call`) to its
owner. Padded query rows are told by one rule, :func:`query_rows`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from diag.math.attention import LazyLogits, valid_query_rows
from hooks.capture.kernels import Product, Seen, excluded_keys, is_attention_call, product_operands
from hooks.layout.discover import AttentionLayer

__all__ = ["KERNELS", "ArmedForwards", "ForwardMode", "ModelMask", "attn_implementation", "query_rows"]

# Hugging Face attention implementations whose calls the kernel readers see (None: not a Hugging Face module);
# flex and flash attention show neither q, k nor logits.
KERNELS = (None, "eager", "sdpa")

_PRODUCTS = 4  # products remembered per module forward (a softmax's q and k are among the latest)

# what the mode hands its owner for each attention call: (func, args, kwargs, the latest products)
OnCall = Callable[[object, tuple, dict, tuple[Product, ...]], None]


def attn_implementation(module: nn.Module) -> str | None:
    """The Hugging Face attention implementation a module is configured for, or None."""
    config = getattr(module, "config", None)
    try:
        impl = getattr(config, "_attn_implementation", None)
    except Exception:  # noqa: BLE001 - a config property that raises is simply not Hugging Face's
        return None
    return impl if isinstance(impl, str) else None


class ForwardMode(TorchFunctionMode):
    """Watches the calls of one attention module's forward: the latest products and the attention calls.

    ``watch`` sees every call after it ran (the capture keeps clamps and the key projection's inputs there)."""

    def __init__(self, layer: AttentionLayer, on_call: OnCall) -> None:
        super().__init__()
        self.layer, self.on_call = layer, on_call
        self.products: tuple[Product, ...] = ()

    def watch(self, func, args: tuple, kwargs: dict) -> None:
        """Called with every call of the forward, after it ran; nothing by default."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.watch(func, args, kwargs)
        product = product_operands(func, args, kwargs, out)
        if product is not None:
            self.products = self.products[-(_PRODUCTS - 1):] + (product,)
        elif is_attention_call(func, args, kwargs):
            self.on_call(func, args, kwargs, self.products)
        return out


class ModelMask:
    """The model's own (B, T) ``attention_mask`` while its forward runs (None outside it): a pre-hook and a hook
    on the root module, for the attention calls inside that forward (:func:`query_rows`)."""

    def __init__(self) -> None:
        self.mask: Tensor | None = None

    def register(self, model: nn.Module) -> list[RemovableHandle]:
        return [model.register_forward_pre_hook(self._start, with_kwargs=True),
                model.register_forward_hook(self._end, always_call=True)]

    def _start(self, module, args, kwargs):
        self.mask = _attention_mask(module, args, kwargs)

    def _end(self, module, args, output):
        self.mask = None


def _attention_mask(module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
    """The ``attention_mask`` argument of a forward call, if it is a (B, T) padding mask."""
    mask = kwargs.get("attention_mask")
    if mask is None and args:
        try:
            mask = inspect.signature(module.forward).bind_partial(*args).arguments.get("attention_mask")
        except (TypeError, ValueError):  # a signature that cannot be read or bound: no mask
            mask = None
    return mask if isinstance(mask, Tensor) and mask.dim() == 2 else None


def query_rows(logits: Tensor | LazyLogits, seen: Seen, cross: bool, model_mask: Tensor | None) -> Tensor | None:
    """(n, Q) bool, False on padded query rows (all True without padding: the device decides, no host read);
    None when every row counts: cross-attention, and a fused call with no mask but the causal flag and no
    padding mask of the model's. ``model_mask``: the model's own (B, T) ``attention_mask``, used when it
    describes the kernel's sequence; else a row whose position every row excludes as a key is padding."""
    if cross or not seen.self_attn:
        return None
    if model_mask is None and isinstance(logits, LazyLogits) and not logits.masks:
        return None  # no mask but the causal flag: every row is a token, known without reading the device
    excluded = excluded_keys(logits)  # (n, Q, K)
    if excluded.shape[1] != excluded.shape[2]:
        return None
    if model_mask is not None and model_mask.shape == (seen.batch, excluded.shape[1]):
        return valid_query_rows(excluded, model_mask[: excluded.shape[0]])
    return valid_query_rows(excluded)


class ArmedForwards:
    """The hooks on each attention layer's forward while armed, and the one mode entered at a time.

    Subclasses say what a forward's start does (:meth:`_start`: return a mode to enter, or None) and what its
    end does beyond leaving the mode (:meth:`_end`); ``prepend`` puts the pre-hooks before any other (the
    outermost mode). model: the root module, whose forward's ``attention_mask`` tells the padded query rows.
    """

    prepend = False

    def __init__(self, layers: list[AttentionLayer], model: nn.Module | None = None) -> None:
        self.layers, self.model = layers, model
        self._handles: list[RemovableHandle] = []
        self._mode: ForwardMode | None = None
        self._root = ModelMask()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if self._handles:
            return
        self._on_arm()
        if self.model is not None:  # the root's attention_mask, for the attention calls inside its forward only
            self._handles += self._root.register(self.model)
        for layer in self.layers:
            pre = layer.module.register_forward_pre_hook(self._pre_hook(layer), prepend=self.prepend,
                                                         with_kwargs=True)
            post = layer.module.register_forward_hook(self._post_hook(layer), always_call=True)
            self._handles += [pre, post]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._root.mask = None
        self._exit_mode()

    def _on_arm(self) -> None:
        """Called by :meth:`arm` before the hooks are registered; nothing by default."""

    def _start(self, layer: AttentionLayer, module: nn.Module, args: tuple, kwargs: dict) -> ForwardMode | None:
        """The mode ``layer``'s forward runs in (what the subclass reads there), or None to leave it unobserved;
        every subclass says (the capture: the attention sample, QK-clip's reader: the largest logit)."""
        raise NotImplementedError

    def _end(self, layer: AttentionLayer, output: object) -> None:
        """Called after the mode of ``layer``'s forward was left; nothing by default."""

    def _pre_hook(self, layer: AttentionLayer):
        def hook(module, args, kwargs):
            if self._mode is not None:
                return
            mode = self._start(layer, module, args, kwargs)
            if mode is not None:
                self._mode = mode
                mode.__enter__()

        return hook

    def _post_hook(self, layer: AttentionLayer):
        def hook(module, args, output):
            if self._mode is not None and self._mode.layer is layer:
                self._exit_mode()
                self._end(layer, output)

        return hook

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
