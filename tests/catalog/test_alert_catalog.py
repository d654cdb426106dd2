"""The alert catalog is the one source of each kind's advice: every kind the code can raise has an entry and a
docs section, the entries match what the code raises, and the messages and the run report say the entry's
advice."""

from __future__ import annotations

import ast
import html
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from diag.catalog.alerts import ALERTS, LEVELS, AlertKind, advice, register_alert
from diag.detectors.base import Alert, Observation
from diag.detectors.config import EarlyUpdatesConfig, SpikeConfig
from diag.detectors.early_updates import EarlyUpdates
from diag.detectors.nonfinite import NonFinite, overflow_alert
from diag.detectors.spike import LossSpike
from diag.errors import ConfigError
from diag.reports.run import split_advice, write_run_report

ROOT = Path(__file__).resolve().parents[2]


def _called(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _declared(tree: ast.Module) -> set[str]:
    """The string values of the module's ``KINDS`` (a dict's values, a tuple's, list's or set's elements)."""
    out: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "KINDS" for t in targets) and node.value is not None:
            values = node.value.values if isinstance(node.value, ast.Dict) else getattr(node.value, "elts", [])
            out |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return out


def raised(source: str) -> tuple[set[str], list[tuple[str, str, bool]], list[int]]:
    """What a module's ``Alert(...)`` calls raise: (the kinds, read from the calls' literal kinds and the module's
    ``KINDS``; (kind, level, resolved) of each call whose kind and level are literals; the lines of calls whose
    kind the scan cannot read: neither a literal, nor a copy of a record's ``.kind``, nor in a module that
    declares its ``KINDS``)."""
    tree = ast.parse(source)
    declared = _declared(tree)
    kinds, literal, unread = set(declared), [], []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _called(node.func) == "Alert"):
            continue
        args = dict(enumerate(node.args))
        kind = args.get(1, next((k.value for k in node.keywords if k.arg == "kind"), None))
        level = args.get(2, next((k.value for k in node.keywords if k.arg == "level"), None))
        if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
            kinds.add(kind.value)
            if isinstance(level, ast.Constant):
                resolved = any(isinstance(a, ast.Constant) and a.value == "resolved" for a in node.args[3:]) or any(
                    k.arg == "status" and isinstance(k.value, ast.Constant) and k.value.value == "resolved"
                    for k in node.keywords)
                literal.append((kind.value, level.value, resolved))
        elif not (isinstance(kind, ast.Attribute) and kind.attr == "kind") and not declared:
            unread.append(node.lineno)
    return kinds, literal, unread


def _product() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for p in sorted([*ROOT.glob("diag/**/*.py"), *ROOT.glob("hooks/**/*.py")])}


def _scan() -> tuple[dict[str, str], list[tuple[str, str, bool]], list[str]]:
    """(kind -> a file raising it, the literal (kind, level, resolved) calls, the unread calls) over diag and
    hooks."""
    kinds, literal, unread = {}, [], []
    for path, text in _product().items():
        found, calls, lines = raised(text)
        kinds |= {k: path for k in found if k not in kinds}
        literal += calls
        unread += [f"{path}:{line}" for line in lines]
    return kinds, literal, unread


def test_every_kind_the_detectors_and_hooks_raise_has_an_entry():
    kinds, _, unread = _scan()
    assert unread == [], ("an Alert whose kind the scan cannot read: name it as a literal or list the module's "
                          f"kinds in a module-level KINDS: {unread}")
    assert {"malignant_collapse", "collapse_damage", "nonfinite_weights", "qk_clip", "eureka_moment"} <= set(kinds)
    missing = {k: path for k, path in kinds.items() if k not in ALERTS}
    assert missing == {}, f"add an AlertKind to diag/catalog/alerts.py for {missing}"
    stale = set(ALERTS) - set(kinds)
    assert stale == set(), f"diag/catalog/alerts.py has entries no code raises: {stale}"


def test_the_scan_catches_a_new_kind_and_a_kind_it_cannot_read():
    new = 'def stall(step):\n    return [Alert(step, "collapse_stall", "warning", "L00", "stalled")]\n'
    kinds, literal, unread = raised(new)
    assert kinds == {"collapse_stall"} and literal == [("collapse_stall", "warning", False)] and unread == []
    assert raised('Alert(s, kind="k_kw", level="info", where="", message="m", status="resolved")')[1] == [
        ("k_kw", "info", True)]
    assert raised('Alert(s, f"nonfinite_{what}", "critical", "", "m")')[2] == [1]
    assert raised('KINDS = {"a": "kind_a"}\nAlert(s, KINDS[x], "info", "", "m")') == ({"kind_a"}, [], [])
    assert raised("Alert(first.step, first.kind, first.level, w, m)")[2] == []  # a copy of a record's kind


