"""Which layout a checkpoint is analysed with, and what was assumed to get it.

In order (the first that applies):

1. ``layout=`` / ``--layout FILE``: exactly those layouts;
2. ``heads=`` / ``--heads N`` (``--kv-heads G``): the adapters with that head count; the
   packing and pairing they assume are stated;
3. the run's own layout file (``attnscope_layout.json`` beside or above the checkpoint,
   or inside a Lightning checkpoint): what the live Monitor discovered;
4. a Hugging Face model folder whose model ``transformers`` can build: the layouts
   the live discovery finds on that model (``model_layout``, a callable from ``hooks``);
5. the adapters on the keys, with the config's head counts; what cannot be told from
   the weights alone (per-head interleaving of a fused weight, the grouped-query
   pairing) is stated as an assumption, with the option that overrides it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from diag.errors import SpecError
from diag.layouts.packings import packing_of
from diag.layouts.placement import layers_from_spec
from diag.layouts.statedict import Heads, StateDictLayer, find_layers, head_attrs
from diag.offline.checkpoint import Checkpoint
from diag.offline.layoutfile import LayoutFile

__all__ = ["ModelLayoutFn", "choose_layers", "assumptions"]

# A Hugging Face folder -> the layouts of the model built from its config (hooks.checkpoint.search), or None when
# transformers cannot build it; raises SpecError where the config and the weights contradict each other.
ModelLayoutFn = Callable[[Checkpoint], "LayoutFile | None"]

# Adapters whose fused weight is known to be [all Q | all K | all V] (by class, or by a name only one library
# uses); any other fused weight might be interleaved per head, which its shape cannot tell.
CERTAIN_FUSED = ("hf-gpt2", "hf-gpt2-cross", "hf-gpt-neox", "timm", "torch-mha")
FIX_PACKING = ("pass --layout FILE with packing='fused_per_head' for rows [Q_h | K_h | V_h] per head "
               "(docs/analyze.md#layout-files)")
FIX_PAIRING = "pass --layout FILE with the layout's query-to-KV-head map kv_map (docs/analyze.md#layout-files)"


def assumptions(layers: list[StateDictLayer]) -> tuple[str, ...]:
    """What the weights alone cannot confirm about these layouts, one sentence per kind."""
    found: dict[tuple[str, str], list[str]] = {}
    for la in layers:
        lay = la.layout
        what = packing_of(lay).assumed(lay)  # the rows' order, where the weights alone cannot tell it
        if what is not None and lay.adapter not in CERTAIN_FUSED:
            found.setdefault((what, FIX_PACKING), []).append(la.label)
        g = lay.kv_heads
        if 1 < g < lay.n_heads and lay.kv_map is None:
            what = (f"query head h pairs with key/value head h // {lay.n_heads // g} (consecutive query heads "
                    "share a key/value head, not h % G)")
            found.setdefault((what, FIX_PAIRING), []).append(la.label)
    return tuple(f"assumed: {what} in {_labels(labels)}; if not, {fix}" for (what, fix), labels in found.items())


def _labels(labels: list[str]) -> str:
    return ", ".join(labels) if len(labels) <= 3 else f"{labels[0]}..{labels[-1]} ({len(labels)} layers)"


def _spec_heads(layout: LayoutFile, source: str, note: str) -> Heads:
    return Heads({}, source, f"{note} ({layout.source})", assumptions=layout.notes)


def choose_layers(ckpt: Checkpoint, layout: LayoutFile | None, heads: int | None, kv_heads: int | None,
                  model_layout: ModelLayoutFn | None) -> tuple[list[StateDictLayer], Heads]:
    """The checkpoint's attention layers and where their layouts came from (see the module docstring)."""
    shapes = ckpt.tensors.shapes
    if layout is not None:
        return _from_spec(shapes, layout), _spec_heads(layout, "--layout", "layouts from --layout")
    ignored: tuple[str, ...] = ()
    if heads is None and kv_heads is None:
        if ckpt.layout is not None:
            try:
                return _from_spec(shapes, ckpt.layout), _spec_heads(ckpt.layout, "run", "layouts saved by the run")
            except SpecError as err:  # another model's file above it, or names transformers renamed on saving
                ignored = (f"ignored the run's layout file: {err}",)
        built = _model_layout(ckpt, model_layout)
        if built is not None:
            fix = ("config.json and the weights disagree (refused rather than guessed): fix config.json, or pass "
                   "--layout FILE (docs/analyze.md#layout-files)")
            return _from_spec(shapes, built, fix), _spec_heads(built, "model", "layouts of the model")
    found = head_attrs(ckpt.config, ckpt.config_source, heads, kv_heads)
    layers = find_layers(shapes, found)
    stated = ignored + assumptions(layers)
    if heads is not None:
        stated = (f"assumed: every attention layer has {heads} heads (--heads); if the model's stages differ, "
                  "pass --layout FILE with one entry per stage (docs/analyze.md#layout-files)",) + stated
    return layers, replace(found, assumptions=stated)


def _model_layout(ckpt: Checkpoint, model_layout: ModelLayoutFn | None) -> LayoutFile | None:
    return model_layout(ckpt) if model_layout is not None and ckpt.config.get("model_type") else None


def _from_spec(shapes: Mapping[str, tuple[int, ...]], layout: LayoutFile, fix: str = "") -> list[StateDictLayer]:
    spec = [(e.module, e.layout, e.label) for e in layout.entries]
    return layers_from_spec(shapes, spec, layout.source, *([fix] if fix else []))
