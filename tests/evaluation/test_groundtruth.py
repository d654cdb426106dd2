"""The ground truth of the attention states (evaluation/groundtruth.py) on hand-labelled attention maps, and its
independence from the detectors.

Each map below is built by hand so that its state follows from the words of the definition (Qi et al.'s
matrices: C, every query on the same key; B, the identity; A, uniform), measured by evaluation.maps.measure as a
recording measures it, and judged at the definition's defaults. The episodes over time are hand-labelled
sequences of such samples."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evaluation.groundtruth import Definition, Episode, episodes, head_name, head_states, smooth
from evaluation.maps import Maps, measure

ROOT = Path(__file__).resolve().parents[2]
T = 64  # queries and keys of the hand-built maps
SEQS = 3


def causal_rows(weights: np.ndarray) -> torch.Tensor:
    """(S, T, T) maps from (S, T, T) non-negative weights: masked causally, each row normalised."""
    w = torch.tensor(weights, dtype=torch.float64) * torch.ones(T, T, dtype=torch.float64).tril()
    return (w / w.sum(-1, keepdim=True)).float()


def pointer(keys_of_sequence) -> torch.Tensor:
    """Sequence s: every query that sees them puts its mass on the keys ``keys_of_sequence(s)`` (equally); a
    query that sees none of them, on itself."""
    w = np.zeros((SEQS, T, T))
    for s in range(SEQS):
        keys = keys_of_sequence(s)
        for i in range(T):
            seen = [k for k in keys if k <= i]
            for k in seen or [i]:
                w[s, i, k] = 1.0
    return causal_rows(w)


MAPS = {  # one head's maps (S, T, T) and the state they are in, by the words of the definition
    "malignant": pointer(lambda s: [1 + s, 2 + s]),  # every query on the same 2 keys, not shared by the sequences
    "sink": pointer(lambda s: [0]),  # Qi et al.'s C: every query on key 0, in every sequence
    "benign": pointer(lambda s: []),  # Qi et al.'s B: each query on itself (the identity)
    "uniform": causal_rows(np.ones((SEQS, T, T))),  # Qi et al.'s A: each query spread evenly over what it sees
    "none": causal_rows(np.exp(np.random.default_rng(0).normal(0, 1.5, (SEQS, T, T)))),  # spread, not evenly
}


def maps_of(heads_per_step: list[list[torch.Tensor]], steps=None, label: str = "L00") -> Maps:
    """A recording of one layer: per step, each head's maps (S, T, T), measured as evaluation.maps does."""
    got = [measure(torch.stack(heads, 1), causal=True) for heads in heads_per_step]  # each (S, H, T, T)
    stack = {k: {label: np.stack([g[k].float().numpy() for g in got])} for k in got[0]}
    steps = np.arange(len(got)) if steps is None else np.asarray(steps)
    return Maps(steps, stack["focused"], stack["columns"], stack["even"], stack["shared"], {label: T})


def state_at(maps: Maps, d: Definition | None = None) -> list[str]:
    tests = head_states(maps, "L00", d or Definition())
    n = next(iter(tests.values())).shape[1]
    return [next((s for s, x in tests.items() if x[0, h]), "none") for h in range(n)]


def test_qi_et_als_matrices_are_in_the_states_the_words_give():
    """One sample of five heads, one of each map: each is in its own state, and only in it."""
    assert state_at(maps_of([[MAPS[k] for k in MAPS]])) == list(MAPS)


def test_the_shared_key_makes_the_sink_and_moving_it_makes_a_malignant_head():
    """Every query of every sequence on key 0 holds all the mass on one shared position: a sink; with
    ``sink_mass`` above what it holds (never, at 1.0 exactly it still holds), and with the key moved per
    sequence, the same shape is malignant."""
    assert state_at(maps_of([[MAPS["sink"]]])) == ["sink"]
    assert state_at(maps_of([[pointer(lambda s: [s])]])) == ["malignant"]


def test_few_columns_is_a_share_of_the_rows():
    """Every query on the same 6 keys: 6 of 64 columns hold the mass, few at 1/8 of the rows (8) and not at
    1/16 (4): then sparse with many columns, benign."""
    six = pointer(lambda s: list(range(5 + s, 11 + s)))  # each query's mass on 6 keys: focused on top 8 only
    d = Definition(top_keys=8)
    assert state_at(maps_of([[six]]), d.replace(few_columns=1 / 8)) == ["malignant"]
    assert state_at(maps_of([[six]]), d.replace(few_columns=1 / 16)) == ["benign"]
    assert state_at(maps_of([[six]]), d.replace(top_keys=4)) == ["none"]  # 4 keys hold 2/3 of a query's mass


