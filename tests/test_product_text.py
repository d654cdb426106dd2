"""The product says what it is, not how it came to be: no issue numbers and no account of the rounds of work that
changed a value, in the code and docs of ``diag/``, ``hooks/``, ``evaluation/``, ``docs/``, ``README.md``, in the
comments and docstrings of ``tests/``, ``benchmarks/``, ``examples/``, and in the names of the tests (files,
functions, classes). History is what ``git log`` is for.

Each pattern below is one that product language never needs, so a hit is always a sentence to rewrite (say
what the code does and why) or delete. Every hit is reported as ``file:line: text``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["diag", "hooks", "evaluation", "docs", "README.md", "tests", "benchmarks", "examples"]
SUFFIXES = {".py", ".md", ".json", ".toml", ".txt", ".yml", ".yaml", ".sh"}
THIS = Path(__file__).resolve()

_ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(?:st|nd|rd|th))")
_NUMBER = r"(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)"

# (what it is, pattern): case-insensitive, matched against one line at a time
HISTORY = [
    ("an issue number", r"\bissues?[\s_-]*#?\s*\d"),
    ("an issue reference", r"(?<![\w&:\"'#/{-])#\d{1,3}(?![\w.-])"),
    ("a round of work", rf"\b{_ORDINAL}[\s_-]+(?:session|report[\s_-]+set|round[\s_-]+of[\s_-]+(?:work|review))s?\b"),
    ("a round of work", rf"\b(?:session|report[\s_-]+set)[\s_-]+{_NUMBER}\b"),
    ("a value's history", r"\bwas\s+-?\d[\d.e-]*\s+until\b"),
    ("a value's history", r"\buntil\s+(?:issue|session|the\s+\w+\s+(?:session|round|report\s+set))\b"),
    ("a value's history", r"\buntil\s+\d{4}-\d\d-\d\d\b"),
    ("a change narrated", r"\bchanged\s+(?:with|in|by)\s+(?:issue|the\s+\w+\s+(?:session|round|report\s+set))\b"),
    ("a change narrated", r"\bthe\s+old\s+(?:assertion|code|behaviou?r|default|value|line|test)\b"),
    ("a change narrated", r"\b(?:formerly|previously)\b"),
]
COMPILED = [(what, re.compile(pattern, re.I)) for what, pattern in HISTORY]


def hits_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) of every line of ``text`` that narrates the project's history."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in COMPILED:
            if pattern.search(line):
                found.append((number, what, line.strip()))
                break
    return found


def product_files() -> list[Path]:
    files = []
    for name in PRODUCT:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                      and "__pycache__" not in p.parts and p.resolve() != THIS]
    return files


def names_of_tests(path: Path) -> list[tuple[int, str]]:
    """(line, name) of the test file's own name and of every test function and class in it, words spaced."""
    names = [(1, path.stem)]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append((node.lineno, node.name))
    return [(line, name.replace("_", " ")) for line, name in names]


def report(hits: list[str]) -> str:
    return f"{len(hits)} place(s) narrate the project's history; say what the code does and why:\n" + "\n".join(hits)


def test_no_file_of_the_product_narrates_its_history():
    hits = [f"{path.relative_to(ROOT)}:{n}: {what}: {line}" for path in product_files()
            for n, what, line in hits_in(path.read_text(encoding="utf-8", errors="replace"))]
    assert not hits, report(hits)


def test_no_test_is_named_after_the_history_of_the_project():
    hits = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for line, name in names_of_tests(path):
            hits += [f"{path.relative_to(ROOT)}:{line}: {what}: {name}" for _, what, _ in hits_in(name)]
    assert not hits, report(hits)


@pytest.mark.parametrize("text", [
    "# 0.12 until " + "iss" + "ue #" + "31's eleventh " + "session: the edge of the plateaus",
    "The fifth report" + " set's missed collapse, rebuilt",
    "Changed with " + "iss" + "ue #" + "17: this asserted a collapse_warning",
    "the per-layer charts read the per-layer runs (" + "#18)",
    "plateau_rel: was 0.05" + " until the" + " third round",
    "refused as a suspect head split (until 2026" + "-12-02)",
    "the step the old" + " assertion named",
    "test eighth " + "report set miss",
    "eleventh " + "session",
])
def test_the_guard_catches_history(text):
    assert hits_in(text), text


@pytest.mark.parametrize("text", [
    "color:#222}figcaption{color:#555}",
    'GREY = "#808080"',
    "docs/alerts.md#defaults",
    "each round trains --every steps per window; a JSON round trip",
    "the head was inside the state until step 140",
    "a head no longer in the state resolves its episode",
    "the previous checkpoint; an earlier run in the folder",
    "issues no tensor operation on a non-sampled step",
    "seeds 210-219 of the evaluation's report runs",
])
def test_the_guard_passes_product_language(text):
    assert not hits_in(text), text
