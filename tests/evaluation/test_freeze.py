"""The frozen protocol (evaluation/freeze.py, evaluation/report.py's replay) on tiny fake runs in a scratch git
checkout: freeze before recording, seal the recording (refusing a run recorded at another commit), replay once
(refusing a changed detector source)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from diag.detectors import Observation
from evaluation import report
from evaluation.freeze import Refused, freeze, replayable, seal
from evaluation.provenance import detector_hash, head, now, spec_hash
from evaluation.spec import RunSpec
from tests.support.fakeruns import write_run

SPECS = [RunSpec("lm", 0, 5e-3, 120), RunSpec("lm", 1, 5e-3, 120)]


def git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A checkout holding a detector, the closer look and a seeds file, committed."""
    root = tmp_path / "repo"
    for rel in ("diag/detectors/states.py", "diag/math/attention.py", "hooks/monitor/cadence.py",
                "evaluation/seeds.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("LINE = 0.5\n")
    git(root.parent, "init", "-q", str(root))
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "detectors")
    return root


def observations(collapse_from: int | None) -> list[Observation]:
    def layer(s):
        inside = collapse_from is not None and s >= collapse_from
        return {"attn_entropy": np.array([0.1, 0.1] if inside else [2.0, 2.0]),
                "attn_rank": np.array([2.0, 2.0] if inside else [40.0, 40.0]),
                "attn_rows": np.array([64.0]), "attn_entropy_uniform": np.array([3.5])}
    return [Observation(s, 3.0, {"L00": layer(s)}) for s in range(120)]


def record(runs, commit, specs=SPECS, start=None):
    """The set's runs as evaluation.runs records them, at ``commit``."""
    for spec, collapse in zip(specs, (60, None)):
        write_run(runs, spec, observations(collapse), {"commit": commit, "changed": [], "start": start or now(),
                                                       "end": now()})


def test_freeze_writes_the_manifest_once_and_only_from_committed_code(tmp_path, repo):
    frozen = tmp_path / "frozen"
    (repo / "diag/detectors/states.py").write_text("LINE = 0.6\n")
    with pytest.raises(Refused, match=r"uncommitted changes in diag/detectors/states.py"):
        freeze("s", SPECS, frozen, repo)
    git(repo, "checkout", "--", ".")
    manifest = freeze("s", SPECS, frozen, repo)
    assert manifest["detector_commit"] == head(repo) and manifest["detector_hash"] == detector_hash(repo)
    assert manifest["runs"]["lm-lr0.005-s0"]["config_hash"] == spec_hash(manifest["runs"]["lm-lr0.005-s0"]["spec"])
    assert manifest["config"]["alerts"]["sparse_entropy"] == 0.5 and "sink_share" in manifest["config"]["alerts"]
    assert json.loads((frozen / "s" / "manifest.json").read_text()) == manifest
    with pytest.raises(Refused, match="frozen already"):
        freeze("s", SPECS, frozen, repo)


def test_a_run_recorded_at_another_commit_is_refused(tmp_path, repo):
    frozen, runs = tmp_path / "frozen", tmp_path / "runs"
    freeze("s", SPECS, frozen, repo)
    (repo / "diag/detectors/states.py").write_text("LINE = 0.6\n")
    git(repo, "commit", "-qam", "another detector")
    record(runs, head(repo))
    with pytest.raises(Refused, match=r"lm-lr0.005-s0: recorded at commit \w+, the set is frozen at \w+ \(they "
                                      r"differ in diag/detectors/states.py\)"):
        seal("s", runs, frozen, root=repo)
    assert "sealed_at" not in json.loads((frozen / "s" / "manifest.json").read_text())


def test_a_commit_that_adds_only_the_manifest_holds_the_frozen_code(tmp_path, repo):
    """The manifest committed before recording (evaluation/frozen/ only) changes no code: the runs recorded after
    it are sealed, with their times, commit and hashes."""
    frozen, runs = repo / "evaluation" / "frozen", tmp_path / "runs"
    freeze("s", SPECS, frozen, repo)
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "freeze s")
    record(runs, head(repo))
    manifest = seal("s", runs, frozen, root=repo)
    entry = manifest["runs"]["lm-lr0.005-s1"]
    assert entry["recorded"]["commit"] == head(repo) and set(entry["sha256"]) == {"observations.jsonl", "run.json"}
    assert manifest["missing"] == [] and "sealed_at" in manifest


