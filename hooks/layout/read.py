"""Read an attention module's layout from what it computed (see :mod:`diag.layouts.infer` for the method).

At the first captured forward the capture holds the module input x and the q and k its attention kernel
received. Every weight of the module that can take x (2-D with an axis of size E, either orientation; 3-D
per head (H, D, E) or (H, E, D)) projects x, the projection is cut into heads of the kernel's head size, and
each kernel head is matched with the one block (optionally passed through one of the module's norm-like
children: QK-norm under any name, or through a clamp the forward made) whose per-position Gram across
sequences it reproduces. The blocks give the layout, which :class:`hooks.layout.book.LayoutBook` adopts or
refuses.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from diag.layouts.biases import bias_names
from diag.layouts.infer import Block, layout_from_blocks, match_heads, profiles, query_source
from diag.layouts.vocab import QKVLayout
from hooks.layout.confirm import Elementwise, tolerance

__all__ = ["Reading", "read_layout"]

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


class _L2Norm(nn.Module):
    """A parameterless QK-norm (``F.normalize``; an RMS norm has the same direction): q / ||q|| per head."""

    def forward(self, z: Tensor) -> Tensor:
        return torch.nn.functional.normalize(z, dim=-1)


_L2 = _L2Norm()


def _norm_children(module: nn.Module, d: int) -> list[tuple[str, nn.Module]]:
    """Leaf descendants that may normalise a head: torch's norms over ``d`` features, or any leaf module
    whose parameters are all vectors of length ``d`` (a custom RMSNorm under any name). A module with buffers
    is left out: calling a BatchNorm in training mode would update its running statistics, and the capture
    must not change the model. They are called through ``forward`` (no hooks of theirs run)."""
    out = []
    for name, sub in module.named_modules():
        if not name or any(True for _ in sub.children()) or isinstance(sub, nn.Linear):
            continue
        if any(True for _ in sub.buffers(recurse=False)):
            continue
        params = list(sub.parameters(recurse=False))
        shaped = getattr(sub, "normalized_shape", None)
        torch_norm = isinstance(sub, _NORMS) and tuple(shaped or ()) == (d,)
        if torch_norm or (params and all(p.dim() == 1 and p.shape[0] == d for p in params)):
            out.append((name, sub))
    return out


def _orientations(shape: tuple[int, ...], e: int, d: int) -> list[str]:
    if len(shape) == 2:
        rows = ["rows"] if shape[1] == e and shape[0] % d == 0 else []
        return rows + (["cols"] if shape[0] == e and shape[1] % d == 0 else [])
    if len(shape) == 3:
        return [o for o, ok in (("heads", shape[1:] == (d, e)), ("heads_t", shape[1:] == (e, d))) if ok]
    return []


def _project(x: Tensor, w: Tensor, b: Tensor | None, orient: str, d: int) -> Tensor:
    """Blocks (n, heads, T, d) of x projected with w read in ``orient``."""
    w, x = w.detach().double(), x.double()
    if orient in ("heads", "heads_t"):
        w = w if orient == "heads" else w.transpose(1, 2)  # (H, D, E)
        y = torch.einsum("nte,hde->nhtd", x, w)
        return y if b is None or b.shape != w.shape[:2] else y + b.detach().double()[None, :, None, :]  # b (H, D)
    rows = w if orient == "rows" else w.T  # (R, E)
    y = x @ rows.T + (0 if b is None or b.shape != rows.shape[:1] else b.detach().double())
    return y.unflatten(-1, (-1, d)).transpose(1, 2)


def _blocks(module: nn.Module, x: Tensor, d: int, norms: list) -> tuple[list[Block], Tensor]:
    """Every candidate block's profile (C, F), with its Block."""
    params = dict(module.named_parameters())
    blocks, profs = [], []
    for name, w in params.items():
        bias = next((params[b] for b in bias_names(name) if b in params), None)
        for orient in _orientations(tuple(w.shape), x.shape[-1], d):
            z = _project(x, w, bias, orient, d)
            for label, norm in [("", None), ("l2", _L2)] + norms:
                try:
                    with torch.no_grad():
                        zt = z if norm is None else norm.forward(z.to(w.dtype)).double()
                except Exception:  # noqa: BLE001 - a child that is no norm over d features
                    continue
                if zt.shape != z.shape:
                    continue
                profs.append(profiles(zt))
                blocks += [Block(name, orient, i, label) for i in range(z.shape[1])]
    return blocks, (torch.cat(profs) if profs else torch.zeros(0, 0, dtype=torch.float64))


