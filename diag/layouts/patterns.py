"""Spec patterns: the ``fnmatch`` patterns of ``Monitor(model, spec={pattern: QKVLayout(...)})``.

One helper for every place that matches a spec or suggests one (discovery, the layout check's refusal
messages), so that a suggested pattern always means what the matcher does: case-sensitive ``fnmatch`` on
module names as ``model.named_modules()`` prints them, the first matching pattern wins.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from diag.layouts.vocab import QKVLayout

__all__ = ["matches", "first_match", "generalise", "patterns_for", "spec_text"]

_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component made of digits: "blocks.3.attn"


def matches(name: str, pattern: str) -> bool:
    """Whether a spec pattern selects this module name (the root module, named "", never)."""
    return bool(name) and fnmatch.fnmatchcase(name, pattern)


def first_match(name: str, spec: Mapping[str, QKVLayout]) -> QKVLayout | None:
    """The layout of the first pattern in ``spec`` that selects ``name``, or None."""
    for pattern, layout in spec.items():
        if matches(name, pattern):
            return layout
    return None


def generalise(name: str) -> str:
    """``"model.layers.3.self_attn"`` -> ``"model.layers.*.self_attn"``: each index component becomes ``*``."""
    return _INDEX.sub("*", name)


def patterns_for(targets: Sequence[str], every: Iterable[str]) -> list[str]:
    """Patterns that select exactly ``targets`` among the module names ``every``, as few as it can.

    Index components become ``*`` where that selects no other module outside the targets (``*`` also
    matches dots, but modules inside a found one are never matched again; a ``nn.Sequential`` block named
    ``layers.0.1`` generalises to ``layers.*.*``, which would take the feed-forward children too: then the
    names are kept exactly)."""
    names = [n for n in every if n]
    wanted = set(targets)
    out: list[str] = []
    for target in targets:
        if any(matches(target, p) for p in out):
            continue
        pattern = generalise(target)
        selected = {n for n in names if matches(n, pattern) and not _inside(n, wanted)}
        out.append(pattern if selected <= wanted else target)
    return out


def _inside(name: str, targets: set[str]) -> bool:
    """Inside a target module: never reached by a spec's matching (a found module is not searched again)."""
    return any(name.startswith(t + ".") for t in targets)


def spec_text(layouts: Mapping[str, QKVLayout]) -> str:
    """``spec={'blocks.*.attn': QKVLayout(...)}``, ready to paste."""
    items = ", ".join(f"{pattern!r}: {layout.describe()}" for pattern, layout in layouts.items())
    return f"spec={{{items}}}"