def test_runs_recorded_before_the_freeze_or_with_changes_or_missing_are_refused(tmp_path, repo):
    frozen, runs = tmp_path / "frozen", tmp_path / "runs"
    freeze("s", SPECS, frozen, repo)
    record(runs, head(repo), specs=SPECS[:1], start="2000-01-01T00:00:00+00:00")
    with pytest.raises(Refused, match=r"lm-lr0.005-s0: recorded at 2000-01-01T00:00:00\+00:00, before the freeze"):
        seal("s", runs, frozen, root=repo)
    info = json.loads((runs / "lm-lr0.005-s0" / "run.json").read_text())
    info["recorded"].update(start=now(), changed=["hooks/monitor/cadence.py"])
    (runs / "lm-lr0.005-s0" / "run.json").write_text(json.dumps(info))
    with pytest.raises(Refused, match=r"uncommitted changes in hooks/monitor/cadence.py"):
        seal("s", runs, frozen, root=repo)
    info["recorded"]["changed"] = []
    (runs / "lm-lr0.005-s0" / "run.json").write_text(json.dumps(info))
    with pytest.raises(Refused, match=r"1 runs not recorded .*lm-lr0.005-s1.*--missing-ok"):
        seal("s", runs, frozen, root=repo)
    assert seal("s", runs, frozen, missing_ok=True, root=repo)["missing"] == ["lm-lr0.005-s1"]


def test_the_replay_runs_once_writes_its_verdicts_and_refuses_a_changed_detector(tmp_path, repo):
    frozen, runs = tmp_path / "frozen", tmp_path / "runs"
    freeze("s", SPECS, frozen, repo)
    with pytest.raises(Refused, match="not sealed"):
        replayable("s", runs, frozen, repo)
    record(runs, head(repo))
    seal("s", runs, frozen, root=repo)
    (repo / "diag/detectors/states.py").write_text("LINE = 0.6\n")
    with pytest.raises(Refused, match="the detectors' source differs from the frozen one"):
        replayable("s", runs, frozen, repo)
    git(repo, "checkout", "--", ".")
    text, _ = report.replay("s", runs, frozen, repo)
    judged = json.loads((frozen / "s" / "judged.json").read_text())
    assert judged["runs"]["lm-lr0.005-s0"]["verdicts"]["collapse_recorded"] is True
    assert judged["runs"]["lm-lr0.005-s1"]["verdicts"]["no_record_without_collapse"] is True
    layers = judged["runs"]["lm-lr0.005-s0"]["evidence"]["default"]["layers"]
    assert [(x["where"], x["onset"]) for x in layers] == [("L00", 70)]
    assert "| runs with a layer collapse: every collapsed layer gets" in text
    assert (frozen / "s" / "report.md").read_text() == text + "\n"
    with pytest.raises(Refused, match="replayed already"):
        replayable("s", runs, frozen, repo)


def test_records_changed_after_the_seal_refuse_the_replay(tmp_path, repo):
    frozen, runs = tmp_path / "frozen", tmp_path / "runs"
    freeze("s", SPECS, frozen, repo)
    record(runs, head(repo))
    seal("s", runs, frozen, root=repo)
    with (runs / "lm-lr0.005-s1" / "observations.jsonl").open("a") as f:
        f.write("\n")
    with pytest.raises(Refused, match=r"records differ from those sealed: lm-lr0.005-s1/observations.jsonl"):
        replayable("s", runs, frozen, repo)


def test_a_recorded_run_says_the_commit_and_the_times_it_was_recorded_at(tmp_path):
    from evaluation.provenance import changed
    from evaluation.runs import record as train_and_record

    path = train_and_record(RunSpec("lm", 0, 1e-3, 2, context=16), tmp_path)
    recorded = json.loads((path / "run.json").read_text())["recorded"]
    assert recorded["commit"] == head() and recorded["changed"] == changed()
    assert recorded["start"] <= recorded["end"]
