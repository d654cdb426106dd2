"""The layouts of a Hugging Face model folder, from the model ``transformers`` builds from its ``config.json``.

For ``python -m diag analyze`` (handed to :func:`diag.offline.series.analyze_checkpoints`
as ``model_layout``): the model is built from the config on the meta device (no
weights allocated, no code from the folder, no ``trust_remote_code``); every module
whose Q/K/V weights could hold the config's heads gets candidate layouts (the live
discovery's, by names, first; then each packing the shapes allow); a *probe forward*
decides among them on a twin with random float64 weights:

* a candidate is right when scaling its query head h by c_g and its key head g by
  1/c_g (g the key head h pairs with; one c per key head) leaves the module's output
  unchanged: the logits q_h . k_g are unchanged exactly when the split and the pairing
  are the model's own, whatever the attention kernel, RoPE or ALiBi;
* and scaling the query heads alone must change it (else the test says nothing, e.g.
  under QK-norm).

Each module gets its recorded inputs from an unperturbed forward, so every layer is
tested on its own in one forward per candidate. A module with no candidate that passes
is left out; a folder none of whose modules passes gives ``SpecError`` naming what was
read. Large models (over :data:`MAX_TWIN_PARAMS`) are probed on a twin of :data:`PROBE_LAYERS`
layer whose feed-forward widths (:data:`FFN_KEYS`), vocabulary and position tables are cut to
what the probe's forward needs (the attention module keeps the model's width and heads: its
shapes are what is tested), and the layouts carried to every layer of the same name pattern.
So the probe's memory is one attention module in float64 plus a constant, whatever the
model's depth, feed-forward width or vocabulary (a 70B-shaped model: about 1.3 GB; its
2 full-width layers would take 17.6); a config that cannot be built or run so cut is probed on
2 layers of full width, the vocabulary cut.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from diag.errors import SpecError
from diag.layouts.adapters import find_layout, is_cross, resolve
from diag.layouts.infer import fused_layouts
from diag.layouts.vocab import QKVLayout
from diag.offline.checkpoint import Checkpoint
from diag.offline.layoutfile import LayoutEntry, LayoutFile
from hooks.checkpoint.architecture import architecture
from hooks.checkpoint.verdicts import verdicts
from hooks.layout.discover import module_view

__all__ = ["ModelLayouts", "model_layouts"]

PROBE_LAYERS = 1  # layers of the random twin when the model is larger than MAX_TWIN_PARAMS
MAX_TWIN_PARAMS = 50_000_000
PROBE_VOCAB = 1024  # vocabulary of the twin of a large model
PROBE_FFN = 32  # feed-forward width of the twin of a large model
PROBE_POSITIONS = 64  # position-table length of the twin of a large model (the probe's sequences have 8 tokens)
LAYER_KEYS = ("num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers", "n_layer", "n_layers")
FFN_KEYS = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff",
            "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp", "ffn_hidden_size")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")


def _config(config: dict[str, Any]):
    """The transformers config and model class for a config.json, or None when transformers cannot build it."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - the hf extra
        return None
    config = dict(config)
    cls = architecture(config)[1] or transformers.AutoModel
    try:
        cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    except (ValueError, KeyError, TypeError):
        return None
    return cfg, cls


def _build(cfg, cls, device: str, dtype: torch.dtype | None = None) -> nn.Module:
    build = cls.from_config if cls.__name__.startswith("Auto") else cls._from_config
    with torch.device(device):
        return build(cfg, attn_implementation="eager", **({} if dtype is None else {"dtype": dtype}))


def _dims(cfg) -> tuple[int, int, int] | None:
    """(H, D, E) of the config: query heads, head size, model width."""
    e = getattr(cfg, "hidden_size", None)
    h = getattr(cfg, "num_attention_heads", None)
    if not isinstance(e, int) or not isinstance(h, int) or h < 1:
        return None
    d = getattr(cfg, "head_dim", None)
    return h, d if isinstance(d, int) and d > 0 else e // h, e


_ROLE = {"q": re.compile(r"(.*query.*|q|wq|q_.*|.*_q)"), "k": re.compile(r"(.*key.*|k|wk|k_.*|.*_k)"),
         "v": re.compile(r"(.*value.*|v|wv|v_.*|.*_v)")}


def _pairings(layout: QKVLayout) -> list[QKVLayout]:
    """The layout with the default pairing h // (H/G), then with h % G where the vocabulary has ``kv_map``."""
    g, h = layout.kv_heads, layout.n_heads
    if not 1 < g < h or "kv_map" not in {f.name for f in fields(QKVLayout)}:
        return [layout]
    return [layout, replace(layout, kv_map=tuple(i % g for i in range(h)))]


