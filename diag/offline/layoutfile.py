"""The layout file: which modules are attention layers and how their Q/K/V are packed, as JSON.

The live Monitor writes the layouts it discovered (or was given) as
``attnscope_layout.json`` in its logdir; the trainer callbacks save the same
beside (HF Trainer) or inside (Lightning) every checkpoint. The checkpoint
analysis picks it up, so a run's own checkpoints need no options; ``--layout FILE``
passes one by hand for any state dict. The format::

    {"format": "attnscope-layout", "version": 1,
     "layers": [{"module": "transformer.h.*.attn",        # a module path or an fnmatch pattern
                 "label": "L00",                          # optional: the tag label the run used
                 "layout": {"n_heads": 4, "head_dim": 8, "q": "c_attn.weight", "packing": "fused", ...}}]}

``layout`` holds the fields of :class:`~diag.layouts.vocab.QKVLayout` (``QKVLayout.to_dict()``).
Patterns give per-stage head counts (one entry per stage); a query-to-KV-head map
is the layout's own field where the vocabulary has it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.errors import SpecError
from diag.layouts.vocab import QKVLayout

__all__ = ["FILE_NAME", "FORMAT", "LayoutEntry", "LayoutFile", "find_layout_file", "layout_from_dict",
           "layout_to_dict", "parse_layout", "read_layout_file", "write_layout_file"]

FILE_NAME = "attnscope_layout.json"
FORMAT = "attnscope-layout"
VERSION = 1
SEARCH_LEVELS = 3  # folders above a checkpoint searched for a run's layout file


def layout_to_dict(layout: QKVLayout) -> dict[str, Any]:
    """Every field of the layout, JSON-safe (:meth:`QKVLayout.to_dict`)."""
    return layout.to_dict()


def layout_from_dict(data: Mapping[str, Any], where: str = "layout") -> QKVLayout:
    """A :class:`QKVLayout` from :func:`layout_to_dict`'s output; errors name the field and the fix."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected an object of QKVLayout fields, found {type(data).__name__}")
    try:
        return QKVLayout.from_dict(dict(data))
    except (TypeError, ValueError) as err:
        raise SpecError(f"{where}: {err}") from None


@dataclass(frozen=True)
class LayoutEntry:
    module: str  # a module path or fnmatch pattern, relative to the model the Monitor wrapped
    layout: QKVLayout
    label: str | None = None


@dataclass(frozen=True)
class LayoutFile:
    entries: tuple[LayoutEntry, ...]
    source: str  # where it came from, for messages: a path, or "the checkpoint's attnscope_layout"
    notes: tuple[str, ...] = ()  # what its maker could not check (printed with the analysis)


def parse_layout(data: Any, source: str) -> LayoutFile:
    """Check and read the JSON object of a layout file (see the module docstring)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("layers"), list) or not data["layers"]:
        raise SpecError(f"{source}: not a layout file; expected {{\"format\": \"{FORMAT}\", \"layers\": "
                        "[{\"module\": ..., \"layout\": {QKVLayout fields}}, ...]} (docs/analyze.md#layout-files)")
    if data.get("format", FORMAT) != FORMAT:
        raise SpecError(f"{source}: \"format\" is {data.get('format')!r}, expected {FORMAT!r}; a file written by "
                        f"another version: set \"format\": \"{FORMAT}\" if its layers follow "
                        "docs/analyze.md#layout-files")
    entries = []
    for i, item in enumerate(data["layers"]):
        where = f"{source}: layers[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("module"), str) or not item["module"]:
            raise SpecError(f"{where}: needs \"module\" (a module path or pattern such as \"h.*.attn\") "
                            "and \"layout\" (QKVLayout fields)")
        label = item.get("label")
        entries.append(LayoutEntry(item["module"], layout_from_dict(item.get("layout"), f"{where}.layout"),
                                   label if isinstance(label, str) else None))
    return LayoutFile(tuple(entries), source)


def layout_document(entries: Sequence[LayoutEntry], source: str = "") -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "source": source,
            "layers": [{"module": e.module, "label": e.label, "layout": layout_to_dict(e.layout)} for e in entries]}


def write_layout_file(path: str | Path, entries: Sequence[LayoutEntry], source: str = "") -> Path:
    """Write atomically (a temporary file, then a rename): a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(layout_document(entries, source), indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def read_layout_file(path: str | Path, what: str = "--layout") -> LayoutFile:
    """Read and check a layout file; ``what`` names it in messages (``--layout``, "the run's layout file")."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SpecError(f"{what} {path}: cannot be read ({err.strerror or err}); check the path") from None
    except ValueError as err:
        raise SpecError(f"{what} {path}: not valid JSON ({err}); fix or delete the file") from None
    return parse_layout(data, str(path))


def find_layout_file(checkpoint: Path) -> Path | None:
    """A run's layout file for this checkpoint: in the model folder, beside the file, or in a folder above
    (up to :data:`SEARCH_LEVELS` levels, and in their ``attnscope/`` subfolder, the Lightning logdir)."""
    start = checkpoint if checkpoint.is_dir() else checkpoint.parent
    for folder in [start, *list(start.resolve().parents)[:SEARCH_LEVELS]]:
        for candidate in (folder / FILE_NAME, folder / "attnscope" / FILE_NAME):
            if candidate.is_file():
                return candidate
    return None
