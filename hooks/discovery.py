"""Find the attention modules of a live model and their Q/K/V layouts."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from diag.errors import SpecError
from diag.layouts.adapters import ADAPTERS, HEAD_ATTRS, ModuleView, find_layout, resolve, with_sibling_o
from diag.layouts.vocab import QKVLayout, shape_problem
from diag.outputs.tags import layer_labels

__all__ = ["AttentionLayer", "discover", "module_view"]

_INT_ATTRS = HEAD_ATTRS + (  # module attributes of some families on top of the config names
    "attention_head_size",
    "key_value_proj_dim",
    "head_size",
    "d_kv",
)
_FLAG_ATTRS = ("is_cross_attention",)  # booleans, stored as 0/1


@dataclass
class AttentionLayer:
    """One monitored attention module."""

    index: int
    label: str  # e.g. "L03", used in every tag
    name: str  # module path in the model, e.g. "transformer.h.3.attn"
    module: nn.Module
    layout: QKVLayout
    o: nn.Parameter | None = field(default=None, repr=False)  # W_O (``layout.o``), found at discovery

    @property
    def cross(self) -> bool:
        return self.layout.cross

    def params(self) -> dict[str, nn.Parameter]:
        """The Q/K/V parameters that the layout names, by their names relative to the module."""
        named = dict(self.module.named_parameters())
        return {n: named[n] for n in self.layout.param_names}

    def weights(self) -> dict[str, nn.Parameter]:
        """:meth:`params` and W_O under ``layout.o`` where the layer has one (its update ratio is measured)."""
        named = self.params()
        if self.o is not None:
            named[self.layout.o] = self.o
        return named


def module_view(name: str, module: nn.Module) -> ModuleView:
    params = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    for child_name, child in module.named_children():
        for n, p in child.named_parameters(recurse=False):
            params[f"{child_name}.{n}"] = tuple(p.shape)
    attrs: dict[str, int] = {}
    for source in (getattr(module, "config", None), module):
        for key in _INT_ATTRS:
            value = getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs[key] = value
        for key in _FLAG_ATTRS:
            if isinstance(getattr(source, key, None), bool):
                attrs[key] = int(getattr(source, key))
    return ModuleView(name=name, cls=type(module).__name__, params=params, attrs=attrs)


def _spec_layout(name: str, spec: Mapping[str, QKVLayout]) -> QKVLayout | None:
    if not name:  # the root module is never an attention layer of its own
        return None
    for pattern, layout in spec.items():
        if fnmatch.fnmatchcase(name, pattern):
            return layout
    return None


def _check_params(name: str, module: nn.Module, layout: QKVLayout, o: nn.Parameter | None) -> None:
    params = dict(module.named_parameters())
    missing = [n for n in layout.param_names if n not in params]
    if layout.o is not None and o is None:
        missing.append(layout.o)
    if missing:
        raise SpecError(
            f"module {name!r} ({type(module).__name__}) has no parameter {missing[0]!r} named by "
            f"its layout; it has {sorted(params)[:8]}. Fix the spec's q=/k=/v=/o= names "
            "(o= may climb to the parent module with '../')."
        )
    shapes = {n: tuple(params[n].shape) for n in layout.param_names}
    if o is not None:
        shapes[layout.o] = tuple(o.shape)
    problem = shape_problem(layout, shapes)
    if problem:
        raise SpecError(f"module {name!r} ({type(module).__name__}): {problem}. Fix the spec's n_heads=, "
                        "head_dim=, n_kv_heads=, packing=, transposed= or o=")


def discover(model: nn.Module, spec: Mapping[str, QKVLayout] | None = None) -> list[AttentionLayer]:
    """Attention layers in registration order; an explicit ``spec`` overrides discovery.

    spec maps module-name patterns (fnmatch, e.g. ``"blocks.*.attn"``) to layouts;
    when given, only matching modules are monitored. Modules inside a found
    attention module are not searched again.
    """
    found: list[tuple[str, nn.Module, QKVLayout, nn.Parameter | None]] = []
    inside: tuple[str, ...] = ()
    every = dict(model.named_parameters(remove_duplicate=False))
    shapes = {n: tuple(p.shape) for n, p in every.items()}
    for name, module in model.named_modules():
        if inside and any(name.startswith(p + ".") for p in inside):
            continue
        layout = _spec_layout(name, spec) if spec else find_layout(module_view(name, module))
        if layout is None:
            continue
        if not spec:
            layout = with_sibling_o(name, layout, shapes)
        o = None if layout.o is None else every.get(resolve(name, layout.o))
        _check_params(name, module, layout, o)
        found.append((name, module, layout, o))
        inside += (name,)
    if not found:
        raise SpecError(_nothing_found(model, spec))
    labels = layer_labels([layout.cross for _, _, layout, _ in found])
    return [
        AttentionLayer(i, label, name, module, layout, o)
        for i, (label, (name, module, layout, o)) in enumerate(zip(labels, found))
    ]


def _nothing_found(model: nn.Module, spec: Mapping[str, QKVLayout] | None) -> str:
    if spec:
        return (
            f"no module of {type(model).__name__} matches the spec patterns {list(spec)}; "
            "patterns match module names as model.named_modules() prints them, e.g. 'blocks.*.attn'"
        )
    suspects = [
        (n, m)
        for n, m in model.named_modules()
        if n and any(w in n.lower() or w in type(m).__name__.lower() for w in ("attn", "attention"))
    ][:6]
    seen = "; ".join(_suspect(n, m) for n, m in suspects) or "none"
    tried = "; ".join(f"{a.name}: {a.describes}" for a in ADAPTERS)
    return (
        f"no attention layer recognised in {type(model).__name__}. Tried {tried}. "
        f"Attention-like modules seen: {seen}. Pass an explicit spec, e.g. "
        "Monitor(model, spec={'blocks.*.attn': QKVLayout(n_heads=8, head_dim=64, "
        "q='qkv.weight', packing='fused')})"
    )


def _suspect(name: str, module: nn.Module) -> str:
    """A suspect module, with the spec to pass when it holds one fused (3E, E) or (E, 3E) weight."""
    text = f"{name} ({type(module).__name__})"
    view = module_view(name, module)
    for param, shape in view.params.items():
        if len(shape) != 2 or 3 * min(shape) != max(shape):
            continue
        e, transposed = min(shape), shape[0] < shape[1]
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)
        extra = ", transposed=True" if transposed else ""
        return (
            f"{text} holds a fused weight {param!r} {shape}: pass spec={{{pattern!r}: QKVLayout(n_heads=H, "
            f"head_dim={e}//H, q={param!r}, packing='fused'{extra})}} if its rows are [all Q | all K | all V], "
            f"or packing='fused_per_head' if they are [Q_h | K_h | V_h] per head"
        )
    return text
