"""Which layout a checkpoint is analysed with, and what was assumed to get it.

In order (the first that applies):

1. ``layout=`` / ``--layout FILE``: exactly those layouts;
   ``user_model=`` / ``--model module:callable``: the live discovery's layouts of the user's own
   model, built on the meta device (``hooks.checkpoint.usermodel``);
2. ``heads=`` / ``--heads N`` (``--kv-heads G``): the adapters with that head count; the
   packing and pairing they assume are stated;
3. the run's own layout file (``attnscope_layout.json`` beside or above the checkpoint,
   or inside a Lightning checkpoint): what the live Monitor discovered;
4. a Hugging Face model folder whose model ``transformers`` can build: the layouts
   the live discovery finds on that model (``model_layout``, a callable from ``hooks``);
5. the adapters on the keys, with the config's head counts; what cannot be told from
   the weights alone (per-head interleaving of a fused weight, the grouped-query
   pairing) is stated as an assumption, with the option that overrides it.

``kv_map=`` / ``--kv-map`` sets the grouped-query pairing the weights cannot tell (``grouped``: query head
h with key/value head h // (H/G); ``tiled``: h % G; or one key/value head per query head, ``0,1,0,1``)
where the layouts assumed it; where the layouts know it (the run's file, the model's probe forward, a
layout file) a different one is refused, as is a ``--kv-map`` on layers without grouped heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from diag.errors import ConfigError, SpecError
from diag.layouts.packings import packing_of
from diag.layouts.placement import layers_from_spec
from diag.layouts.statedict import Heads, StateDictLayer, find_layers, head_attrs
from diag.offline.checkpoint import Checkpoint
from diag.offline.layoutfile import LayoutFile

__all__ = ["ModelLayoutFn", "choose_layers", "assumptions", "kv_map_of"]

# A Hugging Face folder -> the layouts of the model built from its config (hooks.checkpoint.search), or None when
# transformers cannot build it; raises SpecError where the config and the weights contradict each other.
ModelLayoutFn = Callable[[Checkpoint], "LayoutFile | None"]

# Adapters whose fused weight is known to be [all Q | all K | all V] (by class, or by a name only one library
# uses); any other fused weight might be interleaved per head, which its shape cannot tell.
CERTAIN_FUSED = ("hf-gpt2", "hf-gpt2-cross", "hf-gpt-neox", "timm", "torch-mha")
FIX_PACKING = ("pass --layout FILE with packing='fused_per_head' for rows [Q_h | K_h | V_h] per head "
               "(docs/analyze.md#layout-files)")
FIX_PAIRING = ("the weights cannot tell which pairing the model computes: pass --kv-map tiled for h % G (or the "
               "list of each query head's key/value head), or the run's own attnscope_layout.json (Monitor.save_layout"
               "), or --model module:callable naming the model's class, or --layout FILE with kv_map "
               "(docs/analyze.md#grouped-query-pairing)")


def assumptions(layers: list[StateDictLayer]) -> tuple[str, ...]:
    """What the weights alone cannot confirm about these layouts, one sentence per kind."""
    found: dict[tuple[str, str], list[str]] = {}
    for la in layers:
        lay = la.layout
        probed = lay.adapter == "probe" or lay.adapter.endswith("+probe")  # confirmed by a probe forward
        what = packing_of(lay).assumed(lay)  # the rows' order, where the weights alone cannot tell it
        if what is not None and lay.adapter not in CERTAIN_FUSED and not probed:
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
                  model_layout: ModelLayoutFn | None, kv_map: str | None = None,
                  user_model: ModelLayoutFn | None = None) -> tuple[list[StateDictLayer], Heads]:
    """The checkpoint's attention layers and where their layouts came from (see the module docstring).
    ``user_model``: the layouts of ``--model``'s model, before all but ``layout``."""
    if user_model is not None and layout is None:
        layers, found = _user_model(ckpt, user_model)
    else:
        layers, found = _choose(ckpt, layout, heads, kv_heads, model_layout)
    if kv_map is None:
        return layers, found
    return _paired(layers, found, kv_map)


