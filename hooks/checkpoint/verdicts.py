"""The probe forward that decides a module's Q/K/V layout from what the module computes.

A candidate layout is right when scaling its query head h by c_g and the key head g it pairs with by 1/c_g
leaves the module's output unchanged (the logits q_h . k_g are unchanged exactly when the split and the
pairing are the model's own, whatever the attention kernel, RoPE or ALiBi), while scaling the query heads
alone changes it (else the test says nothing: QK-norm). The scaled elements are found by splitting tensors
of element numbers with the candidate itself, so every packing is tested as the analysis will read it. Each
module gets the inputs it recorded in an unperturbed forward, so every module is tested on its own, all of
them in one forward per candidate. Used by :mod:`hooks.checkpoint.search`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from diag.errors import DiagError
from diag.layouts.biases import bias_names
from diag.layouts.vocab import QKVLayout, qkv_views, split_qkv, split_qkv_bias

__all__ = ["verdicts"]

# Relative change of a module's output (float64): unchanged below SAME; when scaling q alone moves it less
# than BLIND, q's scale does not reach the output (QK-norm) and the test cannot tell. SAME allows float32
# rounding: CodeGen computes its logits in float32 even in a float64 twin (the right layout there changes the
# output by 3-4e-8; a wrong one by 0.1 and more), so a tolerance of 1e-9 would refuse its right layout.
SAME, BLIND = 1e-6, 1e-3


def _ids(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[tuple[str, int, int]]]:
    """Tensors of the same shapes holding each element's number (one numbering across all of them)."""
    markers, spans, offset = {}, [], 0
    for name, t in tensors.items():
        markers[name] = torch.arange(offset, offset + t.numel(), dtype=torch.float64).view(t.shape)
        spans.append((name, offset, offset + t.numel()))
        offset += t.numel()
    return markers, spans


def _scales(layout: QKVLayout, params: dict[str, Tensor], with_k: bool, weights: bool = True) -> dict[str, Tensor]:
    """Per weight (and bias) of the layout, a factor per element: query head h's c_g, key head g's 1/c_g
    (g the key head h pairs with). Found by splitting tensors of element numbers with the layout itself,
    so every packing (fused, interleaved, transposed, 3-D) is handled as the analysis will read it.
    ``weights=False``: the biases only."""
    h, g = layout.n_heads, layout.kv_heads
    q_factor, k_factor = _factors(layout)
    tensors_w = {n: params[n] for n in layout.param_names} if weights else {}
    biases = {n: params[b] for n in layout.param_names for b in bias_names(n) if b in params}
    out: dict[str, Tensor] = {}
    for tensors, split in ((tensors_w, split_qkv), (biases, split_qkv_bias)):
        if not tensors:
            continue
        markers, spans = _ids(tensors)
        q_ids, k_ids = split(markers, layout)[:2]
        scale = torch.ones(spans[-1][2], dtype=torch.float64)
        if q_ids is not None:
            scale[q_ids.reshape(h, -1).long()] *= q_factor[:, None]
        if with_k and k_ids is not None:
            scale[k_ids.reshape(g, -1).long()] *= k_factor[:, None]
        for name, a, b in spans:
            target = name if tensors is tensors_w else next(x for x in bias_names(name) if x in params)
            out[target] = scale[a:b].view(tensors[name].shape)
    return out


def _applies(module: nn.Module, layout: QKVLayout) -> bool:
    """Whether the layout can split the module's tensors at all (a bias of another length, a shape that does
    not divide): a candidate that cannot is no candidate."""
    params = dict(module.named_parameters())
    try:  # the weights split as meta tensors (no memory: a 70B model's query weight is 0.5 GB), the biases really
        q, k, _ = split_qkv({n: torch.empty(params[n].shape, device="meta") for n in layout.param_names}, layout)
        q.reshape(layout.n_heads, -1), k.reshape(layout.kv_heads, -1)
        _scales(layout, params, True, weights=False)
    except (RuntimeError, ValueError, IndexError, KeyError, DiagError):
        return False
    return True


def _factors(layout: QKVLayout) -> tuple[Tensor, Tensor]:
    """Query head h's factor c_g and key head g's 1/c_g (g the key head h pairs with): :func:`_scales`'s."""
    c = torch.linspace(1.7, 0.4, layout.kv_heads, dtype=torch.float64)  # (G,)
    return c[torch.tensor(layout.kv_index)], 1.0 / c


def _views(layout: QKVLayout, params: dict[str, Tensor]) -> tuple[Tensor, Tensor] | None:
    """Q and K as views of the module's own weights ((H, D, E) or (groups, heads per group, D, E)), or None
    where a packing gives a copy."""
    q, k, _ = qkv_views({n: params[n].data for n in layout.param_names}, layout)
    stores = {params[n].untyped_storage().data_ptr() for n in layout.param_names}
    if any(t.untyped_storage().data_ptr() not in stores for t in (q, k)):
        return None
    return q, k


