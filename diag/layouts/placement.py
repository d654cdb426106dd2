"""An explicit layout (a layout file, the run's own, or the model's) placed on a state dict's keys.

Entries name module paths or ``fnmatch`` patterns relative to the model the layout was made for; the state
dict may hold that model under a wrapper's prefix (``model.``, ``net.``) or without one it had. Placed
modules are checked against the tensors' shapes and numbered like :func:`diag.layouts.statedict.find_layers`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from diag.catalog.tags import layer_labels
from diag.errors import SpecError
from diag.layouts.adapters import resolve
from diag.layouts.statedict import StateDictLayer, canonical_key, qkv_suspects
from diag.layouts.vocab import QKVLayout, shape_problem

__all__ = ["SpecEntry", "layers_from_spec"]

SpecEntry = tuple[str, QKVLayout, "str | None"]  # (module path or fnmatch pattern, layout, tag label or None)


def _modules(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Every module path of the keys (``a.b.c.weight`` -> ``a``, ``a.b``, ``a.b.c``), in order of appearance."""
    found: dict[str, None] = {}
    for key in shapes:
        parts = key.split(".")
        for depth in range(1, len(parts)):
            found.setdefault(".".join(parts[:depth]))
    return list(found)


def _match(modules: list[str], pattern: str, prefix: str, strip: int) -> list[str]:
    """Modules that match ``pattern`` minus its first ``strip`` components, below ``prefix``."""
    parts = pattern.split(".")
    if strip >= len(parts):
        return []
    tail = ".".join(parts[strip:])
    return [m for m in modules if m.startswith(prefix) and fnmatch.fnmatchcase(m[len(prefix):], tail)]


def _prefixes(modules: list[str]) -> list[str]:
    """"" first, then the one- and two-component prefixes of the state dict's keys (a wrapper's ``model.``)."""
    found = dict.fromkeys([""])
    for m in modules:
        parts = m.split(".")
        for depth in (1, 2):
            if len(parts) > depth:
                found.setdefault(".".join(parts[:depth]) + ".")
    return list(found)


Shapes = Mapping[str, tuple[int, ...]]


def _placed(shapes: Shapes, spec: Sequence[SpecEntry]) -> list[SpecEntry]:
    """Every (module, layout, label) the spec names, under the first prefix where each entry finds a module
    holding its weights: the state dict may hold the model under a wrapper's prefix (``model.``), or without
    the one it had. A pattern matches like the Monitor's spec (``*`` crosses dots); modules inside a placed
    one are not attention layers of their own."""
    modules = _modules(shapes)
    for strip in (0, 1, 2):
        for prefix in _prefixes(modules):
            per_entry = [[(m, layout, label) for m in _match(modules, pattern, prefix, strip)
                          if all(resolve(m, n) in shapes for n in layout.weight_names)]
                         for pattern, layout, label in spec]
            if all(per_entry):
                placed: list[SpecEntry] = []
                for item in sorted((i for e in per_entry for i in e), key=lambda i: i[0].count(".")):
                    if not any(item[0] == p[0] or item[0].startswith(p[0] + ".") for p in placed):
                        placed.append(item)
                return placed
    return []


SPEC_FIX = "fix the layout file, or pass the right one with --layout FILE"


def layers_from_spec(shapes: Shapes, spec: Sequence[SpecEntry], source: str,
                     fix: str = SPEC_FIX) -> list[StateDictLayer]:
    """The layers an explicit layout names, checked against the tensors' shapes, in canonical order."""
    placed = _placed(shapes, spec)
    if not placed:
        patterns = [p for p, _, _ in spec][:4]
        names = [p + "." + lay.q for p, lay, _ in spec][:2]
        seen = qkv_suspects(shapes)[:4] or _modules(shapes)[:6]
        raise SpecError(f"the layout of {source} names modules {patterns} whose weights ({names}, ...) are not "
                        f"all in this checkpoint, which holds {seen}. The layout belongs to another model: pass "
                        "--layout FILE with this checkpoint's module paths (docs/analyze.md#layout-files)")
    for name, layout, _ in placed:
        problem = shape_problem(layout, {n: shapes[resolve(name, n)] for n in layout.weight_names})
        if problem:
            raise SpecError(f"{name}: the layout of {source} does not fit the checkpoint: {problem}; {fix}")
    placed.sort(key=lambda item: canonical_key(item[0], item[1].cross))
    labels = layer_labels([layout.cross for _, layout, _ in placed])
    if all(label for _, _, label in placed) and len({label for _, _, label in placed}) == len(placed):
        labels = [label for _, _, label in placed]  # the run's own labels (exact module paths)
    return [StateDictLayer(i, label, name, layout) for i, (label, (name, layout, _)) in enumerate(zip(labels, placed))]
