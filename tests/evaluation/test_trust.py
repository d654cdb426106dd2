"""evaluation/trust.py: docs/alerts.md's trust table is what its frozen set's judged.json says, byte for byte, and
says so when the detectors at this checkout are not the ones that set replayed."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from evaluation import trust
from evaluation.provenance import detector_hash
from evaluation.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "alerts.md"


def test_the_pages_table_is_the_one_its_frozen_set_generates():
    """Regenerated from the committed judged.json and manifest.json of the set the page names, with this
    checkout's detector hash: the same bytes. (On a failure: python -m evaluation.trust --set SET --write
    docs/alerts.md, after a new frozen set where the detectors changed.)"""
    page = PAGE.read_text()
    name = trust.set_of(page)
    assert trust.replace_table(page, trust.table(name)) == page


def test_the_page_says_when_its_set_was_replayed_with_other_detectors():
    page = PAGE.read_text()
    names = trust.set_of(page).split(",")
    replayed = {json.loads((trust.FROZEN / name / "judged.json").read_text())["detector_hash"] for name in names}
    changed = "**The detectors have changed since this set was replayed**"
    if replayed == {detector_hash()}:
        assert changed not in page
    else:
        assert changed in page and f"`{detector_hash()[:16]}`" in page
        assert all(f"`{h[:16]}`" in page for h in replayed - {detector_hash()})


def _frozen(tmp_path: Path, verdicts: dict[str, dict[str, bool]], twins: set[str] = frozenset(),
            hash_: str = "a" * 64, name: str = "demo") -> Path:
    """A frozen set ``name`` of collapse runs (the demo GPT, one seed per run) with the given verdicts."""
    specs = {run: RunSpec("lm", int(run.removeprefix("run")), 5e-3, 300, twin="qknorm" if run in twins else "")
             for run in verdicts}
    runs = {run: {"kind": "collapse", "verdicts": v,
                  "evidence": {"default": {"twin": specs[run].twin}}} for run, v in verdicts.items()}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "judged.json").write_text(json.dumps({"set": name, "replayed_at": "2026-01-02T00:00:00+00:00",
                                                    "detector_hash": hash_, "runs": runs}))
    (folder / "manifest.json").write_text(json.dumps({"set": name, "frozen_at": "2026-01-01T00:00:00+00:00",
                                                      "detector_hash": hash_,
                                                      "runs": {r: {"spec": asdict(s)} for r, s in specs.items()}}))
    return tmp_path


def _row(text: str, alert: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| [`{alert}`]"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_the_counts_are_the_verdicts_with_wilson_intervals(tmp_path):
    """Four runs: three with a collapse recorded (2 met), four judged on critical records (the twin apart:
    run3 is a twin). 2 of 3: Wilson 21-94%; 1 of 3 non-twins without a critical record; the twin 1 of 1."""
    verdicts = {"run0": {"collapse_recorded": True, "no_critical_without_damage": True},
                "run1": {"collapse_recorded": True, "no_critical_without_damage": False},
                "run2": {"collapse_recorded": False, "no_critical_without_damage": False},
                "run3": {"no_critical_without_damage": True}}
    text = trust.table("demo", _frozen(tmp_path, verdicts, {"run3"}), now="a" * 64)
    malignant = _row(text, "malignant_collapse")[2]
    assert ("collapse runs whose every collapsed layer got its own record from 10 steps before to 50 after its "
            "onset: 2 of 3 (21-94%)") in malignant
    assert "collapse runs without a layer collapse and without a layer record: no such run" in malignant
    damage = _row(text, "collapse_damage")[2]
    assert "(twins left out) without a critical record: 1 of 3 (6-79%)" in damage
    assert "QK-norm twins without a critical record: 1 of 1 (21-100%)" in damage
    assert "4 runs of 4 planned (frozen on 2026-01-01" in text and "replayed once on 2026-01-02" in text
    assert "**Scope:** 4 collapse runs (the demo GPT; context 128; 300 steps; 1 of them twins)" in text


def test_other_detectors_are_said_with_both_hashes(tmp_path):
    root = _frozen(tmp_path, {"run0": {"collapse_recorded": True}}, hash_="b" * 64)
    same = trust.table("demo", root, now="b" * 64)
    other = trust.table("demo", root, now="c" * 64)
    assert "have changed" not in same and f"`{'b' * 16}`" in same
    assert ("**The detectors have changed since this set was replayed**: `demo` was replayed with detector source "
            f"hash `{'b' * 16}`; this checkout's is `{'c' * 16}`.") in other


def test_sets_pool_their_runs_each_counted_once(tmp_path):
    """Two sets of 2 and 3 runs: their verdicts counted together (3 of 5); a run in both sets is refused."""
    _frozen(tmp_path, {"run0": {"collapse_recorded": True}, "run1": {"collapse_recorded": False}})
    _frozen(tmp_path, {f"run{i}": {"collapse_recorded": i != 4} for i in (2, 3, 4)}, name="demo2", hash_="d" * 64)
    text = trust.table("demo,demo2", tmp_path, now="a" * 64)
    assert text.startswith(trust.BEGIN.format(set="demo,demo2"))
    assert "onset: 3 of 5 (" in _row(text, "malignant_collapse")[2]
    assert "the held-out sets `demo`, `demo2` of the [evaluation](evaluation.md), pooled: 5 runs of 5 planned" in text
    assert "`demo2` was replayed with detector source hash `dddddddddddddddd`" in text and "`demo` was" not in text
    _frozen(tmp_path, {"run1": {"collapse_recorded": True}}, name="demo3")
    with pytest.raises(ValueError, match=r"run run1 is in more than one set"):
        trust.table("demo,demo3", tmp_path, now="a" * 64)


def test_replace_table_swaps_exactly_one_generated_block():
    block = trust.table("users3")
    page = f"# Alerts\n\nbefore\n\n{trust.BEGIN.format(set='old')}\nstale\n{trust.END}\n\nafter\n"
    assert trust.replace_table(page, block) == f"# Alerts\n\nbefore\n\n{block}\n\nafter\n"
    assert trust.set_of(trust.replace_table(page, block)) == "users3"
    with pytest.raises(ValueError, match=r"holds 0 generated trust tables; it needs exactly one"):
        trust.replace_table("# no table\n", block)
    with pytest.raises(ValueError, match=r"holds 2 generated trust tables"):
        trust.replace_table(page + page, block)


def test_every_measure_names_a_goal_of_the_replay():
    from evaluation.headlines import GOALS

    keys = {g.key for g in GOALS}
    assert {m.goal for row in trust.ROWS for m in row.measures} <= keys
    assert all(row.measures or row.unscored for row in trust.ROWS)
    anchors = re.findall(r"\(#(\w+)\)", " ".join(row.alert for row in trust.ROWS))
    headings = set(re.findall(r"^### (\w+)$", PAGE.read_text(), flags=re.M))
    assert len(anchors) == 10 and set(anchors) <= headings
