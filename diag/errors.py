"""One exception family for the whole toolkit, and the one way a fault is reported without raising.

Every error names the thing that was wrong, what was seen, what was expected and
the fix, so that a user can act on the message alone. A fault that must not stop
training (a sink that fails, a signal that cannot be computed) is reported once per
kind through :class:`WarnOnce`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable

__all__ = ["DiagError", "SpecError", "ConfigError", "SinkError", "WarnOnce"]


class DiagError(Exception):
    """Base class of every error raised on purpose by ``diag`` and ``hooks``."""


class SpecError(DiagError):
    """An attention layout could not be found, or disagrees with the model."""


class ConfigError(DiagError, ValueError):
    """An argument or configuration value is out of its allowed range."""


class SinkError(DiagError):
    """An output (TensorBoard, JSONL, ...) cannot be opened or written."""


class WarnOnce:
    """``warn(kind, message)`` reports ``message`` the first time ``kind`` is seen, as a ``RuntimeWarning``
    (``stacklevel`` counted from the caller of ``warn``, as for ``warnings.warn``) and, when logging is
    configured (``logger.hasHandlers()``), on ``logger`` at ``level``: one console line either way. Later
    calls with the same kind are silent. Returns whether it reported.
    ``seen`` holds the kinds reported so far."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, stacklevel: int = 2) -> None:
        self.logger, self.level, self.stacklevel = logger, level, stacklevel
        self.seen: set[Hashable] = set()

    def __call__(self, kind: Hashable, message: str) -> bool:
        if kind in self.seen:
            return False
        self.seen.add(kind)
        if self.logger.hasHandlers():  # logging is configured: the record goes to its handlers ...
            self.logger.log(self.level, message)
        # ... and the warning is printed once by Python's warnings machinery; with logging left unconfigured
        # the record would be printed a second time by logging's last-resort handler, so it is not logged then
        warnings.warn(message, RuntimeWarning, stacklevel=self.stacklevel + 1)
        return True
