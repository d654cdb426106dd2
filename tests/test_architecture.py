"""The direction of imports between the packages (docs/architecture.md#import-directions), read from the source.

Every import statement of every module is checked, function-level imports included, by parsing the source
with ``ast`` (nothing is imported to check it). Each rule names the packages it restricts, what they may
not import and the targets it allows; no rule excuses one place (no whitelist, no shim). The command line
(``diag.cli``) is the whole product's: it stands above ``diag`` and ``hooks`` and may import both; nothing else
in ``diag`` imports ``hooks``. The stages of ``hooks/`` import only stages listed before them (:data:`STAGES`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Attributes that walk or hook a live nn.Module: the pure math never touches a model.
MODULE_WALKING = frozenset({
    "Module", "named_modules", "modules", "named_children", "children", "named_parameters", "parameters",
    "named_buffers", "buffers", "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_module_forward_hook", "register_module_forward_pre_hook",
})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "diag.math.spectral"
    target: str  # the imported module, e.g. "hooks.monitor.monitor" (for ``from a import b``: "a.b" and "a")
    function: str | None  # the enclosing function, None at module level
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source`` (the module ``module``), with the function it sits in, relative imports resolved."""
    out: list[Import] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                out.extend(Import(module, alias.name, function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")
                    anchor = anchor[: len(anchor) - child.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                out.append(Import(module, base, function, child.lineno))
                out.extend(Import(module, f"{base}.{alias.name}", function, child.lineno) for alias in child.names)
            visit(child, inner)

    visit(ast.parse(source), None)
    return out


def sources() -> dict[str, tuple[Path, str]]:
    files = sorted([*ROOT.glob("diag/**/*.py"), *ROOT.glob("hooks/**/*.py")])
    return {module_name(p): (p, p.read_text(encoding="utf-8")) for p in files}


def under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@dataclass(frozen=True)
class Rule:
    """Modules under ``packages`` (but not under ``exempt``) may not import anything under ``forbidden``,
    except ``allowed`` targets. No rule has a sanctioned exception."""

    name: str
    packages: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()

    def violations(self, imports: list[Import]) -> list[str]:
        return [f"{i.module}:{i.line} imports {i.target}" + (f" (in {i.function})" if i.function else "")
                for i in imports
                if under(i.module, *self.packages) and not under(i.module, *self.exempt)
                and under(i.target, *self.forbidden) and not under(i.target, *self.allowed)]


# The rooms of diag below the command line, bottom first; the reports sit above all of them.
BELOW_REPORTS = ("diag.catalog", "diag.math", "diag.layouts", "diag.detectors", "diag.outputs", "diag.offline")
RULES = [
    Rule("the catalog imports nothing of diag but the errors", ("diag.catalog",), ("diag", "hooks"),
         allowed=("diag.catalog", "diag.errors")),
    Rule("the tensor math needs no layout, judgement, output, offline, report, CLI or live code", ("diag.math",),
         ("diag.layouts", "diag.detectors", "diag.outputs", "diag.offline", "diag.reports", "diag.cli", "hooks",
          "torch.nn"), allowed=("torch.nn.functional",)),
    Rule("diag's command line stands above diag and hooks; nothing else in diag imports hooks", ("diag",),
         ("hooks",), exempt=("diag.cli",)),
    Rule("the layouts import no judgement, output, offline, report or CLI code", ("diag.layouts",),
         ("diag.detectors", "diag.outputs", "diag.offline", "diag.reports", "diag.cli")),
    Rule("the outputs import no offline, report, CLI or live code", ("diag.outputs",),
         ("diag.offline", "diag.reports", "diag.cli", "hooks")),
    Rule("nothing below the reports imports them", BELOW_REPORTS, ("diag.reports",)),
    Rule("nothing but the command line imports the CLI", ("diag", "hooks"), ("diag.cli",),
         exempt=("diag.cli", "diag.__main__")),
]
DETECTORS = Rule("the detectors import no sink, output, offline, report, CLI or live code", ("diag.detectors",),
                 ("diag.outputs", "diag.offline", "diag.reports", "diag.cli", "hooks"))

# The stages of hooks/, bottom first: each may import itself and the stages it names, all listed before it (no
# cycle), no other stage, and never the package facade ``hooks`` (which imports them all). Parallelism is the
# bottom stage: what a rank holds of a tensor or a layer's heads, asked by every stage above it.
STAGES = {
    "hooks.parallel": (),
    "hooks.layout": ("hooks.parallel",),
    "hooks.capture": ("hooks.layout",),
    "hooks.monitor": ("hooks.parallel", "hooks.layout", "hooks.capture"),
    "hooks.steplimit": ("hooks.parallel", "hooks.layout", "hooks.capture"),
    "hooks.checkpoint": ("hooks.layout", "hooks.capture"),
    "hooks.integrations": ("hooks.layout", "hooks.capture", "hooks.monitor"),
    "hooks.demo": ("hooks.layout", "hooks.capture", "hooks.monitor", "hooks.steplimit"),
}
STAGE_RULES = [Rule(f"{stage} imports no stage but {', '.join(uses) or 'itself'}", (stage,),
                    tuple(other for other in STAGES if other != stage and other not in uses))
               for stage, uses in STAGES.items()]


def _all_imports() -> list[Import]:
    return [i for name, (path, text) in sources().items()
            for i in imports_of(text, name, is_package=path.name == "__init__.py")]


def _check(rule: Rule) -> None:
    bad = rule.violations(_all_imports())
    assert not bad, f"{rule.name}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_import_directions(rule):
    _check(rule)


def test_detectors_import_no_sink():
    _check(DETECTORS)


@pytest.mark.parametrize("rule", STAGE_RULES, ids=lambda r: r.name)
def test_the_stages_of_hooks_import_in_order(rule):
    _check(rule)


def test_each_stage_uses_only_stages_below_it():
    """The order of :data:`STAGES` is the import order: no stage may name one listed after it, so no two stages
    can import each other."""
    order = list(STAGES)
    above = {stage: [u for u in uses if order.index(u) >= order.index(stage)] for stage, uses in STAGES.items()}
    assert all(not names for names in above.values()), above


def _stage_of(module: str) -> str | None:
    return next((stage for stage in STAGES if under(module, stage)), None)


def test_every_module_of_hooks_has_a_stage_and_none_imports_the_facade():
    """A new module of hooks/ is placed in a stage (or the rules above do not see it); a stage that imported
    ``hooks`` itself would import every stage through it."""
    names = [n for n in sources() if under(n, "hooks") and n != "hooks"]
    assert [n for n in names if _stage_of(n) is None] == []
    facade = [f"{i.module}:{i.line}" for i in _all_imports() if _stage_of(i.module) and i.target == "hooks"]
    assert facade == [], f"a stage imports the hooks facade: {facade}"


def _may_import_the_reports(i: Import) -> bool:
    """The command line, the ``diag`` facade (``diag.write_report``), and the Monitor's ``write_report`` inside a
    function (handed to the sinks that log the run report at close; importing ``hooks`` imports no report code)."""
    return under(i.module, "diag.cli", "diag.reports") or i.module == "diag" or (
        i.module == "hooks.monitor.monitor" and i.function is not None)


def test_the_reports_are_imported_by_the_command_line_the_facade_and_the_monitor_only():
    seen = [i for i in _all_imports() if under(i.target, "diag.reports")]
    bad = [f"{i.module}:{i.line} imports {i.target}" + (f" (in {i.function})" if i.function else "")
           for i in seen if not _may_import_the_reports(i)]
    assert not bad, bad
    assert {i.module for i in seen if i.module.startswith("hooks")} == {"hooks.monitor.monitor"}
    eager = imports_of("from diag.reports.run import write_run_report\n", "hooks.monitor.monitor")
    assert not any(map(_may_import_the_reports, eager)), "a module-level import in the Monitor is caught"


def test_the_math_walks_no_module():
    """No nn.Module attribute (``.named_modules()``, ``.parameters()``, hooks, ``nn.Module``) in diag/math."""
    bad = []
    for name, (_, text) in sources().items():
        if under(name, "diag.math"):
            bad += [f"{name}:{node.lineno} .{node.attr}" for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.Attribute) and node.attr in MODULE_WALKING]
    assert not bad, bad


def test_the_checker_sees_every_kind_of_forbidden_import():
    """A forbidden import added anywhere (module level, inside a function, relative) is caught."""
    math = next(r for r in RULES if under("diag.math", *r.packages) and "torch.nn" in r.forbidden)
    samples = {
        "from hooks.monitor.monitor import Monitor\n": "hooks.monitor.monitor",
        "def f():\n    import hooks\n": "hooks",
        "class A:\n    def g(self):\n        from ..outputs import sinks\n": "diag.outputs.sinks",
        "import torch.nn as nn\n": "torch.nn",
    }
    for source, target in samples.items():
        found = math.violations(imports_of(source, "diag.math.spectral"))
        assert any(f"imports {target}" in v for v in found), (source, found)
    assert not math.violations(imports_of("import torch.nn.functional as F\n", "diag.math.x"))
    no_hooks = next(r for r in RULES if r.forbidden == ("hooks",))
    lazy = "def __getattr__(name):\n    from hooks.steplimit import SpectralStepLimit\n"  # a lazy import is one too
    assert no_hooks.violations(imports_of(lazy, "diag", is_package=True))
    assert no_hooks.violations(imports_of("import hooks.demo\n", "diag.offline.series"))
    assert not no_hooks.violations(imports_of("import hooks.demo\n", "diag.cli.demo"))
    assert DETECTORS.violations(imports_of("from diag.outputs.sinks import FanOut\n", "diag.detectors.x"))
    outputs_tags = "from diag.outputs.tags import head_label\n"  # a detector importing from the outputs
    assert DETECTORS.violations(imports_of(outputs_tags, "diag.detectors.x"))
    assert not DETECTORS.violations(imports_of("from diag.catalog.tags import head_label\n", "diag.detectors.x"))
    layouts = next(r for r in RULES if r.packages == ("diag.layouts",))
    assert layouts.violations(imports_of("from diag.detectors import Alert\n", "diag.layouts.vocab"))
    assert layouts.violations(imports_of(outputs_tags, "diag.layouts.statedict"))
    catalog = RULES[0]
    assert catalog.violations(imports_of("from diag.math.spectral import stable_rank\n", "diag.catalog.metrics"))
    assert catalog.violations(imports_of("from ..outputs import sinks\n", "diag.catalog.tags"))
    assert not catalog.violations(imports_of("from diag.errors import ConfigError\n", "diag.catalog.metrics"))
    assert not catalog.violations(imports_of("from diag.catalog.metrics import METRICS\n", "diag.catalog.tags"))
    capture = next(r for r in STAGE_RULES if r.packages == ("hooks.capture",))
    assert capture.violations(imports_of("from hooks.monitor.cadence import Cadence\n", "hooks.capture.capture"))
    assert not capture.violations(imports_of("from hooks.layout.confirm import check_call\n", "hooks.capture.x"))
    parallel = next(r for r in STAGE_RULES if r.packages == ("hooks.parallel",))
    assert parallel.violations(imports_of("from hooks.layout.discover import AttentionLayer\n", "hooks.parallel.x"))
    layout = next(r for r in STAGE_RULES if r.packages == ("hooks.layout",))
    assert layout.violations(imports_of("def f():\n    from ..capture import kernels\n", "hooks.layout.read"))


def test_every_module_is_checked():
    names = set(sources())
    for package in ("diag.catalog", "diag.math", "diag.layouts", "diag.detectors", "diag.outputs", "diag.offline",
                    "diag.reports", "diag.cli", *STAGES):
        assert any(under(n, package) for n in names), package  # a stage may be one module (hooks.steplimit)
