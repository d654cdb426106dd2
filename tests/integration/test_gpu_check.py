"""benchmarks/gpu_check.py's dry run: every part of the GPU check, on the CPU with tiny sizes, from a checkout that is
not installed (the editable install's finder removed at start-up), so the script a lent device runs has run here.

One dry run (about 30 s of CPU) is shared by the tests of its report; the time limit is checked with a part given
0.3 s. Figures are not asserted beyond being figures: a dry run checks the script, the device measures the cost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CUDA_TEST = re.compile(r"^@pytest\.mark\.cuda\n(?:@.*\n)*def test_", re.M)  # a cuda-marked test function
# Started before any import: the finder of an editable install of attnscope (setuptools names its module
# __editable___<name>_finder) goes, so diag and hooks import only from a folder on PYTHONPATH.
NO_INSTALL = """import sys
def _kept(f):
    return not getattr(f, "__module__", "").startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if _kept(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if _kept(h)]
sys.path_importer_cache.clear()
"""


@pytest.fixture(scope="module")
def uninstalled(tmp_path_factory) -> dict[str, str]:
    """An environment in which attnscope is not installed: a sitecustomize that drops the editable finder."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(NO_INSTALL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}


def _statuses(path: Path) -> tuple | None:
    try:
        return tuple((name, p["status"]) for name, p in json.loads(path.read_text())["parts"].items())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def dry(tmp_path_factory, uninstalled) -> tuple[int, dict, str, list[tuple]]:
    """(exit status, report, markdown, every distinct set of part statuses seen in the JSON while it ran)."""
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=ROOT,
                            env=uninstalled, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[tuple] = []
    while proc.poll() is None:
        now = _statuses(out / "gpu_check.json")
        if now and (not seen or seen[-1] != now):
            seen.append(now)
        time.sleep(0.05)
    output = proc.stdout.read()
    assert (out / "gpu_check.json").is_file(), output
    report = json.loads((out / "gpu_check.json").read_text())
    return proc.returncode, report, (out / "gpu_check.md").read_text(), seen


def test_the_test_environment_has_no_installed_attnscope(uninstalled, tmp_path):
    """Without the checkout on PYTHONPATH, diag does not import: the dry run's children find it there only."""
    run = subprocess.run([sys.executable, "-c", "import diag"], cwd=tmp_path, env=uninstalled, capture_output=True,
                         text=True)
    assert run.returncode != 0 and "No module named 'diag'" in run.stderr, run.stderr


def test_every_part_runs_from_the_checkout(dry):
    rc, report, _, _ = dry
    assert {name: p["status"] for name, p in report["parts"].items()} == dict.fromkeys(
        ["device", "cuda tests", "overhead tiny batch", "attention", "overhead tiny long step"], "ok"), report
    assert rc == 0
    device = report["parts"]["device"]["results"]
    assert Path(device["diag_from"]) == ROOT / "diag"
    assert device["torch"] and device["device"] == "cpu" and device["name"] == "CPU"
    assert report["dry_run"] is True and report["finished"] and report["seconds"] > 0
    assert report["commit"]["sha"] and len(report["commit"]["sha"]) == 40
    for part in report["parts"].values():
        assert 0 < part["seconds"] <= part["limit_s"] and part["command"][0] == "python3"


def test_the_cuda_tests_are_each_reported(dry):
    _, report, md, _ = dry
    tests = report["parts"]["cuda tests"]["results"]["tests"]
    marked = sum(len(CUDA_TEST.findall(p.read_text())) for p in (ROOT / "tests").rglob("test_*.py"))
    assert len(tests) == marked >= 3
    skipped = "skipped" if not report["parts"]["device"]["results"]["cuda_available"] else "passed"
    assert {t["outcome"] for t in tests.values()} == {skipped}
    for name in tests:
        assert f"`{name}`" in md


def test_the_overhead_figures_are_read(dry):
    _, report, _, _ = dry
    batch = report["parts"]["overhead tiny batch"]["results"]
    long = report["parts"]["overhead tiny long step"]["results"]
    assert batch["model"] == long["model"] == {"layers": 2, "heads": 4, "d_model": 64}
    assert batch["batch"] == [1, 8] and "calibration" not in batch
    assert long["batch"] == [4, 8] and "short of 1000 ms at the --max-batch limit" in long["calibration"]
    for figures in (batch, long):
        assert set(figures["windows"]) == {"default", "every=10"}
        assert figures["windows"]["default"]["steps"] == 100 and figures["windows"]["every=10"]["steps"] == 10
        assert all(w["ratio"] > 0 and w["min"] <= w["ratio"] <= w["max"] for w in figures["windows"].values())
        assert set(figures["families_pct"]) == {"loss", "grads", "spectra", "updates", "attention", "all"}
        assert figures["step_ms"] > 0
    assert set(batch["non_sampled_us"]) == {"with a loss", "without a loss"}
    tokens = report["parts"]["attention"]["results"]["tokens"]
    assert set(tokens) == {"64", "128"} and all(t["forward_backward_ms"] > 0 for t in tokens.values())


