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
Padded query rows do not count (:func:`hooks.capture.forwards.query_rows`, which QK-clip shares): they are read
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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diag.layouts.packings import packing_of
from diag.math.attention import SOLVE_BYTES, AttentionStats, solve_ranks, stats_from_logits
from hooks.capture.forwards import KERNELS, ArmedForwards, ForwardMode, attn_implementation, query_rows
from hooks.capture.kernels import Product, Seen, Unsupported, clamp_call, read_call
from hooks.layout.book import LayoutBook
from hooks.layout.confirm import CapturedCall, Elementwise, Inputs, module_inputs
from hooks.layout.discover import AttentionLayer

__all__ = ["AttentionCapture", "Seen"]


# Sequences with more query rows than this have their entropy and sink share read from this many rows spread
# through them (docs/metrics.md#attention-at-long-context); shorter ones from every row.
ENTROPY_ROWS = 1024

_KEY_CALLS = 4  # calls of the key projection remembered per module forward
_CLAMPS = 4  # distinct clamps remembered per module forward


class _Mode(ForwardMode):
    """Watches the calls of one attention module's forward (:class:`hooks.capture.forwards.ForwardMode`: the latest
    products and the attention calls) and what the layout book needs beside them.

    ``key_weight``: the key projection's own weight
    where it is a module of its own (``separate`` and ``q_kv`` packings), to keep what the
    ``F.linear`` calls with it read (``key_inputs``, the last few): keys computed from something other
    than the module's input (Twins', PVT's and SegFormer's keys come from a strided convolution of
    it) are then checked against what they were really projected from. ``between``: the clamps to constant
    bounds (``clamp``, ``clip``, ``hardtanh``) the forward made, which the layout book tries between the
    projections and the kernel (MPT's and OLMo's ``clip_qkv``). ``inputs``: the module's inputs read batch-first
    and time-first. The products kept are enough for DeBERTa, which makes two relative-position products after
    ``q @ k^T``.
    """

    def __init__(self, layer: AttentionLayer, on_call, inputs: tuple[Inputs, Inputs],
                 key_weight: Tensor | None = None) -> None:
        super().__init__(layer, on_call)
        self.inputs = inputs
        self.key_weight = key_weight
        self.key_inputs: list[Tensor] = []
        self.between: tuple[Elementwise, ...] = ()  # clamps to constant bounds seen in this forward

    def watch(self, func, args: tuple, kwargs: dict) -> None:
        clamp = clamp_call(func, args, kwargs)
        if clamp is not None and Elementwise(*clamp) not in self.between:
            self.between = self.between[-(_CLAMPS - 1):] + (Elementwise(*clamp),)
        if self.key_weight is not None and func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.key_weight and args and isinstance(args[0], Tensor):
                # references, dropped when the module's forward ends
                self.key_inputs = self.key_inputs[-(_KEY_CALLS - 1):] + [args[0]]


def _key_weight(layer: AttentionLayer) -> Tensor | None:
    """The key projection's weight where it is a parameter of its own (its packing says which: separate, q_kv)."""
    name = packing_of(layer.layout).key_weight(layer.layout)
    return None if name is None else dict(layer.module.named_parameters()).get(name)


def _time_first(args: tuple, kwargs: dict, n: int) -> Inputs:
    """The module's inputs read as (T, B, E) (fairseq, nn.MultiheadAttention without batch_first)."""
    def swap(v):
        return v.transpose(0, 1) if isinstance(v, Tensor) and v.dim() == 3 else v

    return module_inputs(tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}, n)


class AttentionCapture(ArmedForwards):
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
        super().__init__(layers, model)
        self.layouts = LayoutBook(layers) if layouts is None else layouts
        self.n_seqs = n_seqs
        self.rank_rows = rank_rows
        self.entropy_rows = entropy_rows
        # layer indices whose statistics this capture computes (None: every layer); a layer whose layout is not yet
        # settled is captured whatever this holds, so that its first captured forward confirms or refuses it
        self.only: set[int] | None = None
        self.results: dict[int, AttentionStats] = {}
        self.problems: dict[int, str] = {}
        self.checked: dict[int, str] = {}  # layer index -> what the layout check compared
        self.notes: dict[int, str] = {}  # layer index -> what was measured but not verified, or not measured
        self._calls: dict[int, int] = {}  # attention calls per layer in the captured forward
        self._skipped: dict[int, str] = {}  # layers whose forward ran while armed, but not for training
        self._pending_bytes = 0  # Grams of ranks not yet solved (diag.math.attention.solve_ranks)

    def _on_arm(self) -> None:
        self.results, self.problems, self.checked = {}, {}, {}
        self.notes, self._calls, self._skipped, self._pending_bytes = {}, {}, {}, 0

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

    def _start(self, layer: AttentionLayer, module: nn.Module, args: tuple, kwargs: dict) -> _Mode | None:
        if layer.index in self.results or layer.index in self.problems:
            return None
        if self.only is not None and layer.index not in self.only and self.layouts.settled(layer):
            return None  # another process computes this layer's statistics
        if not module.training or not torch.is_grad_enabled():
            self._skipped.setdefault(layer.index, "in eval mode" if not module.training else "under no_grad")
            return None
        impl = attn_implementation(module)
        if impl not in KERNELS:
            self.problems[layer.index] = (
                f"attention implementation {impl!r} is not measured (its kernel does not show q, k "
                "or logits); build the model with attn_implementation='sdpa' or 'eager'"
            )
            return None
        self._calls[layer.index] = 0
        inputs = (module_inputs(args, kwargs, self.n_seqs), _time_first(args, kwargs, self.n_seqs))
        # the key projection's input matters only until the layout is confirmed
        key_weight = None if self.layouts.settled(layer) else _key_weight(layer)
        return _Mode(layer, self._record, inputs, key_weight)

    def _end(self, layer: AttentionLayer, output: object) -> None:
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

    def _record(self, func, args: tuple, kwargs: dict, products: tuple[Product, ...]) -> None:
        if self._mode is None:
            return
        layer = self._mode.layer
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
        mode = self._mode
        if mode is None:
            return CapturedCall(seen, None, None, [])
        return CapturedCall(seen, *mode.inputs, mode.key_inputs, mode.between)

    def _query_rows(self, layer: AttentionLayer, seen: Seen, logits) -> Tensor | None:
        """(n, Q) bool, False on padded query rows; None when every row counts (:func:`query_rows`)."""
        return query_rows(logits, seen, layer.cross, self._root.mask)
