"""One exception family for the whole toolkit.

Every error names the thing that was wrong, what was seen, what was expected and
the fix, so that a user can act on the message alone.
"""

from __future__ import annotations

__all__ = ["DiagError", "SpecError", "ConfigError", "SinkError"]


class DiagError(Exception):
    """Base class of every error raised on purpose by ``diag`` and ``hooks``."""


class SpecError(DiagError):
    """An attention layout could not be found, or disagrees with the model."""


class ConfigError(DiagError, ValueError):
    """An argument or configuration value is out of its allowed range."""


class SinkError(DiagError):
    """An output (TensorBoard, JSONL, ...) cannot be opened or written."""
