"""read_offline_run against real offline W&B runs: it waits for the end of the run's file, which W&B writes after
``run.finish()`` has returned.

W&B's service closes a run (and writes the last block of its ``.wandb`` file) when it gets the message ``finish``
sends without waiting for an answer. Here that message is held back for a while, as a machine too busy to run
W&B's service promptly holds it back: the file then ends before the run's last rows, and the reader must wait.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import wandb

from diag.errors import SinkError
from diag.outputs.wandb_read import read_offline_run


class HeldFinish:
    """Holds back W&B's "finish" message to its service (ServiceConnection.inform_finish) until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from wandb.sdk.lib.service import service_connection

        self.send = service_connection.ServiceConnection.inform_finish
        self.held: list[tuple] = []
        monkeypatch.setattr(service_connection.ServiceConnection, "inform_finish",
                            lambda conn, run_id: self.held.append((conn, run_id)))

    def release(self) -> None:
        for args in self.held:
            self.send(*args)


def _user_run(folder: Path, steps: int = 6) -> tuple[wandb.Run, Path]:
    run = wandb.init(project="attnscope-test", dir=str(folder))
    for t in range(steps):
        run.log({"user/loss": float(t), "user/big": "x" * 20_000}, step=t)  # rows that fill the file's blocks
    return run, Path(run.dir).parent


def test_a_run_read_before_w_and_b_closed_it_is_read_whole(offline, monkeypatch):
    held = HeldFinish(monkeypatch)
    run, run_dir = _user_run(offline)
    run.finish()
    assert held.held, "run.finish() sent no finish message to W&B's service: the hold checks nothing"

    early = read_offline_run(run_dir, partial=True)  # what a reader that does not wait gets
    assert not early.finished
    assert [r["_step"] for r in early.history] != list(range(6))  # the last row is not on disk yet

    timer = threading.Timer(1.0, held.release)
    start = time.perf_counter()
    timer.start()
    back = read_offline_run(run_dir)
    timer.join()
    assert time.perf_counter() - start >= 1.0  # it waited for the end of the file
    assert back.finished
    assert back.series("user/loss") == [(t, float(t)) for t in range(6)]
    assert back.run_id == run.id


def test_a_run_that_never_finishes_is_an_error_unless_partial(offline, monkeypatch):
    held = HeldFinish(monkeypatch)
    run, run_dir = _user_run(offline)
    run.finish()
    with pytest.raises(SinkError, match="no exit record after 1 s without a write.*partial=True"):
        read_offline_run(run_dir, timeout=1)
    held.release()
    assert read_offline_run(run_dir).finished


def test_bad_paths_name_what_to_pass(tmp_path):
    with pytest.raises(SinkError, match="no such file or folder; pass one run's folder"):
        read_offline_run(tmp_path / "missing")
    with pytest.raises(SinkError, match="0 run-\\*.wandb files in it"):
        read_offline_run(tmp_path)


def test_a_missing_table_names_the_tables_there(offline):
    run = wandb.init(project="attnscope-test", dir=str(offline))
    run.log({"t": wandb.Table(columns=["a"], data=[[1]])})
    run_dir = Path(run.dir).parent
    run.finish()
    back = read_offline_run(run_dir)
    assert back.table("t") == {"columns": ["a"], "data": [[1]]}
    with pytest.raises(SinkError, match=r"no table 'u' in the run's history; its tables: \['t'\]"):
        back.table("u")


TRAIN = """\
import torch
from diag.outputs.sinks import MemorySink
from diag.outputs.wandb_sink import WandbSink
from hooks import Monitor
from tests.support import zoo

case = zoo.gpt2()
gen = torch.Generator().manual_seed(0)
kept = MemorySink()
losses = []
monitor = Monitor(case.model, every=1, sinks=[WandbSink(), kept])
for t in range(4):
    loss = case.loss(case.model, case.make_batch(gen))
    loss.backward()
    monitor.step(t, loss=loss)
    losses.append(loss.item())
    wandb.log({"loss": losses[-1]}, step=t)
monitor.close()
"""


def test_the_documented_snippet_reads_the_run_back(offline):
    """docs/integrations.md's W&B snippet as a user copies it, its ``...`` filled with a training loop."""
    from tests.support.doc_snippets import filled, python_block

    code = filled(python_block("integrations.md", "**Reading a run back.** `diag.outputs.wandb_read"), "...", TRAIN)
    scope: dict = {}
    exec(compile(code, "docs/integrations.md", "exec"), scope)  # noqa: S102 - the project's own documentation
    back = scope["back"]
    assert back.finished and back.folder == scope["run_dir"]
    assert back.series("loss") == list(enumerate(scope["losses"]))  # the user's rows, at the user's steps
    expected = [(r.step, r.scalars["qk_sigma1/L00/max"]) for r in scope["kept"].records
                if "qk_sigma1/L00/max" in r.scalars]
    assert len(expected) == 4
    assert back.series("qk_sigma1/L00/max", step="attnscope/step") == expected
    assert scope["fired"] == 0 and "alerts" not in scope