def _candidates(view, h: int, d: int, e: int) -> list[QKVLayout]:
    """Layouts a module's own weights could hold with h heads of d (names first, then every packing)."""
    found: list[QKVLayout] = []
    cross = is_cross(view)
    named = find_layout(view, provisional=False)  # the probe checks candidates itself; no generic guesses
    if named is not None:
        found.append(named)
    # children's weights (c_attn.weight) and own weights other than a Linear's (in_proj_weight)
    two_d = {n: s for n, s in view.params.items() if len(s) == 2 and n != "weight"
             and (n.count(".") == 1 or n.endswith("_weight")) and not n.endswith("bias")}
    for name, (rows, cols) in two_d.items():
        for r, transposed in ((rows, False), (cols, True)):
            if (cols if not transposed else rows) != e or r % d or (r // d - h) % 2 or r // d <= h:
                continue
            g = (r // d - h) // 2
            if g < 1 or h % g:
                continue
            # the probe's scaling (query head by c, its key head by 1/c) cannot tell a query block from a key block
            # of the same size: Q before K, as every family we know stores them
            for layout in fused_layouts(h, d, name, g, q_first=True, transposed=transposed, cross=cross,
                                        adapter="probe"):
                found += _pairings(layout)
    roles = {role: [n for n, s in two_d.items() if s[1] == e and n.endswith(".weight")
                    and pattern.fullmatch(n.removesuffix(".weight").lower())] for role, pattern in _ROLE.items()}
    for q in roles["q"]:
        for k in roles["k"]:
            for v in roles["v"]:
                kd = two_d[k][0]
                if two_d[q][0] == h * d and kd % d == 0 and h % (kd // d) == 0:
                    found += _pairings(QKVLayout(h, d, q, k, v, n_kv_heads=kd // d, cross=cross, adapter="probe"))
    return list(dict.fromkeys(found))


def _batch(model: nn.Module, cfg) -> dict[str, Tensor] | None:
    gen = torch.Generator().manual_seed(0)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        ids = torch.randint(0, max(2, min(int(getattr(cfg, "vocab_size", 100) or 100), 1000)), (2, 8), generator=gen)
        batch = {"input_ids": ids}
        if getattr(cfg, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = ids
        elif getattr(cfg, "add_cross_attention", False) and isinstance(getattr(cfg, "hidden_size", None), int):
            batch["encoder_hidden_states"] = torch.randn(2, 5, cfg.hidden_size, generator=gen, dtype=torch.float64)
        return batch
    if name == "pixel_values":
        size, channels = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", 3)
        if isinstance(size, int):
            return {"pixel_values": torch.randn(2, channels, size, size, generator=gen, dtype=torch.float64)}
    return None


O_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "proj", "out", "o", "wo", "out_lin", "../output.dense")


def _with_o(name: str, layout: QKVLayout, model: nn.Module) -> QKVLayout:
    """The layout with W_O: the first of :data:`O_NAMES` (in the module, or beside it) taking H*D inputs."""
    if layout.o is not None:
        return layout
    params = dict(model.named_parameters())
    width = layout.n_heads * layout.head_dim
    for stem in O_NAMES:
        shape = params.get(resolve(name, f"{stem}.weight"))
        if shape is not None and shape.dim() == 2 and (shape.shape[1] == width or shape.shape[0] == width):
            return replace(layout, o=f"{stem}.weight", o_transposed=shape.shape[1] != width)
    return layout


def _view(name: str, module: nn.Module):
    """The module's view without its embedding tables (a vocabulary can have the rows of a fused QKV weight)."""
    view = module_view(name, module)
    tables = {c for c, child in module.named_children() if isinstance(child, nn.Embedding)}
    view.params = {n: s for n, s in view.params.items() if n.split(".")[0] not in tables}
    return view


def _pattern(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _cut(cfg, level: int):
    """A copy of the config, cut for the probe. Level 2: :data:`PROBE_LAYERS` layers and the widths of all but
    the attention modules cut (feed-forward, vocabulary, position tables); level 1 (a config level 2 cannot
    build or run): 2 layers and the vocabulary; level 0: the config itself. Per-layer lists follow the layers."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    if level == 0:
        return cfg
    _cut_layers(cfg, PROBE_LAYERS if level == 2 else 2)
    for keys, limit in ((FFN_KEYS, PROBE_FFN), (POSITION_KEYS, PROBE_POSITIONS)) if level == 2 else ():
        for key in keys:
            if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) > limit:
                setattr(cfg, key, limit)
    if isinstance(getattr(cfg, "vocab_size", None), int) and cfg.vocab_size > PROBE_VOCAB:
        cfg.vocab_size = PROBE_VOCAB  # the embedding tables hold no attention; token ids are drawn below it
        for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= PROBE_VOCAB:
                setattr(cfg, key, 0)
    return cfg


def _cut_layers(cfg, keep: int) -> None:
    for key in LAYER_KEYS:
        layers = getattr(cfg, key, None)
        if isinstance(layers, int) and layers > keep:
            setattr(cfg, key, keep)
            for name, value in list(vars(cfg).items()):  # e.g. layer_types: one entry per layer
                if isinstance(value, list) and len(value) == layers:
                    setattr(cfg, name, value[:keep])


def _twin(cfg, cls, level: int) -> nn.Module:
    """A float64 model with random weights, of the config :func:`_cut` to ``level``."""
    cfg = _cut(cfg, level)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(0)
        twin = _build(cfg, cls, "cpu", torch.float64).double().eval()  # built in float64: no float32 copy
        with torch.no_grad():  # logits of order 1 (a model's init may make them ~0: softmax then hides scaling)
            for p in twin.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
    return twin


def _probe(cfg, cls, meta: nn.Module, cands: dict[str, list[QKVLayout]]):
    """(twin, verdicts, blind modules) from the smallest twin that runs; None when none does."""
    large = sum(p.numel() for p in meta.parameters()) > MAX_TWIN_PARAMS
    for level in (2, 1) if large else (0,):
        try:
            twin = _twin(cfg, cls, level)
            batch = _batch(twin, twin.config)
            if batch is None:
                return None
            names = {n for n, _ in twin.named_modules()}
            found, blind = verdicts(twin, batch, {n: c for n, c in cands.items() if n in names})
            return twin, found, blind
        except Exception:  # noqa: BLE001 - a config that cannot be cut, or a model that cannot run the probe
            continue
    return None


def _saved_names(twin: nn.Module) -> dict[str, str]:
    """Model parameter name -> the name ``save_pretrained`` writes it under (transformers renames some on
    saving, e.g. ViT ``vit.layers.0.attention.q_proj`` -> ``vit.encoder.layer.0.attention.attention.query``).
    Found by following each tensor through transformers' own reverse conversion; identity where none."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - older transformers save under the model's names
        return {}
    state = dict(twin.state_dict())
    by_storage = {t.data_ptr(): name for name, t in state.items()}
    try:
        saved = revert_weight_conversion(twin, dict(state))
    except Exception:  # noqa: BLE001 - a conversion it cannot revert: names stay as they are
        return {}
    return {by_storage[t.data_ptr()]: key for key, t in saved.items()
            if isinstance(t, Tensor) and t.data_ptr() in by_storage and by_storage[t.data_ptr()] != key}


def _template(name: str) -> tuple[str, tuple[str, ...]]:
    numbers = tuple(re.findall(r"(?<![^.])\d+(?![^.])", name))
    return re.sub(r"(?<![^.])\d+(?![^.])", "#", name), numbers


def _renamed(entry: LayoutEntry, names: dict[str, str]) -> LayoutEntry:
    """The entry under the names its weights are saved with (module: their common prefix)."""
    templates = {_template(m)[0]: _template(d)[0] for m, d in names.items()}
    keys = {}
    for weight in entry.layout.weight_names:
        full = resolve(entry.module, weight)
        tmpl, numbers = _template(full)
        if tmpl not in templates:
            return entry
        saved = templates[tmpl]
        for number in numbers:
            saved = saved.replace("#", number, 1)
        keys[weight] = saved
    parts = [k.split(".") for k in keys.values()]
    common = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    module = ".".join(common[: min(len(p) for p in parts) - 1])
    rel = {w: k[len(module) + 1 :] if module else k for w, k in keys.items()}
    fields = {"q": rel.get(entry.layout.q), "k": rel.get(entry.layout.k) if entry.layout.k else None,
              "v": rel.get(entry.layout.v) if entry.layout.v else None}
    if entry.layout.o is not None:
        fields["o"] = rel[entry.layout.o]
    return LayoutEntry(module, replace(entry.layout, **fields), entry.label)


def model_layouts(config: dict[str, Any], where: str) -> tuple[list[LayoutEntry], tuple[str, ...]] | None:
    """The layouts of the model ``config`` describes (see the module docstring), with what could not be checked;
    None when transformers cannot build it; SpecError when no module's weights pass the probe."""
    built = _config(config)
    if built is None:
        return None
    cfg, cls = built
    try:
        meta = _build(cfg, cls, "meta")
    except Exception:  # noqa: BLE001 - a config transformers cannot build: the keys path takes over
        return None
    dims = _dims(cfg)
    if dims is None:
        return None
    cands = {n: c for n, m in meta.named_modules() if n and (c := _candidates(_view(n, m), *dims))}
    if not cands:
        return None
    probed = _probe(cfg, cls, meta, cands)
    if probed is None:  # the model cannot run the probe: the keys path takes over, stating its guesses
        return None
    twin, found, blind = probed
    twin_names = {n for n, _ in twin.named_modules()}
    entries, notes = _entries(cands, found, blind, meta, where, twin_names)
    names = _saved_names(twin)
    return [_renamed(e, names) for e in entries] if names else entries, notes


def _entries(cands: dict[str, list[QKVLayout]], found: dict[str, QKVLayout], blind: set[str], meta: nn.Module,
             where: str, twin_names: set[str]) -> tuple[list[LayoutEntry], tuple[str, ...]]:
    """Every module's confirmed layout (a module the twin lacks: its like module's, by name pattern), or its
    names' layout where the probe is blind; a names' layout the probe contradicts, or nothing confirmed at all,
    is refused."""
    by_pattern = {_pattern(n): lay for n, lay in found.items()}
    blind_patterns = {_pattern(n) for n in blind}
    named = {n: c[0] for n, c in cands.items() if c[0].adapter != "probe"}

    def resolve_one(n: str) -> tuple[QKVLayout | None, bool]:  # (layout, taken from its names unchecked)
        if n in twin_names:
            return (found[n], False) if n in found else (named.get(n), True) if n in blind else (None, False)
        if _pattern(n) in by_pattern:
            return by_pattern[_pattern(n)], False
        return (named.get(n), True) if _pattern(n) in blind_patterns else (None, False)

    resolved = {n: resolve_one(n) for n in cands}
    contradicted = [n for n in named if resolved[n][0] is None]
    if contradicted or not any(layout for layout, _ in resolved.values()):
        raise SpecError(_refusal(cands, contradicted, meta, where))
    entries, unchecked = [], []
    for n, (layout, by_names) in resolved.items():
        if layout is None:
            continue
        if by_names:
            unchecked.append(_pattern(n))
        elif layout.adapter != "probe":
            layout = replace(layout, adapter=layout.adapter + "+probe")
        entries.append(LayoutEntry(n, _with_o(n, layout, meta)))
    notes = () if not unchecked else (
        f"assumed: the layouts of {sorted(set(unchecked))[:3]} by their names only (the probe forward cannot "
        "check them: q/k normalised after the projection, or the module not run by it); if not, pass --layout "
        "FILE (docs/analyze.md#layout-files)",)
    return entries, notes


def _refusal(cands: dict[str, list[QKVLayout]], contradicted: list[str], meta: nn.Module, where: str) -> str:
    h, d = cands[next(iter(cands))][0].n_heads, cands[next(iter(cands))][0].head_dim
    shown = contradicted[:2] or list(cands)[:3]
    tried = "; ".join(f"{n}: {[c.describe() for c in cands[n]][:3]}" for n in shown)
    what = (f"the probe forward contradicts every layout its weights could hold for {contradicted[:3]}"
            if contradicted else "a probe forward confirmed no Q/K/V layout of its weights")
    return (f"{where}: transformers builds {type(meta).__name__} from config.json ({h} heads of {d}), but {what} "
            f"(tried {tried}); refused rather than guessed: pass --layout FILE naming each layer's weights and "
            "packing (docs/analyze.md#layout-files)")


class ModelLayouts:
    """``model_layout`` for :func:`diag.offline.series.analyze_checkpoints`: a Hugging Face folder -> its model's
    layouts (once per distinct config in a series)."""

    def __init__(self) -> None:
        self._cache: dict[str, LayoutFile | None] = {}

    def __call__(self, ckpt: Checkpoint) -> LayoutFile | None:
        if ckpt.config_source != "config.json" or "model_type" not in ckpt.config:
            return None
        key = json.dumps(ckpt.config, sort_keys=True, default=str)
        if key not in self._cache:
            result = model_layouts(ckpt.config, str(ckpt.path))
            arch = (ckpt.config.get("architectures") or [ckpt.config["model_type"]])[0]
            self._cache[key] = None if result is None else LayoutFile(
                tuple(result[0]), f"{arch} built from config.json, layouts checked by a probe forward",
                result[1])
        return self._cache[key]
