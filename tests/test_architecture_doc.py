"""docs/architecture.md names only what exists, and names every module; the other pages name only what exists.

Read from the pages and the source (``ast``: nothing is imported to check it):

* every path the page gives (``diag/...``, ``hooks/...``, ``evaluation/...``, ``tests/...``, ``benchmarks/...``,
  ``examples/...``: a file or a package folder) exists;
* every file name in code (``lossmean.py``, ``layout/book.py``) is a file of the repository;
* every dotted name of ``diag``, ``hooks`` or ``evaluation`` (``hooks.monitor.sampling.Sampler.measure``) is
  defined where it says, and every ``Class.member`` of a class the code defines is a member of it;
* the tree at the top of docs/architecture.md lists every module of ``diag/``, ``hooks/`` and ``evaluation/``
  under its folder, and every file it lists exists;
* the stages of ``hooks/`` and what each may import are those ``tests/test_architecture.py`` enforces, in its order.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.test_architecture import STAGES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("diag", "hooks", "evaluation")
FOLDERS = (*PACKAGES, "tests", "benchmarks", "examples")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(FOLDERS)})/[\w/]*(?:\.\w+)?)")
TREE_FILE = re.compile(r"(?<![\w/.])([\w/]+\.py)\b")


def code_spans(text: str) -> list[str]:
    """The inline code of ``text``, fenced blocks left out."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def tree_paths(text: str) -> tuple[set[str], set[str]]:
    """(files, folders) the first fenced block lists: a line at indent 0 names a package (``diag/``), one at
    indent 2 a folder of it (``monitor/``) or a file (``errors.py``); a file name on a line (or on the lines that
    continue it) is in that folder, or in the package where it has a folder of its own (``cli/main.py``)."""
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    files: set[str] = set()
    folders: set[str] = set()
    root = folder = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, first = len(line) - len(line.lstrip(" ")), line.split()[0]
        if indent == 0:
            root = folder = first
            folders.add(first)
        elif indent == 2:
            folder = root + first if first.endswith("/") else root
            folders.add(folder)
        for name in TREE_FILE.findall(line):
            files.add(name if name.split("/")[0] in FOLDERS else folder + name)
    return files, folders


