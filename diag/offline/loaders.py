"""Reading tensors from checkpoint files lazily, without ever running code from them.

* PyTorch ``.pt``/``.pth``/``.bin``/``.ckpt``: ``torch.load(weights_only=True, mmap=True)``
  (tensors stay on disk until read; files in the legacy non-zip format are read
  whole). A pickle that names anything but tensors and plain containers is
  refused by PyTorch's weights-only unpickler before any of it runs.
* ``.safetensors``: ``safetensors.safe_open``: shapes from the header, a tensor is
  read only when asked for, with ``pread`` where safetensors has it (no mapping of
  the file).

A :class:`TensorSource` maps clean names (``module.`` and ``_orig_mod.`` removed)
to shapes and tensors, whatever the file format. Memory stays with what the caller
holds: a tensor read is the caller's own copy, and no mapping of the file grows with
what was read (the pages of a memory-mapped file count in a process's resident memory
as long as the mapping lives, so a 70B checkpoint read layer by layer through one
mapping would end with all of its attention weights resident). A zip-format PyTorch file is
therefore loaded again (memory-mapped, only its pickle parsed) for each :meth:`TensorSource.read`,
and the mapping dropped after the copy.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diag.errors import DiagError

__all__ = ["CheckpointError", "TensorSource", "clean_key", "is_zip_format", "load_torch", "open_safetensors",
           "unwrap_state_dict"]

# Containers that wrap a state dict, in the order they are tried.
STATE_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network")
_PREFIX = re.compile(r"^(?:module\.|_orig_mod\.)+")


class CheckpointError(DiagError):
    """A checkpoint is missing, unreadable, unsafe, or holds no recognisable attention."""


def clean_key(key: str) -> str:
    """Drop DDP's ``module.`` and torch.compile's ``_orig_mod.`` wherever they sit."""
    return _PREFIX.sub("", key).replace("._orig_mod.", ".")


ReadMany = Callable[[list[str]], dict[str, Tensor]]


class TensorSource:
    """Names -> (shape, reader); tensors are read only when :meth:`read` or :meth:`get` asks for them."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: ReadMany) -> None:
        self.shapes, self._read = shapes, read

    @classmethod
    def from_dict(cls, tensors: Mapping[str, Tensor]) -> TensorSource:
        table = _table(tensors)
        return cls({k: tuple(v.shape) for k, v in table.items()}, lambda names: {n: table[n] for n in names})

    @classmethod
    def reloading(cls, tensors: Mapping[str, Tensor], load: Callable[[], Mapping[str, Tensor]]) -> TensorSource:
        """Shapes from ``tensors`` (then dropped); each :meth:`read` calls ``load()`` (a memory-mapped state
        dict) and copies out what it asks for, so the mapping lives only as long as the read."""

        def read(names: list[str]) -> dict[str, Tensor]:
            table = _table(load())
            return {n: table[n].clone() for n in names}

        return cls({k: tuple(v.shape) for k, v in _table(tensors).items()}, read)

    def merged(self, other: TensorSource) -> TensorSource:
        shapes = {**self.shapes, **other.shapes}

        def read(names: list[str]) -> dict[str, Tensor]:
            mine = [n for n in names if n in self.shapes]
            return {**self.read(mine), **other.read([n for n in names if n not in self.shapes])}

        return TensorSource(shapes, read)

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named tensors (one opening of the file for all of them where the format reopens)."""
        names = list(dict.fromkeys(names))
        return self._read(names) if names else {}

    def get(self, name: str) -> Tensor:
        return self.read([name])[name]


def _table(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {clean_key(str(k)): v for k, v in tensors.items() if isinstance(v, Tensor)}  # pickles allow int keys


def _refused(path: Path) -> CheckpointError:
    return CheckpointError(
        f"refused: {path} holds pickled code or objects that are not plain tensors; only weights-only "
        "checkpoints are loaded, and none of its code was run. Re-save it as a plain state dict "
        "(torch.save(model.state_dict(), ...)) or as .safetensors"
    )


def _unsafe(message: str, path: Path) -> bool:
    """The weights-only unpickler stopped at a global (code or an object) or at a real pickle it cannot read.

    Garbage bytes also stop it ("Unsupported operand"); a pickle starts with the PROTO opcode.
    """
    if "Weights only load failed" not in message:
        return False
    if "global" in message.lower():
        return True
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def is_zip_format(path: Path) -> bool:
    """Whether ``torch.save`` wrote the file in its zip format (the default since torch 1.6), which
    ``torch.load`` can memory-map; the legacy format is read whole."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"PK"
    except OSError:
        return False


