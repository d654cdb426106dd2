"""Capture the attention a model really computes, on sampled steps only.

While armed, each monitored attention module gets a forward pre-hook and a
forward hook. Around that module's forward (training mode, grad enabled, first
call since arming) a ``TorchFunctionMode`` watches the attention kernels that
:mod:`hooks.capture.kernels` reads (SDPA; softmax over 4-D ``(B, H, T, S)`` or 3-D
``(B*H, T, S)`` logits, with the q and k of the ``matmul``/``bmm``/``baddbmm``/``einsum``
that made them; ``F.multi_head_attention_forward``) and the products before them.

Each call is reduced at once to per-head statistics of the first ``n_seqs``
sequences of the batch (:mod:`diag.math.attention`); nothing larger survives the call.
With ``only`` set (under FSDP2 alone each rank the layers it owns, :func:`hooks.parallel.owners.share_attention`),
the other layers are not captured once their layout is settled.
The real call runs first, unchanged: outputs, RNG and autograd are untouched.
Padded query rows do not count (:func:`query_rows`, which QK-clip shares): they are read
from the model's own ``attention_mask`` (a keyword or positional argument of the root
module's forward, recorded by a pre-hook on it) when it describes the kernel's
sequence, else from the keys the kernel excludes from every row.

Before a call counts, the capture hands what it saw (:class:`hooks.layout.confirm.CapturedCall`: the
call's q, k and logits, the module's inputs, what the key projection read) to the layers' layout book
(:class:`hooks.layout.book.LayoutBook`), which decides: head count and head size, self- versus
cross-attention, and, where the kernel's q and k are known (SDPA, MHA, and a softmax whose product was seen),
their per-head norms against the module input projected with the layout (batch-first, or time-first as
fairseq passes it). A disagreement refuses the layer's attention statistics with a message that names the
module and the spec to pass (and, where the layout is at fault, every metric of the layer: the book says
which). A softmax whose q and k were not seen is measured but reported once as not verifiable; a second
attention call in the same forward is reported once as not measured. The capture itself decides nothing
about layouts. Hugging Face models configured for
another kernel than eager or SDPA (flex, flash) are refused before the mode is
entered, so the capture never reads a call it cannot interpret.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from diag.layouts.packings import packing_of
from diag.math.attention import (
    SOLVE_BYTES,
    AttentionStats,
    LazyLogits,
    solve_ranks,
    stats_from_logits,
    valid_query_rows,
)
from hooks.capture.kernels import (
    Product,
    Seen,
    Unsupported,
    clamp_call,
    excluded_keys,
    is_attention_call,
    product_operands,
    read_call,
)
from hooks.layout.book import LayoutBook
from hooks.layout.confirm import CapturedCall, Elementwise, Inputs, module_inputs
from hooks.layout.discover import AttentionLayer

__all__ = ["AttentionCapture", "Seen", "ModelMask", "query_rows"]


def _attn_implementation(module) -> str | None:
    """The Hugging Face attention implementation a module is configured for, or None."""
    config = getattr(module, "config", None)
    try:
        impl = getattr(config, "_attn_implementation", None)
    except Exception:  # noqa: BLE001 - a config property that raises is simply not Hugging Face's
        return None
    return impl if isinstance(impl, str) else None


# Sequences with more query rows than this have their entropy and sink share read from this many rows spread
# through them (docs/metrics.md#attention-at-long-context); shorter ones from every row.
ENTROPY_ROWS = 1024

_PRODUCTS = 4  # products remembered per module forward
_KEY_CALLS = 4  # calls of the key projection remembered per module forward
_CLAMPS = 4  # distinct clamps remembered per module forward


class _Mode(TorchFunctionMode):
    """Watches the calls of one attention module's forward.

    ``products`` keeps the operands of the latest few 3-D to 5-D products (``q @ k^T``, ``bmm``,
    ``baddbmm``, ``einsum``; DeBERTa makes two relative-position products after ``q @ k^T``), so
    that the softmax after them knows its q and k. ``key_weight``: the key projection's own weight
    where it is a module of its own (``separate`` and ``q_kv`` packings), to keep what the
    ``F.linear`` calls with it read (``key_inputs``, the last few): keys computed from something other
    than the module's input (Twins', PVT's and SegFormer's keys come from a strided convolution of
    it) are then checked against what they were really projected from. ``between``: the clamps to constant
    bounds (``clamp``, ``clip``, ``hardtanh``) the forward made, which the layout book tries between the
    projections and the kernel (MPT's and OLMo's ``clip_qkv``).
    """

    def __init__(self, capture: AttentionCapture, key_weight: Tensor | None = None) -> None:
        super().__init__()
        self.capture = capture
        self.products: tuple[Product, ...] = ()
        self.key_weight = key_weight
        self.key_inputs: list[Tensor] = []
        self.between: tuple[Elementwise, ...] = ()  # clamps to constant bounds seen in this forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        clamp = clamp_call(func, args, kwargs)
        if clamp is not None and Elementwise(*clamp) not in self.between:
            self.between = self.between[-(_CLAMPS - 1):] + (Elementwise(*clamp),)
        if self.key_weight is not None and func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.key_weight and args and isinstance(args[0], Tensor):
                # references, dropped when the module's forward ends
                self.key_inputs = self.key_inputs[-(_KEY_CALLS - 1):] + [args[0]]
        product = product_operands(func, args, kwargs, out)
        if product is not None:
            self.products = self.products[-(_PRODUCTS - 1):] + (product,)
        elif is_attention_call(func, args, kwargs):
            self.capture._record(func, args, kwargs, self.products)
        return out


def _key_weight(layer: AttentionLayer) -> Tensor | None:
    """The key projection's weight where it is a parameter of its own (its packing says which: separate, q_kv)."""
    name = packing_of(layer.layout).key_weight(layer.layout)
    return None if name is None else dict(layer.module.named_parameters()).get(name)


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


