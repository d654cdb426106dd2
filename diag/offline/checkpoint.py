"""Finding, ordering and opening checkpoints: files, folders, globs, Hugging Face model folders.

A *checkpoint* is one of:

* a PyTorch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): a state dict or a container;
* a ``.safetensors`` file, or a sharded one's ``*.index.json``;
* a model folder: ``config.json`` and/or an index JSON beside the weights
  (``save_pretrained`` output, ``checkpoint-500/`` of the HF Trainer).

A folder that is not a model folder is a *series*: every checkpoint file and model
folder directly inside it. A series is ordered by step (:func:`step_of`): the step
stored with the checkpoint (``iter_num``, ``step``, ``global_step``, ... in a
container; ``trainer_state.json``; safetensors metadata), else a name that reads as a
step (``step-1000``, ``checkpoint-1000``, ``iter_0001000``, ``global_step1000``,
``ckpt100``, or a name of digits only). Any other number in a name is no step (a folder
``llama8b`` is not step 8, ``gpt2.pt`` not step 2); a series none of whose checkpoints
has a step is ordered by position, which the analysis states.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.offline.layoutfile import LayoutFile, find_layout_file, parse_layout, read_layout_file
from diag.offline.loaders import (
    CheckpointError,
    TensorSource,
    is_zip_format,
    load_torch,
    open_safetensors,
    unwrap_state_dict,
)

__all__ = ["Checkpoint", "CheckpointError", "find_checkpoints", "open_checkpoint", "step_of", "TORCH_SUFFIXES"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
STEP_KEYS = ("iter_num", "step", "global_step", "iteration", "num_updates")
CONFIG_KEYS = ("model_args", "config", "hyper_parameters", "hparams")
LAYOUT_KEY = "attnscope_layout"  # a checkpoint dict's entry holding the run's layout file
# A name that reads as a step: a keyword and its number (global_step1000 is step1000), or digits only.
_NAMED_STEP = re.compile(r"(?:step|iter|iteration|checkpoint|ckpt)[-_=]?(\d+)", re.IGNORECASE)
_DIGITS = re.compile(r"\d+")
STEP_NAMES = "step-1000, checkpoint-1000, iter_0001000, global_step1000"


@dataclass
class Checkpoint:
    """One opened checkpoint: its tensors (lazy), its config values and its stored step."""

    path: Path
    kind: str  # "pytorch", "safetensors", "sharded", "model-folder"
    tensors: TensorSource
    config: dict[str, Any] = field(default_factory=dict)
    config_source: str = ""  # where the config came from, e.g. "config.json" or "model_args"
    stored_step: int | None = None
    layout: LayoutFile | None = None  # the layouts the run saved with it (attnscope_layout), if any


def _is_checkpoint_file(path: Path) -> bool:
    return path.suffix in TORCH_SUFFIXES + (".safetensors",) or path.name.endswith(".index.json")


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (
        any((path / name).is_file() for name in WEIGHT_FILES[1::2])
        or ((path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES))
    )


def _expand(arg: str) -> list[Path]:
    path = Path(arg)
    if path.is_dir() and not is_model_folder(path):
        found = sorted(p for p in path.iterdir() if (p.is_file() and _is_checkpoint_file(p)) or is_model_folder(p))
        if not found:
            raise CheckpointError(
                f"{path}: the folder holds no checkpoint (looked for {', '.join(TORCH_SUFFIXES)}, .safetensors, "
                "*.index.json files and model folders with config.json); pass the folder that holds them"
            )
        return found
    if path.exists():
        return [path]
    matches = sorted(Path(p) for p in glob.glob(arg)) if glob.has_magic(arg) else []
    if not matches:
        raise CheckpointError(f"{arg}: no such file or folder; check the path (quote globs: 'runs/ckpt_*.pt')")
    return matches


def find_checkpoints(args: Iterable[str]) -> tuple[list[Path], list[tuple[str, CheckpointError]]]:
    """Every checkpoint the arguments name, in argument order, and the arguments that failed."""
    paths: list[Path] = []
    failed: list[tuple[str, CheckpointError]] = []
    for arg in args:
        try:
            paths += [p for p in _expand(str(arg)) if p not in paths]
        except CheckpointError as err:
            failed.append((str(arg), err))
    return paths, failed


def step_from_name(path: Path) -> int | None:
    """The step a name states (see the module docstring), or None: other numbers in a name are no step."""
    name = path.name if path.is_dir() else path.name.split(".")[0]
    match = _NAMED_STEP.search(name)
    if match:
        return int(match.group(1))
    return int(name) if _DIGITS.fullmatch(name) and len(name) <= 18 else None


def step_of(path: Path, ckpt: Checkpoint | None = None) -> tuple[int | None, str]:
    """The training step of a checkpoint and where it was read: ``"metadata"`` (stored with it), ``"name"``, or
    (None, "") when neither holds one. A weights file of a model folder (``checkpoint-500/model.safetensors``)
    has the folder's ``trainer_state.json`` and name. ``ckpt``: the checkpoint, if already open."""
    step = (ckpt or open_checkpoint(path)).stored_step
    if step is None and path.name in WEIGHT_FILES and (path.parent / "trainer_state.json").is_file():
        step = _stored_step(_read_json(path.parent / "trainer_state.json"))
    if step is not None:
        return step, "metadata"
    step = step_from_name(path)
    if step is None and path.name in WEIGHT_FILES:
        step = step_from_name(path.parent)
    return (step, "name") if step is not None else (None, "")


