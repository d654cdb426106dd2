"""The demo (``python -m diag demo``) runs end to end and writes every signal family."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from diag.cli.main import main


def test_demo_writes_all_signals(tmp_path, capsys):
    logdir = tmp_path / "demo"
    argv = ["demo", "--logdir", str(logdir), "--steps", "40", "--every", "10", "--quiet"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)

    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    families = {r["tag"].split("/")[0] for r in records}
    for family in ("qk_sigma1", "attn_entropy", "grad_norm_q", "update_ratio_q", "loss"):
        assert family in families, f"{family} missing from metrics.jsonl: {sorted(families)}"
    assert {r["step"] for r in records if r["tag"] == "loss"} == {0, 10, 20, 30}
    assert list(logdir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    # the printed command works outside the venv (this Python's full path) and names the run "demo"
    assert f"{sys.executable} -m tensorboard.main --logdir {logdir.resolve().parent}" in capsys.readouterr().out
    alerts = [json.loads(line) for line in (logdir / "alerts.jsonl").read_text().splitlines()]
    # within 40 steps of a run without warmup, the alert is the info note on the large first updates
    assert "large_early_updates" in {a["kind"] for a in alerts}, "the demo exists to show an alert"
    # the one policy for output folders: a second run into the same folder is refused, --overwrite replaces it
    assert main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err and len(list(logdir.glob("events.out.tfevents.*"))) == 1


def test_demo_without_library_sources_says_why(tmp_path, monkeypatch):
    """A Python whose standard library has no .py files (compiled or zipped builds): a DiagError that names the
    folder and the fix, not a failure deep in torch.randint."""
    import os

    from diag.errors import DiagError
    from hooks.demo import data

    monkeypatch.setattr(os, "__file__", str(tmp_path / "os.pyc"))  # a library folder with no .py file
    with pytest.raises(DiagError, match=r"holds only 0 characters of \.py files.*\.py sources"):
        data.load_text()
