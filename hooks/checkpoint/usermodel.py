"""``analyze --model MODULE:CALLABLE``: the layouts of the user's own model, for a bare state dict.

A state dict saved with ``torch.save(model.state_dict())`` (or as ``.safetensors``) says nothing of the
model's heads or pairing. ``MODULE:CALLABLE`` names the user's own code (an importable module, or a ``.py``
file, and a function or class in it) that returns the model. It is called under ``torch.device("meta")``:
no weights are allocated, whatever the model's size, and the live discovery
(:func:`hooks.layout.discover.discover`) finds its attention modules and their layouts from the modules'
classes, names and attributes (the head counts are the modules' own, not assumed).

The weights cannot tell a grouped-query pairing or a fused weight's packing; the live Monitor reads both
from the attention kernel at the first forward. Here, when the model has at most
:data:`hooks.checkpoint.search.MAX_TWIN_PARAMS` parameters, it is built a second time on the CPU in float64
with random weights, and each attention module is probed alone (``module(x)`` with x of shape (2, 8, E))
as a Hugging Face folder's modules are (:mod:`hooks.checkpoint.verdicts`): the layout that scaling query head
h by c and its key head by 1/c leaves unchanged is the module's own, pairing included. A module that cannot
be called so, or a larger model, keeps the discovered layout, and what it assumes is stated.

The code run is the user's, named on the command line; nothing of a checkpoint is ever imported or run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from diag.errors import ConfigError, DiagError, SpecError
from diag.layouts.generic import is_provisional
from diag.layouts.vocab import QKVLayout, split_qkv
from diag.offline.checkpoint import Checkpoint
from diag.offline.layoutfile import LayoutEntry, LayoutFile
from hooks.checkpoint.search import MAX_TWIN_PARAMS, _candidates, _pairings, _view
from hooks.checkpoint.verdicts import verdicts
from hooks.layout.discover import AttentionLayer, discover

__all__ = ["UserModel", "load_callable"]

HOW = "MODULE:CALLABLE, e.g. --model mypkg.model:build or --model path/to/model.py:GPT"


def _import(module: str, spec: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ConfigError(f"--model {spec}: no file {module}; expected {HOW}")
        found = importlib.util.spec_from_file_location(path.stem, path)
        assert found is not None and found.loader is not None
        loaded = importlib.util.module_from_spec(found)
        sys.modules[path.stem] = loaded
        found.loader.exec_module(loaded)
        return loaded
    return importlib.import_module(module)


def load_callable(spec: str) -> Callable[[], object]:
    """The callable ``MODULE:CALLABLE`` names (the module imported: the user's code)."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"--model {spec!r}: expected {HOW}")
    try:
        obj = _import(module, spec)
    except DiagError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's module failed to import: say how
        raise ConfigError(f"--model {spec}: importing {module} failed ({type(err).__name__}: {err}); run from "
                          "the folder that holds it, or put that folder on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--model {spec}: {module} has no {attr!r}; expected {HOW}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--model {spec}: {attr} is a {type(obj).__name__}, not a function or class")
    return obj


def _build(factory: Callable[[], object], spec: str, device: str) -> nn.Module:
    try:
        with torch.device(device):
            model = factory()
    except Exception as err:  # noqa: BLE001 - the user's code failed: say where
        raise ConfigError(f"--model {spec}: calling it on the {device} device failed ({type(err).__name__}: "
                          f"{err}); it must build the model with no arguments") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model


class _Alone(nn.Module):
    """One attention module called on its own input: the probe's model."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x: torch.Tensor):
        return self.m(x)


def _width(module: nn.Module, layout: QKVLayout) -> int:
    params = dict(module.named_parameters())
    q, _, _ = split_qkv({n: params[n] for n in layout.param_names}, layout)
    return q.shape[-1]


def _confirmed(model: nn.Module, layer: AttentionLayer) -> QKVLayout | None:
    """The layout a probe of the module alone confirms (its pairing made explicit), or None."""
    module = model.get_submodule(layer.name)
    lay = layer.layout
    e = _width(module, lay)
    cands = list(dict.fromkeys([*_pairings(replace(lay, o=None, o_transposed=None)),
                                *_candidates(_view(layer.name, module), lay.n_heads, lay.head_dim, e)]))
    x = torch.randn(2, 8, e, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    found, _ = verdicts(_Alone(module), {"x": x}, {"m": cands})
    if "m" not in found:
        return None
    got = found["m"]
    kv_map = got.kv_index if 1 < got.kv_heads < got.n_heads else None
    return replace(got, kv_map=kv_map, o=lay.o, o_transposed=lay.o_transposed, cross=lay.cross,
                   adapter=f"{lay.adapter}+probe")


def _probed(factory: Callable[[], object], spec: str, layers: list[AttentionLayer]) -> dict[str, QKVLayout]:
    """Per module name, its layout confirmed on a float64 build with random weights (see the module docstring)."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(0)
        model = _build(factory, spec, "cpu").double().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
    out = {}
    for layer in layers:
        try:
            got = _confirmed(model, layer)
        except Exception:  # noqa: BLE001 - a module that cannot be called on x alone: its layout stays as found
            got = None
        if got is not None:
            out[layer.name] = got
    return out


class UserModel:
    """``user_model`` for :func:`diag.offline.series.analyze_checkpoints`: the layouts of ``--model``'s model
    (the same for every checkpoint; discovered once)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.factory = load_callable(spec)
        self._layouts: LayoutFile | None = None

    def __call__(self, ckpt: Checkpoint) -> LayoutFile:
        if self._layouts is None:
            self._layouts = self._discover()
        return self._layouts

    def _discover(self) -> LayoutFile:
        meta = _build(self.factory, self.spec, "meta")
        try:
            layers = discover(meta)
        except SpecError as err:
            raise SpecError(f"--model {self.spec}: {err}") from None
        small = sum(p.numel() for p in meta.parameters()) <= MAX_TWIN_PARAMS
        probed = _probed(self.factory, self.spec, layers) if small else {}
        entries = tuple(LayoutEntry(la.name, probed.get(la.name, la.layout), la.label) for la in layers)
        unchecked = [la.name for la in layers if la.name not in probed and is_provisional(la.layout)]
        notes = () if not unchecked else (
            f"assumed: the layouts of {unchecked[:3]} as their names propose ({layers[0].layout.describe()}): no "
            "forward confirmed them (" + ("the model is too large to build for a probe" if not small else
                                          "the module cannot be called on its input alone") +
            "); if not, pass the run's attnscope_layout.json or --layout FILE (docs/analyze.md#layout-files)",)
        return LayoutFile(entries, f"{type(meta).__name__} from --model {self.spec}", notes)

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "factory": None, "_layouts": self._layouts}
