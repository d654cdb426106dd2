"""Find the attention modules of a live model and their Q/K/V layouts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch import Tensor, nn

from diag.catalog.tags import layer_labels
from diag.errors import SpecError
from diag.layouts.adapters import ADAPTERS, HEAD_ATTRS, ModuleView, find_layout, is_cross, resolve, with_sibling_o
from diag.layouts.generic import generic_o, head_count, is_provisional
from diag.layouts.patterns import first_match, generalise, matches, patterns_for
from diag.layouts.vocab import QKVLayout, shape_problem
from hooks.layout.record import LayoutRecord
from hooks.layout.suspects import computation_candidates, suspects_text
from hooks.parallel.dtensors import fsdp_managed, local_tensor
from hooks.parallel.heads import HeadBlock, head_block

__all__ = ["AttentionLayer", "discover", "module_view"]

_INT_ATTRS = HEAD_ATTRS + (  # module attributes of some families on top of the config names
    "attention_head_size",
    "key_value_proj_dim",
    "head_size",
    "d_kv",
)
_FLAG_ATTRS = ("is_cross_attention", "multi_query")  # booleans, stored as 0/1
_DEPTH = 3  # a view holds parameters up to this many module levels below the module
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


@dataclass
class AttentionLayer:
    """One monitored attention module. Its layout and W_O are its :class:`LayoutRecord`'s, which discovery
    writes first and only :class:`hooks.layout.book.LayoutBook` changes."""

    index: int
    label: str  # e.g. "L03", used in every tag
    name: str  # module path in the model, e.g. "transformer.h.3.attn"
    module: nn.Module
    record: LayoutRecord
    # spec patterns that select this module and its like (its siblings in other blocks) and no other
    # module: one pattern, or the exact names when ``*`` would also take feed-forward children (messages)
    patterns: tuple[str, ...] = ()
    # under tensor parallelism: the contiguous block of heads this rank holds (hooks/parallel/heads.py)
    block: HeadBlock | None = None

    def __post_init__(self) -> None:
        self.patterns = self.patterns or (generalise(self.name),)

    def on_this_rank(self) -> AttentionLayer:
        """The layer as this rank's attention kernel computes it: under tensor parallelism, with the layout of
        its block of heads (what the capture checks the kernel against); else the layer itself."""
        if self.block is None:
            return self
        return replace(self, record=LayoutRecord(self.block.layout, self.o, self.record.state), block=None)

    def local_parameters(self) -> dict[str, Tensor]:
        """The module's parameters as this rank holds them (a DTensor's local shard), by their relative names."""
        return {n: local_tensor(p) for n, p in self.module.named_parameters()}

    @property
    def layout(self) -> QKVLayout:
        return self.record.layout

    @property
    def o(self) -> nn.Parameter | None:
        """W_O (``layout.o``), found at discovery."""
        return self.record.o

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
    for sub_name, sub in module.named_modules():
        if sub_name and sub_name.count(".") < _DEPTH:
            for n, p in sub.named_parameters(recurse=False):
                params[f"{sub_name}.{n}"] = tuple(p.shape)
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


def _owner(module: nn.Module, layout: QKVLayout) -> str:
    """Which module a generic layout's projections belong to, relative to ``module`` ("" = itself).

    The deepest module above all the projections that is not a container (``ModuleList``,
    ``ModuleDict``, ``Sequential``) and holds an output projection or a head count; else the deepest
    non-container. So a block holding ``attn.qkv`` leaves it to ``attn``, and ``attn`` keeps projections
    nested in a helper module ``attn.proj.q``."""
    parents = []
    for name in layout.param_names:
        parts = name.split(".")
        parents.append(parts[:-2] if parts[-1] == "weight" else parts[:-1])  # the projection's parent
    common: list[str] = []
    for level in zip(*parents):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    chain = [".".join(common[:i]) for i in range(len(common), -1, -1)]  # deepest first
    fallback = None
    for path in chain:
        sub = module.get_submodule(path) if path else module
        if isinstance(sub, _CONTAINERS):
            continue
        fallback = path if fallback is None else fallback
        view = module_view(path, sub)
        if head_count(view) or generic_o(view, _relative(layout, path)).o is not None:
            return path
    return "" if fallback is None else fallback


def _relative(layout: QKVLayout, path: str) -> QKVLayout:
    """The layout as seen from the submodule ``path`` (its names with the prefix removed)."""
    if not path:
        return layout
    cut = len(path) + 1
    names = {n: getattr(layout, n) for n in ("q", "k", "v")}
    return QKVLayout(**{**layout.to_dict(), **{n: v[cut:] for n, v in names.items() if v is not None}, "o": None})


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


def discover(model: nn.Module, spec: Mapping[str, QKVLayout] | None = None,
             computation: bool = False) -> list[AttentionLayer]:
    """Attention layers in registration order; an explicit ``spec`` overrides discovery.

    spec maps module-name patterns (fnmatch, e.g. ``"blocks.*.attn"``) to layouts;
    when given, only matching modules are monitored. Modules inside a found
    attention module are not searched again.
    computation: where names find no attention layer at all, take the modules whose forward computes
    attention, with a proposal only a captured forward confirms (for a caller that captures one).
    """
    found: list[tuple[str, nn.Module, QKVLayout, nn.Parameter | None]] = []
    inside: tuple[str, ...] = ()
    every = dict(model.named_parameters(remove_duplicate=False))
    shapes = {n: tuple(p.shape) for n, p in every.items()}
    for name, module in model.named_modules():
        if inside and any(name.startswith(p + ".") for p in inside):
            continue
        layout = first_match(name, spec) if spec else _discovered(name, module)
        if layout is None:
            continue
        if not spec:
            layout = with_sibling_o(name, layout, shapes)
        o = None if layout.o is None else every.get(resolve(name, layout.o))
        _check_params(name, module, layout, o)
        found.append((name, module, layout, o))
        inside += (name,)
    if not found and computation and not spec:
        for name, module, layout in computation_candidates(model, module_view):
            layout = generic_o(module_view(name, module), layout)
            found.append((name, module, layout, None if layout.o is None else every.get(resolve(name, layout.o))))
    if not found:
        raise SpecError(_nothing_found(model, spec))
    labels = layer_labels([layout.cross for _, _, layout, _ in found])
    names = [name for name, _, _, _ in found]
    patterns = patterns_for(names, (n for n, _ in model.named_modules()))
    fsdp = fsdp_managed(model)
    return [
        AttentionLayer(i, label, name, module, _first_record(layout, o), _kin(name, names, patterns),
                       _block(name, module, layout, o, fsdp))
        for i, (label, (name, module, layout, o)) in enumerate(zip(labels, found))
    ]


def _first_record(layout: QKVLayout, o: nn.Parameter | None) -> LayoutRecord:
    """A spec's or a named family's layout is given; a generic adapter's only proposed."""
    return LayoutRecord(layout, o, "proposed" if is_provisional(layout) else "given")