def test_each_literal_record_takes_a_level_its_entry_names():
    """A firing record's level is one its entry lists; a resolved record is info."""
    _, literal, _ = _scan()
    assert len(literal) >= 10
    wrong = [(k, lv) for k, lv, resolved in literal
             if k in ALERTS and (lv != "info" if resolved else lv not in ALERTS[k].levels)]
    assert wrong == []


def _sections() -> dict[str, str]:
    text = (ROOT / "docs" / "alerts.md").read_text(encoding="utf-8")
    kinds = text[text.index("## The kinds"):]
    kinds = kinds[: kinds.index("\n## ", 5)]
    return {m.group(1): m.group(2) for m in re.finditer(r"^### (\S+)\n(.*?)(?=^### |\Z)", kinds, re.S | re.M)}


def test_every_kind_has_a_section_in_the_docs_that_names_its_levels():
    sections = _sections()
    for kind in ALERTS.values():
        anchor = kind.anchor or kind.name
        assert anchor in sections, f"docs/alerts.md has no section '### {anchor}'"
        named = [lv for lv in LEVELS if f"**{lv}**" in sections[anchor]]
        assert set(named) == set(kind.levels), (kind.name, named, kind.levels)


@given(kind=st.sampled_from(sorted(ALERTS)), since=st.none() | st.integers(0, 10**7))
def test_the_advice_fills_in_the_episode_start(kind, since):
    text = advice(kind, since)
    assert text and "{" not in text and "What to do" not in text
    if "{since}" in ALERTS[kind].todo:
        assert (f"step {since}" if since is not None else "the episode's start") in text


def test_the_detectors_messages_end_with_the_catalogs_advice():
    nan = NonFinite().observe(Observation(5, math.nan, {}))
    early = EarlyUpdates(EarlyUpdatesConfig()).observe(
        Observation(0, None, {"L00": {"update_ratio_q": np.array([2.0])}}))
    spike = LossSpike(SpikeConfig(spike_warmup=3))
    spikes = [a for step, loss in enumerate([1.0, 1.01, 0.99, 1.0, 1.02, 50.0]) for a in
              spike.observe(Observation(step, loss, {}))]
    alerts = [*nan, *early, *spikes, overflow_alert(3)]
    assert {a.kind for a in alerts} == {"nonfinite_loss", "large_early_updates", "loss_spike", "gradient_overflow"}
    for a in alerts:
        assert split_advice(a.message)[1] == advice(a.kind, a.since), a.message
        assert a.anchor == f"docs/alerts.md#{a.kind}"


def test_the_run_report_advises_on_every_kind_from_the_catalog(tmp_path):
    """A record whose message has no advice (a resolved record, a record of an older run) gets its kind's entry
    in the report: every kind, none left at "see the docs"; a resolved record says its episode ended."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tag": "loss", "value": 1.0}) + "\n"
                                                    for s in (0, 10, 20)))
    records = [{"step": 10, "kind": k, "level": ALERTS[k].levels[0], "where": "", "message": f"{k} happened",
                "since": 10} for k in sorted(ALERTS)]
    records.append({"step": 20, "kind": "loss_spike", "level": "info", "where": "", "message": "resolved: back",
                    "status": "resolved", "since": 10})
    (tmp_path / "alerts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_run_report(tmp_path).read_text()
    for kind in ALERTS:
        assert html.escape(advice(kind, 10)) in page, kind
        assert f"#{kind}'>docs: {kind}</a>" in page or f"docs: {kind} (docs/alerts.md)" in page
    assert "see the docs" not in page and "nothing: the episode ended" in page


def test_an_entry_says_what_is_wrong_and_a_kind_of_ones_own_can_be_registered():
    with pytest.raises(ConfigError, match="levels=.*of \\('info', 'warning', 'critical'\\)"):
        AlertKind("stall", ("fatal",), "m", "t")
    with pytest.raises(ConfigError, match="one line, without the 'What to do:'"):
        AlertKind("stall", ("warning",), "m", "What to do: t")
    with pytest.raises(ConfigError, match=r"only field a todo may name is \{since\}"):
        AlertKind("stall", ("warning",), "m", "restart before {step}")
    with pytest.raises(ConfigError, match="has an entry already"):
        register_alert(AlertKind("loss_spike", ("warning",), "m", "t"))
    mine = AlertKind("my_stall", ("warning",), "the loss stalled", "lower the learning rate after step {since}")
    try:
        assert register_alert(mine) is mine and advice("my_stall", 7).endswith("after step 7")
        assert Alert(7, "my_stall", "warning", "", "m").anchor == "docs/alerts.md#my_stall"
    finally:
        ALERTS.pop("my_stall", None)
    assert advice("my_stall") is None