def load_torch(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True``; mmap when the file's format allows it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a plain pickle.dump file
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap can only be used" not in str(err):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # legacy format: read whole
    except pickle.UnpicklingError as err:
        if _unsafe(str(err), path):
            raise _refused(path) from None
        raise _corrupt(path, err) from None
    except Exception as err:  # noqa: BLE001 - garbage bytes raise anything (struct.error, EOFError, ...)
        raise _corrupt(path, err) from None


def _corrupt(path: Path, err: BaseException) -> CheckpointError:
    why = _what_is_wrong(path, err)
    return CheckpointError(
        f"{path}: cannot be read as a PyTorch checkpoint ({why}); the file is truncated or corrupt, "
        "or not a checkpoint: re-copy or re-save it"
    )


def _what_is_wrong(path: Path, err: BaseException) -> str:
    """What is wrong with a file torch.load cannot read, in words, never cut mid-sentence."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(max(0, path.stat().st_size - 65_536))
            tail = f.read()
    except OSError:
        head = tail = b""
    if head and not head.startswith((b"PK", b"\x80")):  # neither a zip archive nor a pickle
        shown = head.decode("ascii", "replace").replace("\n", " ").strip() or repr(head)
        return f"it starts with {shown!r}: not a zip archive or a pickle, so not a file torch.save wrote"
    text = str(err)
    if head.startswith(b"PK") and b"PK\x05\x06" not in tail or "central directory" in text:
        return "its zip archive has no central directory: the file is cut short"
    first = text.split(". ")[0].splitlines()[0] if text else type(err).__name__
    return first.rstrip(".")


def _has_tensors(obj: Any) -> bool:
    return isinstance(obj, Mapping) and any(isinstance(v, Tensor) for v in obj.values())


def unwrap_state_dict(obj: Any, path: Path) -> tuple[Mapping[str, Tensor], dict[str, Any]]:
    """The state dict inside a loaded checkpoint, and the container's other entries.

    Accepts a bare state dict, ``{"model": sd}``, ``{"state_dict": sd}``,
    ``{"model_state_dict": sd}`` (one level of nesting more is also looked into),
    and nanoGPT's ``{"model": sd, "model_args": {...}, "iter_num": N}``.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{path}: holds a {type(obj).__name__}, not a state dict; save model.state_dict() instead "
            "of the model object"
        )
    for key in STATE_KEYS:
        inner = obj.get(key)
        if _has_tensors(inner):
            return inner, {k: v for k, v in obj.items() if k != key}
        if isinstance(inner, Mapping):
            for key2 in STATE_KEYS:
                if _has_tensors(inner.get(key2)):
                    return inner[key2], {k: v for k, v in obj.items() if k != key}
    tensors = sum(isinstance(v, Tensor) for v in obj.values())
    if tensors and tensors * 2 >= len(obj):
        return obj, {}
    raise CheckpointError(
        f"{path}: no state dict found; top-level keys {sorted(map(str, obj))[:8]}; expected tensors, or "
        f"one of {list(STATE_KEYS)} holding them"
    )


def open_safetensors(path: Path) -> tuple[TensorSource, dict[str, str]]:
    """Shapes from the header now, tensors memory-mapped on demand; and the file's metadata."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:  # pragma: no cover - an optional dependency
        raise CheckpointError(f"{path}: reading .safetensors needs `pip install safetensors`") from err
    try:
        handle = _safe_open(safe_open, path)
        names = list(handle.keys())
        shapes = {clean_key(n): tuple(handle.get_slice(n).get_shape()) for n in names}
        meta = dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path}: cannot be read as safetensors ({str(err)[:160]}); the file is truncated or corrupt: "
            "re-copy or re-save it"
        ) from None
    raw = {clean_key(n): n for n in names}
    return TensorSource(shapes, lambda wanted: {k: handle.get_tensor(raw[k]) for k in wanted}), meta


def _safe_open(safe_open: Any, path: Path) -> Any:
    """The file opened for ``pread`` reads where this safetensors has them (0.7 and later): a tensor read is
    a copy and nothing of the file stays mapped; else memory-mapped."""
    try:
        return safe_open(str(path), framework="pt", device="cpu", backend="pread")
    except TypeError:  # pragma: no cover - safetensors without the backend option
        return safe_open(str(path), framework="pt", device="cpu")