def _block(name: str, module: nn.Module, layout: QKVLayout, o: nn.Parameter | None,
           fsdp: frozenset[str]) -> HeadBlock | None:
    """This rank's heads under tensor parallelism (None without it); FSDP2 shards parameters of modules below
    an ``FSDPModule`` (the root's name is "")."""
    weights = {n: p for n, p in module.named_parameters() if n in layout.param_names}
    if o is not None:
        weights[layout.o] = o
    under = any(f == "" or name == f or name.startswith(f + ".") for f in fsdp)
    return head_block(name, layout, weights, under)


def _kin(name: str, names: list[str], patterns: list[str]) -> tuple[str, ...]:
    """The patterns that select ``name`` and the modules like it (the same name up to block indices)."""
    mine = next((p for p in patterns if matches(name, p)), name)  # the root module: no pattern selects it
    if mine != name:
        return (mine,)
    return tuple(n for n in names if generalise(n) == generalise(name))


def _discovered(name: str, module: nn.Module) -> QKVLayout | None:
    view = module_view(name, module)
    layout = find_layout(view)
    if layout is None or not is_provisional(layout):
        return layout
    if _owner(module, layout):  # the projections belong to a module further down
        return None
    return replace(layout, cross=is_cross(view))


def _nothing_found(model: nn.Module, spec: Mapping[str, QKVLayout] | None) -> str:
    if spec:
        return (
            f"no module of {type(model).__name__} matches the spec patterns {list(spec)}; "
            "patterns match module names as model.named_modules() prints them, e.g. 'blocks.*.attn'"
        )
    tried = "; ".join(f"{a.name}: {a.describes}" for a in ADAPTERS)
    return (
        f"no attention layer recognised in {type(model).__name__}. Tried {tried}. "
        f"Modules whose forward computes attention: {suspects_text(model, module_view)}. With attention among "
        "the signals, such a module is read from its first captured forward; otherwise pass Monitor(model, "
        "spec=...) mapping its name pattern to QKVLayout(n_heads, head_dim, q, k, v, packing, ...) naming its "
        "weights (docs/layouts.md#explicit-spec)"
    )