def _scale_views(views: tuple[Tensor, Tensor], layout: QKVLayout, with_k: bool, undo: bool) -> None:
    """Scale Q's heads (and K's) in place; ``undo`` divides back (within one rounding of the weights: the test
    compares outputs to 1e-6, and nothing of the twin's weights outlives the probe)."""
    q_factor, k_factor = _factors(layout)
    for view, factor in ((views[0], q_factor), (views[1], k_factor)) if with_k else ((views[0], q_factor),):
        factor = factor.to(view.dtype).reshape(*view.shape[:-2], 1, 1)
        view.div_(factor) if undo else view.mul_(factor)


@contextmanager
def _scaled(module: nn.Module, layout: QKVLayout, with_k: bool) -> Iterator[None]:
    """The module's query (and key) heads scaled as :func:`_scales` says, biases alike; restored after.

    The weights are scaled in place through views of them (no copy of a weight: at a 70B model's width one
    query projection is 0.5 GB in float64); a packing whose split is a copy, and the biases, go through
    :func:`_scales` with saved copies."""
    params = dict(module.named_parameters())
    views = _views(layout, params)
    saved, scaled = {}, False
    try:
        with torch.no_grad():
            for name, s in _scales(layout, params, with_k, weights=views is None).items():
                saved[name] = params[name].detach().clone()
                params[name].mul_(s.to(params[name].dtype))
            if views is not None:
                _scale_views(views, layout, with_k, undo=False)
                scaled = True
        yield
    finally:
        with torch.no_grad():
            for n, value in saved.items():
                params[n].copy_(value)
            if scaled:
                _scale_views(views, layout, with_k, undo=True)


def _first_tensor(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    for item in output if isinstance(output, (tuple, list)) else getattr(output, "values", lambda: [])():
        if isinstance(item, Tensor):
            return item
    return None


class _Replay:
    """Forward hooks on the candidate modules: record each call's inputs and output, then replay the inputs."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.inputs: dict[str, list] = {n: [] for n in modules}
        self.outputs: dict[str, list] = {n: [] for n in modules}
        self.replay = False
        self._calls: dict[str, int] = {}
        self._handles = []
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            i = self._calls[name] = self._calls.get(name, -1) + 1
            if not self.replay:
                self.inputs[name].append(torch.utils._pytree.tree_map(
                    lambda t: t.clone() if isinstance(t, Tensor) else t, (args, kwargs)))
                return None
            return self.inputs[name][i] if i < len(self.inputs[name]) else None
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            out = _first_tensor(output)
            self.outputs[name].append(None if out is None else out.detach().clone())
        return hook

    def run(self, model: nn.Module, batch: dict[str, Tensor]) -> dict[str, list]:
        self._calls = {}
        self.outputs = {n: [] for n in self.outputs}
        with torch.no_grad():
            try:
                model(**batch, use_cache=False)  # a cache would carry keys from one forward to the next
            except TypeError:
                model(**batch)
        self.replay = True
        return self.outputs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _change(got: list, base: list) -> float:
    """Largest relative change of a module's outputs against the unperturbed forward's."""
    worst = 0.0
    for a, b in zip(got, base):
        if a is None or b is None or a.shape != b.shape:
            return float("inf")
        change = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
        worst = max(worst, change if math.isfinite(change) else float("inf"))  # NaN: max() would drop it
    return worst if len(got) == len(base) and got else float("inf")


def verdicts(twin: nn.Module, batch: dict[str, Tensor], cands: dict[str, list[QKVLayout]]
              ) -> tuple[dict[str, QKVLayout], set[str]]:
    """Per module: the first candidate the probe forward confirms; and the modules it cannot check."""
    modules = dict(twin.named_modules())
    replay = _Replay({n: modules[n] for n in cands})
    try:
        base = replay.run(twin, batch)
        found: dict[str, QKVLayout] = {}
        uncheckable: set[str] = set()
        tried = dict.fromkeys(cands, 0)  # per module, how many of its candidates have been tested
        while True:
            now = {n: cands[n][i] for n, i in tried.items() if i < len(cands[n]) and n not in found}
            if not now:
                break
            # a module inside another one tested now waits: the outer one's output would mix both tests
            now = {n: lay for n, lay in now.items() if not any(n.startswith(m + ".") for m in now)}
            for n in now:
                tried[n] += 1
            now = {n: lay for n, lay in now.items() if _applies(modules[n], lay)}
            if not now:
                continue
            changes = []
            for with_k in (True, False):
                with _all_scaled(modules, now, with_k):
                    changes.append(replay.run(twin, batch))
            for n, lay in now.items():
                if not base[n]:  # not called by the probe forward (e.g. cross-attention without an encoder)
                    uncheckable.add(n)
                    continue
                same, moved = _change(changes[0][n], base[n]), _change(changes[1][n], base[n])
                if moved < BLIND:
                    uncheckable.add(n)  # scaling q alone hardly changes anything: normalised q/k, the test is blind
                elif same <= SAME:
                    found[n] = lay
                    uncheckable.discard(n)
        return found, uncheckable
    finally:
        replay.remove()


@contextmanager
def _all_scaled(modules: dict[str, nn.Module], layouts: dict[str, QKVLayout], with_k: bool) -> Iterator[None]:
    with ExitStack() as stack:
        for name, layout in layouts.items():
            stack.enter_context(_scaled(modules[name], layout, with_k))
        yield