def _choose(ckpt: Checkpoint, layout: LayoutFile | None, heads: int | None, kv_heads: int | None,
            model_layout: ModelLayoutFn | None) -> tuple[list[StateDictLayer], Heads]:
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


def _user_model(ckpt: Checkpoint, user_model: ModelLayoutFn) -> tuple[list[StateDictLayer], Heads]:
    built = user_model(ckpt)
    assert built is not None
    fix = ("the model --model builds does not hold this checkpoint's weights: check that --model names the "
           "model that was saved (its configuration included)")
    layers = _from_spec(ckpt.tensors.shapes, built, fix)
    heads = _spec_heads(built, "--model", "layouts of --model")
    return layers, replace(heads, assumptions=heads.assumptions + assumptions(layers))


def kv_map_of(text: str, n_heads: int, kv_heads: int) -> tuple[int, ...]:
    """``--kv-map``'s pairing for a layer of ``n_heads`` query and ``kv_heads`` key/value heads."""
    if text == "grouped":
        return tuple(h // (n_heads // kv_heads) for h in range(n_heads))
    if text == "tiled":
        return tuple(h % kv_heads for h in range(n_heads))
    try:
        pairing = tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        pairing = ()
    if len(pairing) != n_heads or not all(0 <= g < kv_heads for g in pairing):
        raise ConfigError(f"--kv-map {text!r}: expected 'grouped' (h // (H/G)), 'tiled' (h % G) or {n_heads} "
                          f"comma-separated key/value heads in [0, {kv_heads}), one per query head, e.g. "
                          f"{','.join(str(h % kv_heads) for h in range(n_heads))}")
    return pairing


def _known(la: StateDictLayer, found: Heads) -> bool:
    """Whether the layer's pairing was read from the model (a run's file, a layout file, the probe forward)."""
    if found.source in ("run", "--layout"):
        return True
    if found.source == "model":
        return la.layout.adapter == "probe" or la.layout.adapter.endswith("+probe")
    return la.layout.kv_map is not None


def _paired(layers: list[StateDictLayer], found: Heads, kv_map: str) -> tuple[list[StateDictLayer], Heads]:
    """The layers with ``--kv-map``'s pairing where the pairing was assumed; refused where it contradicts a
    known one, or where no layer has grouped heads."""
    grouped = [la for la in layers if 1 < la.layout.kv_heads < la.layout.n_heads]
    if not grouped:
        raise SpecError(f"--kv-map {kv_map}: no attention layer has fewer key/value heads than query heads "
                        f"({layers[0].layout.describe()}), so there is no pairing to set: drop --kv-map, or pass "
                        "--kv-heads G if the model groups its key/value heads")
    out = []
    for la in layers:
        if la not in grouped:
            out.append(la)
            continue
        pairing = kv_map_of(kv_map, la.layout.n_heads, la.layout.kv_heads)
        if _known(la, found) and pairing != la.layout.kv_index:
            raise SpecError(f"{la.name}: --kv-map {kv_map} contradicts the pairing of the {found.note} "
                            f"(query head h with key/value head {list(la.layout.kv_index)}[h]), which was read "
                            "from the model, not assumed: drop --kv-map")
        out.append(replace(la, layout=replace(la.layout, kv_map=pairing)))
    rule = {"grouped": "h // (H/G)", "tiled": "h % G"}.get(kv_map, f"[{kv_map}][h]")
    note = f"{found.note}; query head h pairs with key/value head {rule} (--kv-map {kv_map})"
    stated = tuple(a for a in found.assumptions if FIX_PAIRING not in a)
    return out, replace(found, note=note, assumptions=stated)


def _model_layout(ckpt: Checkpoint, model_layout: ModelLayoutFn | None) -> LayoutFile | None:
    return model_layout(ckpt) if model_layout is not None and ckpt.config.get("model_type") else None


def _from_spec(shapes: Mapping[str, tuple[int, ...]], layout: LayoutFile, fix: str = "") -> list[StateDictLayer]:
    spec = [(e.module, e.layout, e.label) for e in layout.entries]
    return layers_from_spec(shapes, spec, layout.source, *([fix] if fix else []))