def test_a_query_counts_for_its_top_keys_only_when_it_sees_more_of_them():
    """The uniform causal map: query i sees i + 1 keys; its top 4 hold all of it while i < 4, and 4 / (i + 1)
    after: the share of focused queries counts only queries seeing 5 keys or more (here: none focused)."""
    m = measure(MAPS["uniform"][:, None], causal=True)
    top4 = m["focused"][0, 3]  # (TOP_MASS,)
    assert float(top4[0]) == pytest.approx(sum(1 for i in range(4, T) if 4 / (i + 1) >= 0.5) / (T - 4))


def test_measured_columns_and_shared_position_by_hand():
    """The columns holding each level of all queries' mass and the share of the best shared key position,
    counted the slow way (a loop over sorted column sums; a minimum over sequences per position)."""
    p = MAPS["malignant"].double()  # (S, T, T)
    got = measure(p[:, None], causal=True)
    for level_index, level in enumerate((0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)):
        counts = []
        for s in range(SEQS):
            column = sorted((p[s].sum(0) / T).tolist(), reverse=True)
            total, n = 0.0, 0
            while total < level - 1e-12:
                total, n = total + column[n], n + 1
            counts.append(n)
        assert float(got["columns"][0, level_index]) == pytest.approx(np.mean(counts))
    slow = max(min(float(p[s, :, k].sum() / T) for s in range(SEQS)) for k in range(T))
    assert float(got["shared"][0]) == pytest.approx(slow)


def test_a_sample_that_is_not_finite_is_in_no_state():
    nan = torch.full_like(MAPS["malignant"], math.nan)
    assert state_at(maps_of([[nan]])) == ["none"]


def test_a_head_is_in_a_state_where_most_samples_of_its_window_are():
    """Malignant at 20-79, with other samples at 40, 41 and 60 inside it and single malignant samples
    at 5 and 100 outside it: one episode, since 20, until 80 (window 21: at most 10 steps either side)."""
    def head(s):
        inside = 20 <= s < 80 and s not in (40, 41, 60) or s in (5, 100)
        return MAPS["malignant"] if inside else MAPS["none"]
    found = [e for e in episodes(maps_of([[head(s)] for s in range(150)])) if e.state == "malignant"]
    assert found == [Episode("malignant", "L00", 20, 20, 80, False), Episode("malignant", "L00/H00", 20, 20, 80, False)]


def test_a_layer_is_in_a_state_while_more_than_half_its_heads_are():
    """Four heads, malignant from 20, 40, 60 (the fourth never): the layer from 60, when 3 of 4 are; with the
    third head gone at 100, back to 2 of 4: the layer's episode ends at 100. Two heads: both are needed."""
    def heads(s):
        return [MAPS["malignant"] if (start <= s < (100 if start == 60 else 10**6)) else MAPS["none"]
                for start in (20, 40, 60, 10**6)]
    steps = range(0, 150, 2)
    found = [(e.where, e.since, e.until) for e in episodes(maps_of([heads(s) for s in steps], steps))
             if e.state == "malignant"]
    assert ("L00", 60, 100) in found and [f for f in found if f[0] == "L00"] == [("L00", 60, 100)]
    two = maps_of([[MAPS["malignant"], MAPS["malignant"] if s >= 40 else MAPS["none"]] for s in range(80)])
    assert [(e.since, e.until) for e in episodes(two) if e.where == "L00" and e.state == "malignant"] == [(40, None)]


def test_an_episode_from_the_first_sample_is_a_baseline_and_sparse_samples_are_steps_apart():
    """Samples every 10 steps from step 5, uniform at the start (a causal model's attention at initialisation):
    a baseline episode; malignant from step 105: not a baseline."""
    steps = list(range(5, 300, 10))
    heads = [[MAPS["uniform"] if s < 100 else MAPS["malignant"]] for s in steps]
    found = {(e.state, e.where): (e.since, e.until, e.baseline) for e in episodes(maps_of(heads, steps))}
    assert found[("uniform", "L00")] == (5, 105, True)
    assert found[("malignant", "L00/H00")] == (105, None, False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 41), st.integers(1, 5))
