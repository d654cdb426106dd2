"""Attention layers of a state dict: the live discovery's adapters, applied to names and shapes.

Keys are grouped by module prefix into :class:`~diag.layouts.ModuleView` objects
holding, like a live module's view, the module's own parameters and its direct
children's (``c_attn.weight``, ``q_proj.weight``), with the head counts of the
config (``config.json``, nanoGPT's ``model_args``) or of ``--heads`` as
attributes. :func:`~diag.layouts.find_layout` then picks the layout, exactly as
:func:`hooks.layout.discover.discover` does for a live model.

Layers are numbered in a canonical order, not in file order: safetensors stores
keys sorted as strings (``h.10`` before ``h.2``, ``decoder`` before ``encoder``).
Canonical: numeric parts compare as numbers, ``encoder`` before ``decoder``,
cross-attention after its block's self-attention. For every supported family
that is the registration order the live Monitor numbers by.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diag.catalog.tags import layer_labels
from diag.errors import SpecError
from diag.layouts.adapters import ADAPTERS, CROSS_NAMES, HEAD_ATTRS, ModuleView, find_layout, resolve, with_sibling_o
from diag.layouts.vocab import QKVLayout

__all__ = ["Heads", "StateDictLayer", "head_attrs", "module_views", "find_layers", "qkv_suspects", "canonical_key"]

# Adapters that need the attention class (GPT-2's Conv1D, GPT-NeoX's interleaving) get it
# offline from a Hugging Face config's model_type; other views carry no class name.
MODEL_TYPE_CLASSES = {"gpt2": "GPT2Attention", "gpt_neox": "GPTNeoXAttention"}


@dataclass(frozen=True)
class Heads:
    """Head-count attributes for every view, and a sentence saying where they came from."""

    attrs: dict[str, int]
    source: str  # "config.json", "model_args", "--heads", or "assumed"
    note: str
    cls: str = ""  # the attention class name the config implies, if any
    assumptions: tuple[str, ...] = ()  # what the weights alone cannot confirm (see diag.offline.layers)


@dataclass(frozen=True)
class StateDictLayer:
    index: int
    label: str  # "L03", as in every tag
    name: str  # module prefix in the state dict, e.g. "transformer.h.3.attn"
    layout: QKVLayout

    def keys(self) -> dict[str, str]:
        """The layout's weight names (Q/K/V and W_O, whose ``../`` climbs to the parent) -> full state-dict keys."""
        return {n: resolve(self.name, n) for n in self.layout.weight_names}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# Config keys of other families that mean the same: BART/Marian/Whisper, T5.
CONFIG_ALIASES = {"encoder_attention_heads": "num_attention_heads", "d_kv": "head_dim"}


def _config_attrs(config: Mapping[str, Any]) -> dict[str, int]:
    attrs = {k: v for k in HEAD_ATTRS if (v := _int(config.get(k))) is not None}
    for alias, name in CONFIG_ALIASES.items():
        value = _int(config.get(alias))
        if value is not None and name not in attrs:
            attrs[name] = value
    decoder = _int(config.get("decoder_attention_heads"))
    if decoder is not None and decoder != attrs.get("num_attention_heads"):
        attrs.pop("num_attention_heads", None)  # encoder and decoder differ: no single count to use
    return attrs


def head_attrs(config: Mapping[str, Any], config_source: str, heads: int | None, kv_heads: int | None) -> Heads:
    """The head counts to analyse with: ``--heads``/``--kv-heads``, else the config, else one head."""
    attrs = _config_attrs(config)
    if heads is not None:
        attrs = {k: v for k, v in attrs.items() if k in ("embed_dim", "num_key_value_heads", "n_kv_heads")}
        attrs["num_heads"] = heads
        source, note = "--heads", f"{heads} heads per layer (--heads; every layer alike)"
    elif any(k in attrs for k in HEAD_ATTRS[:4]):
        source, note = config_source, f"head counts from {config_source}"
    else:
        attrs["num_heads"] = 1
        source = "assumed"
        note = ("the checkpoint does not tell the head count: each layer's whole Wq^T Wk is analysed as one "
                "head; pass --heads N for per-head metrics, or --layout FILE (docs/analyze.md#layout-files)")
    if kv_heads is not None:
        attrs.pop("n_kv_heads", None)
        attrs["num_key_value_heads"] = kv_heads
        note += f"; {kv_heads} key/value heads (--kv-heads)"
    return Heads(attrs, source, note, MODEL_TYPE_CLASSES.get(str(config.get("model_type", "")), ""))


