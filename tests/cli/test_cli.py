"""What a user of the command line sees: exit codes that match the outputs, one policy for existing
output folders (CLI and Monitor alike), errors without a progress bar in front of them."""

from __future__ import annotations

import json

import pytest
import torch

from diag.cli.main import main
from diag.errors import SinkError
from hooks.monitor.monitor import Monitor
from tests.support import zoo


def _checkpoint(tmp_path):
    case = zoo.nanogpt()
    path = tmp_path / "step_5.pt"
    torch.save({k: v.detach().clone() for k, v in case.model.state_dict().items()}, path)
    return path


def test_analyze_exits_non_zero_when_the_report_was_not_written(tmp_path, capsys, monkeypatch):
    import diag.reports.checkpoints as report

    def broken(analysis, folder):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_report", broken)
    path = _checkpoint(tmp_path)
    assert main(["analyze", str(path), "--heads", "4", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error: the report was not written" in err and "No space left on device" in err
    # asked for no report: none is owed, exit 0
    assert main(["analyze", str(path), "--heads", "4", "--out", str(tmp_path / "out2"), "--no-report"]) == 0


def test_analyze_with_the_default_install_writes_the_report(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    out = tmp_path / "out"
    assert main(["analyze", str(path), "--heads", "4", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["outputs"]["report"] == str(out / "report" / "index.html")
    assert (out / "report" / "heatmaps.png").stat().st_size > 1000


def test_errors_have_no_progress_bar_in_front(tmp_path, capsys):
    bad = tmp_path / "notes.pt"
    bad.write_text("not a checkpoint\n")
    assert main(["analyze", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}"), err  # the file named first, no bar (stderr is not a terminal)
    assert "checkpoints:" not in err and "\r" not in err


def test_one_policy_for_existing_output_folders(tmp_path, capsys):
    case = zoo.nanogpt()
    logdir = tmp_path / "run"

    def run(**kwargs) -> None:
        with Monitor(case.model, logdir=logdir, every=1, signals=("spectra",), images=False, **kwargs) as monitor:
            for step in range(2):
                monitor.step(step, loss=1.0)

    run()
    with pytest.raises(SinkError, match=r"already holds a run.*overwrite=True.*purge_step"):
        run()
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    run(overwrite=True)  # replaced: one event file, only the new run's lines
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["tag"] == "loss"] == [0, 1]
    run(purge_step=0)  # a resume goes on in the same folder
    # the CLI: the same refusal, with its own flag in the message
    path = _checkpoint(tmp_path)
    assert main(["analyze", str(path), "--heads", "4", "--out", str(logdir), "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["analyze", str(path), "--heads", "4", "--out", str(logdir), "--quiet", "--overwrite"]) == 0


def test_unreadable_files_are_explained_in_whole_sentences(tmp_path, capsys):
    text = tmp_path / "notes.pt"
    text.write_text("hello, not weights\n")
    good = _checkpoint(tmp_path)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for path in (text, cut):
        assert main(["analyze", str(path), "--out", str(tmp_path / f"out-{path.stem}"), "--quiet"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert "(it starts with 'hello, n': not a zip archive or a pickle, so not a file torch.save wrote)" in lines[0]
    assert "(its zip archive has no central directory: the file is cut short)" in lines[2]
    assert all(line.endswith(("re-save it", "see the errors above")) for line in lines), lines


@pytest.mark.parametrize("option, value, says", [
    ("--every", "0", "expected an integer >= 1 or 'default', got '0'"),
    ("--steps", "-1", "expected an integer >= 1, got '-1'"),
    ("--warmup", "-3", "expected an integer >= 0, got '-3'"),
])
def test_demo_refuses_bad_numbers_before_it_writes_anything(tmp_path, capsys, option, value, says):
    logdir = tmp_path / "demo"
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--logdir", str(logdir), option, value])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not logdir.exists()  # refused by argparse: no folder left behind, no text loaded


def test_demo_every_default_is_the_monitors_cadence():
    from diag.cli.main import build_parser

    assert build_parser().parse_args(["demo", "--every", "default"]).every is None  # Monitor(every=None)
    assert build_parser().parse_args(["demo"]).every == 10
