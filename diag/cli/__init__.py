"""The command line (`python -m diag`): the only code that imports both ``diag`` and ``hooks``."""

from diag.cli.main import main

__all__ = ["main"]