def _int_value(value: Any) -> int | None:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    if isinstance(value, str):
        text = value.strip()
        # ASCII digits only ("²".isdigit() is True but int() refuses it), and not beyond int()'s digit limit
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _stored_step(meta: dict[str, Any]) -> int | None:
    for key in STEP_KEYS:
        if key in meta and _int_value(meta[key]) is not None:
            return _int_value(meta[key])
    return None


def _config(meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    for key in CONFIG_KEYS:
        if isinstance(meta.get(key), dict):
            return dict(meta[key]), key
    return {}, ""


def _config_beside(path: Path) -> tuple[dict[str, Any], str]:
    """A Hugging Face ``config.json`` in the file's folder, if there is one."""
    beside = path.parent / "config.json"
    return (_read_json(beside), "config.json") if beside.is_file() else ({}, "")


def _torch_source(path: Path) -> tuple[TensorSource, dict[str, Any]]:
    """A PyTorch file's tensors and the container's other entries. A zip-format file is loaded again
    (memory-mapped) for each read, so no mapping outlives a read; a legacy one stays as read, whole."""
    state, meta = unwrap_state_dict(load_torch(path), path)
    if not is_zip_format(path):
        return TensorSource.from_dict(state), meta
    return TensorSource.reloading(state, lambda: unwrap_state_dict(load_torch(path), path)[0]), meta


def _open_torch(path: Path) -> Checkpoint:
    tensors, meta = _torch_source(path)
    config, source = _config(meta)
    if not config:
        config, source = _config_beside(path)
    layout = None
    if isinstance(meta.get(LAYOUT_KEY), dict):  # saved inside by the Lightning callback
        layout = parse_layout(meta[LAYOUT_KEY], f"{path} ({LAYOUT_KEY})")
    return Checkpoint(path, "pytorch", tensors, config, source, _stored_step(meta), layout)


def _open_file(path: Path) -> tuple[TensorSource, dict[str, Any]]:
    if path.suffix == ".safetensors":
        return open_safetensors(path)
    return _torch_source(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err}); re-copy or re-write the file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object ({{...}}), found a {type(data).__name__}; pass the "
                              "model's config.json or the checkpoint index it names")
    return data


def _open_sharded(index: Path) -> tuple[TensorSource, dict[str, Any]]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' in the index; expected {{tensor name: shard file}}")
    odd = [v for v in weight_map.values() if not isinstance(v, str) or not v]
    if odd:
        raise CheckpointError(f"{index}: the 'weight_map' names a shard {odd[0]!r}, not a file name; expected "
                              "{tensor name: shard file name}: re-write the index")
    source: TensorSource | None = None
    meta: dict[str, Any] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index}: names the shard {shard!r}, which is missing beside it; copy every shard")
        part, part_meta = _open_file(index.parent / shard)
        source = part if source is None else source.merged(part)
        meta.update(part_meta)
    assert source is not None
    return source, meta


def _open_folder(path: Path) -> Checkpoint:
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    weights = next((path / n for n in WEIGHT_FILES if (path / n).is_file()), None)
    if weights is None:
        indexes = sorted(path.glob("*.index.json"))
        weights = indexes[0] if indexes else None
    if weights is None:
        raise CheckpointError(f"{path}: a model folder without weights; expected one of {list(WEIGHT_FILES)}")
    tensors, meta = _open_sharded(weights) if weights.name.endswith(".index.json") else _open_file(weights)
    step = _stored_step(meta)
    if (path / "trainer_state.json").is_file():
        step = _stored_step(_read_json(path / "trainer_state.json"))
    return Checkpoint(path, "model-folder", tensors, config, "config.json" if config else "", step)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open one checkpoint lazily, with the layouts its run saved; raises :class:`CheckpointError` with one
    clear line."""
    ckpt = _open(Path(path))
    if ckpt.layout is None:
        found = find_layout_file(ckpt.path)
        ckpt.layout = None if found is None else read_layout_file(found, "the run's layout file")
    return ckpt


def _open(path: Path) -> Checkpoint:
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder; check the path")
    if path.is_dir():
        return _open_folder(path)
    if path.name.endswith(".index.json"):
        tensors, meta = _open_sharded(path)
        return Checkpoint(path, "sharded", tensors, *_config_beside(path), _stored_step(meta))
    if path.suffix == ".safetensors":
        tensors, meta = open_safetensors(path)
        return Checkpoint(path, "safetensors", tensors, *_config_beside(path), _stored_step(meta))
    if path.suffix in TORCH_SUFFIXES:
        return _open_torch(path)
    raise CheckpointError(
        f"{path}: unknown checkpoint format {path.suffix!r}; expected {', '.join(TORCH_SUFFIXES)}, .safetensors, "
        "an *.index.json or a model folder"
    )