def _assign(kernel: Tensor, blocks: list[Block], profs: Tensor, tol: float) -> tuple[list[Block] | None, str]:
    """The one block (first transform that fits) each kernel head came from, or None and why."""
    out = []
    for head, hits in enumerate(match_heads(profiles(kernel), profs, tol)):
        distinct = {(blocks[i].name, blocks[i].orient, blocks[i].block): blocks[i] for i in hits}
        if len(distinct) != 1:
            return None, f"head {head}: {len(distinct)} projection blocks fit"
        out.append(next(iter(distinct.values())))
    return out, ""


def _value(module: nn.Module, q: Block, k: Block) -> str | None:
    """The value weight beside separate Q and K weights: same shape as K, the name closest to K's."""
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    others = [n for n, s in shapes.items() if s == shapes[k.name] and n not in (q.name, k.name)]
    if not others:
        return None
    return max(others, key=lambda n: difflib.SequenceMatcher(None, n, k.name).ratio())


class Reading(NamedTuple):
    """The layout read (None: none reproduces the kernel), a sentence on what was observed, and what the
    blocks went through between projection and kernel (a norm child's name, ``l2``, a clamp)."""

    layout: QKVLayout | None
    observed: str
    through: tuple[str, ...] = ()


def read_layout(module: nn.Module, q: Tensor, k: Tensor, x: Tensor, kv: Tensor | None, cross: bool,
                between: Sequence[Elementwise] = ()) -> Reading:
    """The layout that reproduces the kernel's q (n, H, T, D) and k (n, G', S, D) from x (n, T, E) (and,
    for cross-attention, kv (n, S, E)); ``between``: elementwise calls the module made (clamps), tried on the
    projected blocks like its norms."""
    n, h, _, d = q.shape
    src = kv if (cross or k.shape[2] != x.shape[1]) and kv is not None else x
    x = query_source(x, q, k, cross) if src is x else x  # class-token queries: the first tokens of x
    if x.shape[:2] != (n, q.shape[2]) or src.shape[1] != k.shape[2]:
        return Reading(None, f"kernel q {tuple(q.shape)}, k {tuple(k.shape)}; module input {tuple(x.shape)} is not "
                       "their source")
    norms = _norm_children(module, d) + [(op.describe(), op) for op in between]
    tol = tolerance(q)
    seen = f"kernel q {tuple(q.shape)}, k {tuple(k.shape)} (n, heads, tokens, head size), input {tuple(x.shape)}"
    # the input as it arrives, then through each norm of the module over its width (a norm inside the module,
    # before the projections: timm's TinyViT)
    pre = [("", None)] + (_norm_children(module, x.shape[-1]) if x.shape[-1] != d else [])
    for name, norm in pre:
        try:
            with torch.no_grad():
                xin, sin = (x[:n], src[:n]) if norm is None else (norm.forward(x[:n]), norm.forward(src[:n]))
        except Exception:  # noqa: BLE001 - a child that is no norm over the input's width
            continue
        q_blocks, why_q = _assign(q, *_blocks(module, xin, d, norms), tol)
        k_blocks, why_k = _assign(k, *_blocks(module, sin, d, norms), tol)
        if q_blocks is not None and k_blocks is not None:
            seen += f" through its {name!r} before the projections" if name else ""
            break
    if q_blocks is None or k_blocks is None:
        return Reading(None, f"{seen}; no weight of the module reproduces them ({why_q or why_k})")
    g = k.shape[1]
    kv_of_query = list(range(h)) if g == h else [i // (h // g) for i in range(h)]
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    value = _value(module, q_blocks[0], k_blocks[0]) if q_blocks[0].name != k_blocks[0].name else None
    layout = layout_from_blocks(q_blocks, k_blocks, kv_of_query, shapes, d, value)
    used = sorted({b.transform for b in q_blocks + k_blocks} - {""})
    seen += f"; q from {q_blocks[0].name!r}, k from {k_blocks[0].name!r}" + (f" through {used}" if used else "")
    if layout is None:
        return Reading(None, f"{seen}; no packing of the vocabulary gives those blocks in that order", tuple(used))
    return Reading(layout if not cross else QKVLayout.from_dict({**layout.to_dict(), "cross": True}), seen,
                   tuple(used))
