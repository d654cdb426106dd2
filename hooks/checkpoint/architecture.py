"""The transformers class a ``config.json`` names: one reading of ``architectures[0]`` for every caller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["architecture"]


def architecture(config: Mapping[str, Any]) -> tuple[Any, type | None]:
    """``architectures[0]`` of a config.json (None without one) and the built-in transformers model class it
    names, or None where it names none (an unknown name, or a class that is not a ``PreTrainedModel``): never
    code from the checkpoint's folder."""
    import transformers

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, str(arch), None) if arch else None
    return arch, (cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None)