def test_the_table_holds_every_part_and_figure(dry):
    _, report, md, _ = dry
    assert md.startswith("# GPU check: CPU, ") and "Dry run on the CPU" in md and report["commit"]["sha"] in md
    for name in report["parts"]:
        assert f"| {name} | ok |" in md
    for heading in ("## The `cuda` tests", "## Training steps with the Monitor / without", "| default cadence |",
                    "| every=10 cadence |", "## One sampled step of each family", "## The attention capture"):
        assert heading in md, heading
    assert md.count("| 2 x 4, d_model 64 |") == 4  # two batches, in the step table and in the family table
    assert "| 128 |" in md


def test_the_report_is_written_before_and_after_every_part(dry):
    """Read while the run went on: the first part running with the others waiting, and a part running after
    the parts before it were done (so a run killed there keeps them)."""
    _, report, _, seen = dry
    names = list(report["parts"])
    assert (("device", "running"), *((n, "waiting") for n in names[1:])) in seen
    for i in range(1, len(names)):
        assert any(dict(s)[names[i]] == "running" and all(dict(s)[n] == "ok" for n in names[:i]) for s in seen), i


def test_a_part_past_its_limit_is_recorded_as_timed_out(uninstalled, tmp_path):
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--parts", "attention",
                          "--limit", "attention=0.3"], cwd=ROOT, env=uninstalled, capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert time.monotonic() - t0 < 30
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["attention"]
    assert part["status"] == "timed out" and part["rc"] is None and part["limit_s"] == 0.3
    assert part["seconds"] < 10 and part["results"] == {}
    assert "| attention | timed out |" in (tmp_path / "gpu_check.md").read_text()


def test_an_unknown_part_or_a_bad_limit_is_named(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--parts", "atention"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert "no part named atention" in run.stderr and "attention" in run.stderr.split("the parts:")[1]
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--limit", "attention"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "expected PART=SECONDS" in run.stderr, run.stderr


@pytest.fixture
def gpu_check_env(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check_env

    return gpu_check_env


def test_the_commit_is_read_from_git_files_by_hand(gpu_check_env, tmp_path):
    """A .git folder with a loose ref, one with the ref only in packed-refs, a worktree's .git file, a detached
    HEAD, and this checkout's own .git (against git itself, where git is here)."""
    sha, other = "a" * 40, "b" * 40
    main = tmp_path / "repo" / ".git"
    (main / "refs" / "heads").mkdir(parents=True)
    (main / "HEAD").write_text("ref: refs/heads/main\n")
    (main / "refs" / "heads" / "main").write_text(sha + "\n")
    assert gpu_check_env.head_from_files(main) == sha
    (main / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/side\n")
    (main / "HEAD").write_text("ref: refs/heads/side\n")
    assert gpu_check_env.head_from_files(main) == other
    linked = main / "worktrees" / "wt"
    linked.mkdir(parents=True)
    (linked / "HEAD").write_text("ref: refs/heads/main\n")
    (linked / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {linked}\n")
    assert gpu_check_env.head_from_files(tmp_path / "wt" / ".git") == sha
    (linked / "HEAD").write_text(other + "\n")
    assert gpu_check_env.head_from_files(tmp_path / "wt" / ".git") == other
    assert gpu_check_env.head_from_files(tmp_path / "nowhere") is None
    git = shutil.which("git") and subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if git and git.returncode == 0 and (ROOT / ".git").exists():
        assert gpu_check_env.head_from_files(ROOT / ".git") == git.stdout.strip()
    assert gpu_check_env.commit("c" * 40) == {"sha": "c" * 40, "source": "--commit", "dirty": None}


def test_figures_below_zero_are_read(gpu_check_env, monkeypatch):
    """A capture can measure faster than the plain pass beside it (noise on a short pass): its figure is negative,
    and still read."""
    import gpu_check

    got = gpu_check.read_overhead("  4096 tokens: forward+backward      10 ms; capture per sampled layer: default"
                                  "      -1 ms = -0.052x, every row       2 ms =  0.174x (median of 3)\n"
                                  "   every=100 (100 steps): time ratio 0.9981 (min 0.9912, max 1.0043; each: 0.99); "
                                  "accounted share of the Monitor -0.10% (min -0.2, max 0.1) [load 1.0]", Path())
    assert got["tokens"]["4096"]["default_x"] == -0.052 and got["tokens"]["4096"]["every_row_ms"] == 2.0
    assert got["windows"]["every=100"] == {"steps": 100, "ratio": 0.9981, "min": 0.9912, "max": 1.0043,
                                           "accounted_pct": -0.1}
