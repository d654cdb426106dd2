"""Every public name the README and docs/*.md show imports: ``from diag import X`` and ``from hooks import Y``
in code blocks, and dotted names such as ``diag.math.norms.Sigma1`` in code blocks and inline code."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
FROM = re.compile(r"from\s+((?:diag|hooks)(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)")
DOTTED = re.compile(r"(?<![\w./-])((?:diag|hooks)(?:\.\w+)+)")
# Optional frameworks: a name under these modules is checked only where the framework is installed.
OPTIONAL = {"hooks.integrations.hf": "transformers", "hooks.integrations.lightning": "lightning"}


def references() -> list[tuple[str, str, tuple[str, ...]]]:
    """(file, module or dotted name, imported names) of every reference, sorted, without repeats."""
    refs: set[tuple[str, str, tuple[str, ...]]] = set()
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        code = "\n".join(FENCE.findall(text))
        for m in FROM.finditer(code):
            statement = ast.parse(m.group(0).strip()).body[0]  # the names, without ``as`` aliases
            refs.add((path.name, m.group(1), tuple(alias.name for alias in statement.names)))
        for m in DOTTED.finditer(code + "\n" + "\n".join(INLINE.findall(FENCE.sub("", text)))):
            refs.add((path.name, m.group(1), ()))
    return sorted(refs)


def resolve(dotted: str) -> object:
    """The object a dotted name means: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not err.name.startswith(("diag", "hooks")):
                raise  # a missing dependency, not a missing name
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


REFS = references()


def test_the_docs_name_many_things():
    assert len(REFS) >= 30, REFS  # the scan itself works (a broken regex would pass everything below)
    assert any(module == "hooks" and "Monitor" in names for _, module, names in REFS)


@pytest.mark.parametrize(("page", "name", "names"), REFS, ids=[f"{p}:{n}:{','.join(ns)}" for p, n, ns in REFS])
def test_documented_name_imports(page, name, names):
    for prefix, framework in OPTIONAL.items():
        if name.startswith(prefix):
            pytest.importorskip(framework)
    if name.endswith(".__main__"):  # importing it would run the command line: that it exists is enough
        assert importlib.util.find_spec(name) is not None, name
        return
    if names:
        module = importlib.import_module(name)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{page}: from {name} import {', '.join(missing)} fails"
    else:
        resolve(name)


PATH = re.compile(r"(?<![\w./-])((?:diag|hooks|tests|examples|benchmarks)/[\w./-]*\w)")


def test_documented_paths_exist():
    """Every ``diag/...``, ``hooks/...``, ``tests/...`` path the README and docs name exists (no stale paths
    after a move)."""
    missing = [(path.name, m.group(1)) for path in FILES
               for m in PATH.finditer(path.read_text(encoding="utf-8")) if not (ROOT / m.group(1)).exists()]
    assert not missing, missing


def test_each_public_name_has_one_home():
    """``diag`` exports the pure names, ``hooks`` the live ones: no name is exported by both, and each imports."""
    import diag
    import hooks

    assert not set(diag.__all__) & set(hooks.__all__)
    for package in (diag, hooks):
        assert all(hasattr(package, name) for name in package.__all__), package.__name__