def modules() -> set[str]:
    """Every module file of diag/, hooks/ and evaluation/ (no ``__init__.py``), relative to the repository."""
    return {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*.py")
            if p.name != "__init__.py"}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _module_file(dotted: str) -> Path | None:
    base = ROOT / Path(*dotted.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _defined(path: Path, name: str, depth: int = 0) -> ast.AST | None:
    """The top-level definition of ``name`` in the module at ``path``, following ``from x import name``."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    for node in _tree(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.ImportFrom) and depth < 5:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        source = ".".join([*anchor, source] if source else anchor)
                    found = _module_file(source)
                    return None if found is None else (_defined(found, alias.name, depth + 1) or node)
    return None


def _members(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods, class attributes and fields, and the ``self.x`` its methods set."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            names.update(t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                         for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                         for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def dotted_problem(name: str) -> str | None:
    """Why ``name`` (``package.module.Name.member``) is not defined where it says, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is not None:
            break
    else:
        return f"{name}: no module {parts[0]}"
    rest = parts[cut:]
    if not rest:
        return None
    node = _defined(path, rest[0])
    if node is None:
        return f"{name}: {path.relative_to(ROOT)} defines no {rest[0]}"
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in _members(node):
        return f"{name}: {rest[0]} has no member {rest[1]}"
    return None


@cache
def classes() -> dict[str, set[str]]:
    """Every class of diag/, hooks/ and evaluation/ by name: its members (the union where two share a name)."""
    out: dict[str, set[str]] = {}
    for module in modules() | {f"{p}/__init__.py" for p in PACKAGES}:
        for node in ast.walk(_tree(ROOT / module)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, set()).update(_members(node))
    return out


def problems(text: str, tree: bool = True) -> list[str]:
    """Every name on a page (``text``) that the repository does not have, each with what is wrong; ``tree``: the
    page's first fenced block is its tree (docs/architecture.md)."""
    out = [f"{p}: no such file or folder" for p in sorted(set(PATH.findall(text)))
           if not (ROOT / p.rstrip("/.")).exists()]
    if tree:
        files, folders = tree_paths(text)
        out += [f"{p} (in the tree): no such file or folder" for p in sorted(files | folders)
                if not (ROOT / p).exists()]
    known = classes()
    for span in sorted(set(code_spans(text))):
        if re.fullmatch(r"[\w./-]+\.py", span) and not span.startswith(FOLDERS):
            where = [ROOT / span, *(ROOT / folder / span for folder in FOLDERS)]
            if not any(p.is_file() for p in where) and not any(any(ROOT.glob(f"{f}/**/{span}")) for f in FOLDERS):
                out.append(f"{span}: no such file in {', '.join(FOLDERS)}")
        elif re.fullmatch(rf"(?:{'|'.join(PACKAGES)})(?:\.\w+)+", span):
            problem = dotted_problem(span)
            if problem:
                out.append(problem)
        elif (m := re.fullmatch(r"([A-Z]\w*)\.(\w+)", span)) and m[1] in known and m[2] not in known[m[1]]:
            out.append(f"{span}: {m[1]} has no member {m[2]}")
    return out


def unlisted(text: str) -> list[str]:
    """The modules of diag/, hooks/ and evaluation/ that the page's tree does not list."""
    return sorted(modules() - tree_paths(text)[0])


def stages_stated(text: str) -> dict[str, tuple[str, ...]]:
    """The stages of hooks/ in the order the page's import rules give them, each with the stages it may import."""
    bullet = re.search(r"^\* The stages of `hooks/`.*?(?=^\S|^\* |\Z)", text, re.S | re.M).group(0)
    out = {}
    for stage, uses in re.findall(r"`(\w+)`\s+\(([^)]*)\)", bullet):
        names = () if uses.startswith("nothing") else re.split(r",\s+", uses)
        out[f"hooks.{stage}"] = tuple(f"hooks.{name}" for name in names)
    return out


def test_every_name_on_the_page_exists():
    assert problems(DOC.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"], ids=lambda p: p.name)
def test_every_name_in_the_docs_exists(page):
    """The other pages name modules, classes and test files too: each one exists where they say."""
    assert problems(page.read_text(encoding="utf-8"), tree=False) == []


def test_the_tree_lists_every_module():
    assert unlisted(DOC.read_text(encoding="utf-8")) == []


def test_the_page_states_the_stages_the_architecture_test_enforces():
    stated = stages_stated(DOC.read_text(encoding="utf-8"))
    assert list(stated.items()) == list(STAGES.items())


def test_the_checks_catch_a_missing_file_a_stale_name_and_an_unlisted_module():
    sample = (
        "```\n"
        "diag/                    the core\n"
        "  errors.py              the errors\n"
        "  math/                  spectral.py, gone.py\n"
        "hooks/                   the live side\n"
        "  monitor/               monitor.py, distributed.py\n"
        "```\n\n"
        "`hooks/monitor/distributed.py`, `lossmean.py`, `warning.py`, `diag/nowhere/`, `tests/hooks/test_gone.py`,\n"
        "`hooks.parallel.detectors.CriticalStop`, `hooks.monitor.monitor.Monitor.sample_step`, `diag.nothing`,\n"
        "`Monitor.any_rank`, `hooks.monitor.sampling.Sampler.measure`, `Detectors.observe_updates`.\n"
        "* The stages of `hooks/` import: `parallel` (nothing), `layout` (parallel), `capture` (layout).\n"
    )
    found = "\n".join(problems(sample))
    for name in ("diag/math/gone.py", "hooks/monitor/distributed.py", "warning.py", "diag/nowhere/",
                 "tests/hooks/test_gone.py", "CriticalStop", "sample_step", "diag.nothing", "any_rank"):
        assert name in found, (name, found)
    for name in ("lossmean.py", "Sampler.measure", "observe_updates", "diag/errors.py", "spectral.py"):
        assert name not in found, (name, found)
    missing = unlisted(sample)
    assert "hooks/monitor/lossmean.py" in missing and "evaluation/spec.py" in missing
    assert "diag/math/spectral.py" not in missing and "hooks/monitor/monitor.py" not in missing
    assert stages_stated(sample) == {"hooks.parallel": (), "hooks.layout": ("hooks.parallel",),
                                     "hooks.capture": ("hooks.layout",)}