class ModelMask:
    """The model's own (B, T) ``attention_mask`` while its forward runs (None outside it): a pre-hook and a hook
    on the root module, for the attention calls inside that forward (:func:`query_rows`). Shared by the Monitor's
    capture and QK-clip's reader."""

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


def _time_first(args: tuple, kwargs: dict, n: int) -> Inputs:
    """The module's inputs read as (T, B, E) (fairseq, nn.MultiheadAttention without batch_first)."""
    def swap(v):
        return v.transpose(0, 1) if isinstance(v, Tensor) and v.dim() == 3 else v

    return module_inputs(tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}, n)


class AttentionCapture:
    """Arms hooks for one forward, reduces each attention call to per-head statistics.

    model: the root module the Monitor watches; its forward's ``attention_mask`` tells which
    query rows are padding. None: only the kernels' masks tell.
    layouts: the book that decides the layers' layouts (the Monitor's); None: one of its own.
    entropy_rows: longer sequences have their entropy and sink share read from this many query rows spread
    through them (:func:`diag.math.attention.stats_from_logits`); None: every row.
    """

    def __init__(
        self, layers: list[AttentionLayer], n_seqs: int = 2, rank_rows: int = 256, model: nn.Module | None = None,
        layouts: LayoutBook | None = None, entropy_rows: int | None = ENTROPY_ROWS,
    ) -> None:
        self.layers = layers
        self.layouts = LayoutBook(layers) if layouts is None else layouts
        self.n_seqs = n_seqs
        self.rank_rows = rank_rows
        self.entropy_rows = entropy_rows
        self.model = model
        # layer indices whose statistics this capture computes (None: every layer); a layer whose layout is not yet
        # settled is captured whatever this holds, so that its first captured forward confirms or refuses it
        self.only: set[int] | None = None
        self.results: dict[int, AttentionStats] = {}
        self.problems: dict[int, str] = {}
        self.checked: dict[int, str] = {}  # layer index -> what the layout check compared
        self.notes: dict[int, str] = {}  # layer index -> what was measured but not verified, or not measured
        self._handles: list[RemovableHandle] = []
        self._active: AttentionLayer | None = None
        self._inputs: tuple[Inputs, Inputs] | None = None  # batch-first, time-first
        self._calls: dict[int, int] = {}  # attention calls per layer in the captured forward
        self._skipped: dict[int, str] = {}  # layers whose forward ran while armed, but not for training
        self._root = ModelMask()
        self._mode: _Mode | None = None
        self._pending_bytes = 0  # Grams of ranks not yet solved (diag.math.attention.solve_ranks)

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if self._handles:
            return
        self.results, self.problems, self.checked = {}, {}, {}
        self.notes, self._calls, self._skipped, self._pending_bytes = {}, {}, {}, 0
        if self.model is not None:  # the root's attention_mask, for the attention calls inside its forward only
            self._handles += self._root.register(self.model)
        for layer in self.layers:
            pre = layer.module.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True)
            post = layer.module.register_forward_hook(self._post_hook(layer), always_call=True)
            self._handles += [pre, post]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._root.mask = None
        self._exit_mode()

    def take(self) -> tuple[dict[int, AttentionStats], dict[int, str]]:
        """Results of the armed forward (then disarmed and cleared)."""
        self.disarm()
        for index, why in self._skipped.items():
            if index not in self.results and index not in self.problems:
                self.problems[index] = (f"its forward ran only {why} while the capture was armed; attention is read "
                                        "from a training forward (module.train(), grad enabled)")
        self._skipped = {}
        results, problems = self.results, self.problems
        self.results, self.problems, self._pending_bytes = {}, {}, 0
        try:  # every layer's ranks in as few eigensolver calls as their Grams allow
            solve_ranks(list(results.values()))
        except Exception as err:  # noqa: BLE001 - the other statistics are kept; the rank is NaN
            for index, stats in results.items():
                if stats.pending is not None:
                    stats.rank, stats.pending = torch.full_like(stats.entropy, torch.nan), None
                    problems.setdefault(index, f"attention rank failed: {err!r}")
        return results, problems

    def _pre_hook(self, layer: AttentionLayer):
        def hook(module, args, kwargs):
            done = layer.index in self.results or layer.index in self.problems
            if done or self._mode is not None:
                return
            if self.only is not None and layer.index not in self.only and self.layouts.settled(layer):
                return  # another process computes this layer's statistics
            if not module.training or not torch.is_grad_enabled():
                self._skipped.setdefault(layer.index, "in eval mode" if not module.training else "under no_grad")
                return
            impl = _attn_implementation(module)
            if impl not in (None, "eager", "sdpa"):
                self.problems[layer.index] = (
                    f"attention implementation {impl!r} is not measured (its kernel does not show q, k "
                    "or logits); build the model with attn_implementation='sdpa' or 'eager'"
                )
                return
            self._active = layer
            self._calls[layer.index] = 0
            self._inputs = (module_inputs(args, kwargs, self.n_seqs), _time_first(args, kwargs, self.n_seqs))
            # the key projection's input matters only until the layout is confirmed
            key_weight = None if self.layouts.settled(layer) else _key_weight(layer)
            self._mode = _Mode(self, key_weight)
            self._mode.__enter__()

        return hook

    def _post_hook(self, layer: AttentionLayer):
        def hook(module, args, output):
            if self._active is layer:
                self._exit_mode()
                calls = self._calls.get(layer.index, 0)
                if output is None:  # the forward raised: what it saw does not count
                    self.results.pop(layer.index, None)
                    self.problems.pop(layer.index, None)
                elif layer.index not in self.results and layer.index not in self.problems:
                    self.problems[layer.index] = "no attention call (SDPA, softmax or MHA) was seen"
                    self.layouts.unconfirmable_call(layer, "its forward made no attention call the capture reads "
                                                    "(SDPA, a softmax over 3-D to 5-D logits, MHA)")
                elif calls > 1:
                    self.notes[layer.index] = (
                        f"its forward made {calls} attention calls (SDPA, softmax or MHA); only the first is "
                        "measured, the others are not")

        return hook

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode, self._active, self._inputs = self._mode, None, None, None
            mode.__exit__(None, None, None)

    def _record(self, func, args: tuple, kwargs: dict, products: tuple[Product, ...]) -> None:
        layer = self._active
        if layer is None:
            return
        self._calls[layer.index] = self._calls.get(layer.index, 0) + 1
        if layer.index in self.results or layer.index in self.problems:
            return
        try:
            with torch.no_grad():
                seen = read_call(func, args, kwargs, self.n_seqs, layer.layout.n_heads, products)
                if seen is None:
                    return
                verdict = self.layouts.observe(layer, self._captured_call(seen), self.n_seqs)
                if verdict.problem is not None:
                    self.problems[layer.index] = verdict.problem
                    return
                self.checked[layer.index] = verdict.checked
                logits = seen.stats_logits()
                rows = self._query_rows(layer, seen, logits)
                stats = stats_from_logits(logits, self.rank_rows, rows, self.entropy_rows, solve=False)
                self.results[layer.index] = stats
                self._pending_bytes += stats.pending.grams.numel() * stats.pending.grams.element_size()
                if self._pending_bytes >= SOLVE_BYTES:  # the Grams held stay bounded: solve what is pending now
                    solve_ranks([s for s in self.results.values() if s.pending is not None])
                    self._pending_bytes = 0
                if seen.note is not None:
                    self.notes[layer.index] = seen.note
                elif verdict.checked == "shapes" and layer.layout.verify:
                    self.notes[layer.index] = (
                        "not verifiable: the kernel's q and k were seen, but not the module input they are projected "
                        "from (not the first positional argument nor hidden_states/x/query/input/query_input, or not "
                        "of the projections' width), so only shapes were checked against the layout")
        except Unsupported as err:
            self.problems[layer.index] = str(err)
            self.layouts.unconfirmable_call(layer, f"its attention call is one the capture does not read ({err})")
        except Exception as err:  # noqa: BLE001 - a fault here must never reach the forward pass
            self.problems[layer.index] = f"capture failed: {err!r}"

    def _captured_call(self, seen: Seen) -> CapturedCall:
        """What the capture saw of the call: the call, the module's inputs (batch-first, time-first), what the
        key projection read and the clamps the module made before it."""
        batch_first, time_first = self._inputs or (None, None)
        if self._mode is None:
            return CapturedCall(seen, batch_first, time_first, [])
        return CapturedCall(seen, batch_first, time_first, self._mode.key_inputs, self._mode.between)

    def _query_rows(self, layer: AttentionLayer, seen: Seen, logits) -> Tensor | None:
        """(n, Q) bool, False on padded query rows; None when every row counts (:func:`query_rows`)."""
        return query_rows(logits, seen, layer.cross, self._root.mask)
