"""The code blocks of the docs, for the tests that run them as a user would copy them (tests only)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_block(page: str, after: str) -> str:
    """The first ```python block of ``docs/<page>`` after the text ``after``."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    start = text.index(after)
    found = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert found, f"no python block after {after!r} in docs/{page}"
    return found.group(1)


def filled(code: str, placeholder: str, replacement: str) -> str:
    """``code`` with the line that starts with ``placeholder`` (a ``...`` the user fills in) replaced, indented as it
    was."""
    lines = code.splitlines()
    hits = [i for i, line in enumerate(lines) if line.lstrip().startswith(placeholder)]
    assert len(hits) == 1, f"{placeholder!r} is on {len(hits)} lines of the snippet"
    indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
    lines[hits[0]: hits[0] + 1] = [indent + line for line in replacement.splitlines()]
    return "\n".join(lines) + "\n"
