"""The refusal when discovery finds no attention layer: which modules really compute attention, what they
hold, and concrete specs with the numbers read from them.

A module is a suspect when its own ``forward`` calls an attention kernel (its source names
``scaled_dot_product_attention``, ``softmax``, ``einsum``, ``bmm``, ``baddbmm``, ``multi_head_attention_forward``
or a flash-attention function) or when it holds an ``nn.Softmax`` child: what the code does, not what the
module is called. Specs are offered only with numbers the module holds (its head count attribute, its weights'
shapes: the specs the shapes imply, one per packing that reads them); where the packing cannot be read from
names and shapes, every candidate is offered and the first captured forward checks the one passed against the
kernel's q and k (a wrong one is refused, never logged). Never a generic example.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from diag.layouts.generic import ModuleView, head_count
from diag.layouts.packings import PACKINGS
from diag.layouts.patterns import generalise, patterns_for, spec_text
from diag.layouts.vocab import QKVLayout, implied_layouts

__all__ = ["calls_attention", "suspects_text", "implied_specs", "computation_candidates"]

KERNEL_WORDS = ("scaled_dot_product_attention", "softmax", "einsum", "bmm", "multi_head_attention_forward",
                "flash_attn")
_SOURCE: dict[type, bool] = {}


def calls_attention(module: nn.Module) -> bool:
    """Whether the module's own forward calls an attention kernel (by its source), or holds an nn.Softmax."""
    cls = type(module)
    if cls not in _SOURCE:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        ours = not cls.__module__.startswith("torch.")  # torch's own layers: nn.Softmax etc. are not attention
        _SOURCE[cls] = ours and any(word in source for word in KERNEL_WORDS)
    return _SOURCE[cls] or any(isinstance(child, nn.Softmax) for child in module.children())


def _weights(view: ModuleView) -> str:
    shown = [f"{n} {s}" for n, s in view.params.items() if len(s) >= 2][:6]
    return ", ".join(shown) or "no weight matrices"


def implied_specs(view: ModuleView) -> list[QKVLayout]:
    """The layouts the module's weight shapes imply, one per packing that reads them (with its head count
    attribute where the shapes do not give it): a fused weight as [all Q | all K | all V] or per head, three
    weights, three 3-D per-head weights."""
    return implied_layouts(view.params, head_count(view))


def computation_candidates(model: nn.Module, view_of: Callable[[str, nn.Module], ModuleView]
                           ) -> list[tuple[str, nn.Module, QKVLayout]]:
    """Where names find no attention layer: the modules whose own forward calls an attention kernel (the
    deepest such, never the root) that hold a weight matrix, each with a first proposal from its shapes (the
    layout they imply, else one head over a fused or three-weight packing: the kernel's shapes give the count).
    ``adapter="computation"``: only the first captured forward confirms it, or reads the layout from the
    kernel's q and k; nothing else is trusted."""
    found = [(name, module) for name, module in model.named_modules()
             if name and calls_attention(module) and any(p.dim() >= 2 for p in module.parameters())]
    out = []
    for name, module in found:
        if any(other.startswith(name + ".") for other, _ in found):
            continue  # an attention module further down holds the computation
        view = view_of(name, module)
        layouts = implied_specs(view) or implied_layouts(view.params, 1)
        if layouts:
            out.append((name, module, replace(layouts[0], adapter="computation")))
    return out


def suspects_text(model: nn.Module, view_of: Callable[[str, nn.Module], ModuleView], limit: int = 6) -> str:
    """What the refusal says about the modules that call attention (at most ``limit`` kinds)."""
    kinds: dict[str, list[str]] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name and calls_attention(module):
            kinds.setdefault(generalise(name), []).append(name)
    if not kinds:
        return ("no module's forward calls an attention kernel (SDPA, softmax, einsum, bmm, "
                "multi_head_attention_forward)")
    parts = []
    for names in list(kinds.values())[:limit]:
        module = modules[names[0]]
        view = view_of(names[0], module)
        heads = head_count(view)
        like = f" and {len(names) - 1} like it" if len(names) > 1 else ""
        text = (f"{names[0]} ({type(module).__name__}){like} calls attention; it holds "
                f"{_weights(view)}; head count attribute: {heads if heads else 'none'}")
        specs = implied_specs(view)
        if specs:
            keys = patterns_for(names, modules)
            options = " or ".join(f"Monitor(model, {spec_text(dict.fromkeys(keys, s))})" for s in specs)
            text += (f". Its weights' shapes imply ({'; '.join(PACKINGS[s.packing].doc for s in specs)}): pass "
                     f"{options}; the first captured forward checks it against the kernel's q and k")
        else:
            text += ". Its weights' shapes imply no packing of the vocabulary without a head count"
        parts.append(text)
    return "; ".join(parts)