def module_views(shapes: Mapping[str, tuple[int, ...]], attrs: Mapping[str, int], cls: str = "") -> list[ModuleView]:
    """One view per module prefix, in order of first appearance: own and direct children's params."""
    params: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        parts = key.split(".")
        for depth in range(len(parts)):
            params.setdefault(".".join(parts[:depth]), {})
        params[".".join(parts[:-1])][parts[-1]] = shape
        if len(parts) >= 2:
            params[".".join(parts[:-2])][".".join(parts[-2:])] = shape
    return [ModuleView(name, cls, p, dict(attrs)) for name, p in params.items()]


_TIMM_QKV = re.compile(r"blocks\.\d+\.attn\.qkv\.weight")


def signature_class(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The attention class a whole model's key pattern implies when no config names one."""
    if "patch_embed.proj.weight" in shapes and any(_TIMM_QKV.fullmatch(key) for key in shapes):
        return "Attention"  # a timm VisionTransformer state dict (timm saves no config beside it)
    return ""


_RANK = {"encoder": 0, "decoder": 1}


def canonical_key(name: str, cross: bool) -> tuple:
    """Sort key of a module path: numbers as numbers, encoder < decoder, self < cross attention."""
    parts = name.split(".")
    key: list[tuple] = []
    for i, part in enumerate(parts):
        if part.isdigit():
            key.append((0, int(part), ""))
        else:
            last_cross = cross and i == len(parts) - 1
            rank = 2 if part in CROSS_NAMES or last_cross else _RANK.get(part, 0)
            key.append((1, rank, part))
    return tuple(key)


# Fused QKV weights of common model code the adapters leave to their classes (timm and research code ``qkv``,
# MPT ``Wqkv``, Phi-3 ``qkv_proj``, Falcon/BLOOM ``query_key_value``, nanoGPT-likes ``c_attn``, ``to_qkv``), and
# the output projections beside them. Offline only, and only with a head count; read as [all Q | all K | all V],
# an assumption the analysis states (diag.offline.layers.assumptions).
FUSED_KEYS = ("qkv.weight", "Wqkv.weight", "qkv_proj.weight", "query_key_value.weight", "c_attn.weight",
              "to_qkv.weight", "in_proj.weight")
O_KEYS = ("proj.weight", "out_proj.weight", "o_proj.weight", "c_proj.weight", "dense.weight", "out.weight",
          "to_out.weight")


def _fused_key_pattern(view: ModuleView) -> QKVLayout | None:
    heads = view.first("num_heads", "num_attention_heads", "n_head", "n_heads")
    for name in FUSED_KEYS:
        shape = view.params.get(name)
        if heads is None or shape is None or len(shape) != 2:
            continue
        rows, e = shape
        d = view.first("head_dim") or e // heads
        kv = view.first("num_key_value_heads", "n_kv_heads") or heads
        if d < 1 or rows != (heads + 2 * kv) * d or heads % kv:
            continue
        o = next((n for n in O_KEYS if len(view.params.get(n, ())) == 2 and view.params[n][1] == heads * d), None)
        return QKVLayout(heads, d, q=name, packing="fused", n_kv_heads=kv, o=o, adapter="key-pattern")
    return None


def find_layers(shapes: Mapping[str, tuple[int, ...]], heads: Heads) -> list[StateDictLayer]:
    """Attention layers in canonical order; modules inside a found one are not searched again."""
    found: list[tuple[str, QKVLayout]] = []
    for view in module_views(shapes, heads.attrs, heads.cls or signature_class(shapes)):
        if any(view.name.startswith(f"{name}.") for name, _ in found):
            continue
        # no forward offline to confirm a generic adapter's guess: provisional layouts are not proposed here
        layout = find_layout(view, provisional=False) or _fused_key_pattern(view)
        if layout is not None:
            found.append((view.name, with_sibling_o(view.name, layout, shapes)))
    if not found:
        raise SpecError(_nothing_found(shapes, heads))
    found.sort(key=lambda item: canonical_key(item[0], item[1].cross))
    labels = layer_labels([layout.cross for _, layout in found])
    return [StateDictLayer(i, label, name, layout) for i, (label, (name, layout)) in enumerate(zip(labels, found))]


# Module (or parameter) names of query/key/value projections in common model code.
_QKV_NAME = re.compile(r"(w?[qkv]|qkv|wqkv|c_attn|q_attn|query|key|value|query_key_value|[qkv]_proj|to_[qkv]|"
                       r"[qkv]_lin|in_proj|(in|[qkv])_proj_weight)", re.IGNORECASE)


def qkv_suspects(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """2-D tensors named like a Q, K, V or fused QKV projection (not norms, not output projections)."""
    found = []
    for key, shape in shapes.items():
        parts = key.split(".")
        name = parts[-1] if parts[-1].endswith("proj_weight") else (parts[-2] if len(parts) > 1 else "")
        if len(shape) == 2 and _QKV_NAME.fullmatch(name):
            found.append(f"{key} {tuple(shape)}")
    return found


def _nothing_found(shapes: Mapping[str, tuple[int, ...]], heads: Heads) -> str:
    suspects = qkv_suspects(shapes)
    read = ", ".join(f"{k}={v}" for k, v in heads.attrs.items() if k in HEAD_ATTRS) or "no head count"
    tried = "; ".join(a.describes for a in ADAPTERS)
    if heads.source == "--heads":
        fix = ("The head counts passed do not fit these tensors' rows: check --heads/--kv-heads, or pass "
               "--model MODULE:CALLABLE naming the model's code, or --layout FILE naming each layer's weights "
               "(docs/analyze.md#layout-files)")
    else:
        fix = ("Pass --model MODULE:CALLABLE naming the model's code (built on the meta device; its heads and "
               "pairing are then the model's own), or the run's attnscope_layout.json (Monitor.save_layout), or "
               "--layout FILE naming each layer's weights and packing (docs/analyze.md#layout-files), or "
               "--heads N (and --kv-heads G for grouped-query) if one of the adapters above fits the keys")
    return (
        f"unknown layout: no attention weights recognised with {read} ({heads.source}) among {len(shapes)} "
        f"tensors. Tried {tried}. Tensors named like Q/K/V projections: {suspects[:4] or 'none'}. {fix}"
        f"{_gqa_hint(shapes) if heads.source != '--heads' else ''}"
    )


_QK_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("wq", "wk"), ("to_q", "to_k"))


def _gqa_hint(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """For separate projections whose K has fewer rows than Q (grouped-query): the --kv-heads that fits."""
    for key, shape in shapes.items():
        for q, k in _QK_PAIRS:
            if key.endswith(f".{q}.weight") and len(shape) == 2:
                other = shapes.get(key.removesuffix(f"{q}.weight") + f"{k}.weight")
                if other and len(other) == 2 and 0 < other[0] < shape[0] and shape[0] % other[0] == 0:
                    r = shape[0] // other[0]
                    return (f". {key} has {shape[0]} rows and its {k} {other[0]}: grouped-query attention, so "
                            f"--heads N --kv-heads N/{r} (N the model's head count, e.g. --heads {2 * r} "
                            f"--kv-heads 2 if the heads are {shape[0] // (2 * r)} wide)")
    return ""