def test_smoothing_is_the_majority_of_the_samples_within_half_a_window(inside, window, every):
    """Against the slow reading of the words: count the samples within window // 2 steps, one by one."""
    steps = np.arange(len(inside)) * every
    x = np.array(inside)
    fast = smooth(steps, x[:, None], window)[:, 0]
    slow = [2 * sum(x[j] for j in range(len(x)) if abs(steps[j] - steps[i]) <= window // 2)
            > sum(1 for j in range(len(x)) if abs(steps[j] - steps[i]) <= window // 2) for i in range(len(x))]
    assert fast.tolist() == slow


def test_heads_are_named_as_the_monitor_names_them():
    from diag.catalog.tags import head_label

    assert [head_name(h, n) for n in (1, 8, 12, 100, 101) for h in (0, n - 1)] == \
        [head_label(h, n) for n in (1, 8, 12, 100, 101) for h in (0, n - 1)]


def test_the_definition_refuses_a_level_the_maps_are_not_measured_at():
    with pytest.raises(ValueError, match=r"Definition.top_mass=0.42: the maps are measured at .*pick one"):
        Definition(top_mass=0.42)
    with pytest.raises(ValueError, match=r"Definition.queries=0: a share"):
        Definition(queries=0)


# --- independence from the detectors -------------------------------------------------------------------------

TRUTH = ("evaluation.groundtruth", "evaluation.maps")


def _source(name: str, root: Path) -> Path | None:
    for path in (root / (name.replace(".", "/") + ".py"), root / name.replace(".", "/") / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports(name: str, root: Path) -> set[str]:
    """Every module the source of ``name`` imports, at the top or inside a function (``import a.b``, ``from a
    import b`` as ``a.b`` and ``a``, relative imports resolved, ``importlib.import_module("a")`` and
    ``__import__("a")`` with a literal name)."""
    path = _source(name, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def reached(start: tuple[str, ...], root: Path = ROOT) -> set[str]:
    """The modules under ``root`` that ``start`` imports, directly or through each other, with the packages they
    live in (whose ``__init__`` runs on import)."""
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen or not (_source(name, root) or (root / name.replace(".", "/")).is_dir()):
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        if _source(name, root):
            todo += sorted(_imports(name, root))
    return seen


def test_the_ground_truth_reaches_nothing_of_the_detectors():
    """Neither the truth nor anything it imports (followed through the project's modules by their syntax
    trees) is diag.detectors, or diag (whose __init__ imports them), or hooks (whose Monitor runs them)."""
    found = reached(TRUTH)
    assert "evaluation.maps" in found  # the walk does follow the imports
    assert sorted(n for n in found if n.startswith(("diag", "hooks"))) == []  # diag's __init__ loads the detectors


@pytest.mark.parametrize("text", [
    "import diag.detectors.config", "from diag.detectors import config", "from diag import detectors",
    "import diag.catalog as c\ndef f():\n    from diag.detectors.config import StatesConfig",
    "import importlib\nimportlib.import_module('diag.detectors.config')", "__import__('diag.detectors')",
    "from .helper import x"])
def test_the_import_walk_finds_every_spelling_of_an_import(tmp_path, text):
    """The walk above, on a package of its own whose module imports the detectors in one of the ways Python
    allows (the last through a sibling module that does)."""
    for package in ("diag", "diag/detectors", "diag/catalog", "truth"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "diag/detectors/config.py").write_text("StatesConfig = None\n")
    (tmp_path / "truth/helper.py").write_text("from diag.detectors.config import StatesConfig as x\n")
    (tmp_path / "truth/probe.py").write_text(text + "\n")
    assert any(n.startswith("diag.detectors") for n in reached(("truth.probe",), tmp_path))
    (tmp_path / "truth/probe.py").write_text("import diag.catalog\nimport numpy\n")
    assert not any(n.startswith("diag.detectors") for n in reached(("truth.probe",), tmp_path))


def test_importing_the_ground_truth_loads_no_detector():
    code = ("import sys, evaluation.groundtruth, evaluation.maps; "
            "print(sorted(m for m in sys.modules if m.startswith(('diag', 'hooks'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_definition_repeats_none_of_the_detectors_numbers():
    """No default of the truth's Definition is a default of the detectors' StatesConfig (their lines, dwells,
    exit factor, sink share, layer share), and no parameter has one of their names."""
    from diag.detectors.config import StatesConfig

    theirs = {f.name: f.default for f in fields(StatesConfig)}
    mine = {f.name: f.default for f in fields(Definition)}
    assert not set(mine) & set(theirs)
    same = [(a, b) for a, x in mine.items() for b, y in theirs.items() if math.isclose(float(x), float(y))]
    assert same == []
