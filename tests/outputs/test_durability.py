"""Nothing already measured is lost: a killed process leaves whole lines; resume does not duplicate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TRAIN = textwrap.dedent(
    """
    import torch
    from tests.support import zoo
    from hooks.monitor.monitor import Monitor
    torch.set_num_threads(1)
    case = zoo.nanogpt()
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    monitor = Monitor(case.model, logdir={logdir!r}, every=1)
    step = 0
    while True:  # until killed
        loss = case.loss(case.model, case.make_batch(gen))
        loss.backward()
        monitor.step(step, loss=loss)
        opt.step(); opt.zero_grad()
        step += 1
    """
)


def test_killed_process_leaves_only_complete_lines(tmp_path):
    logdir = tmp_path / "run"
    script = TRAIN.format(logdir=str(logdir))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=Path(__file__).parents[2])  # the checkout: tests.support
    metrics = logdir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.stat().st_size > 200_000:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no close(), no flush, no atexit
        proc.wait()
    lines = metrics.read_text().split("\n")
    assert lines[-1] == "", "the file must end with a newline: no torn last line"
    records = [json.loads(line) for line in lines[:-1]]  # every line parses
    steps = sorted({r["step"] for r in records})
    assert len(steps) >= 5
    # every step written whole (the last sampled step too), except that the update ratios
    # of a step arrive with the next call and may be missing for the very last step. Alert
    # counts (``alerts/...``) are written only at steps where an alert fired (dropout makes that
    # vary from run to run), so they are left out of the count.
    per_step = {s: sum(r["step"] == s and not r["tag"].startswith("alerts/") for r in records) for s in steps}
    full = max(per_step.values())
    assert all(per_step[s] == full for s in steps[:-1])
    alerts = logdir / "alerts.jsonl"  # written the same way (one os.write per emit; see test_faults.py)
    text = alerts.read_text()  # there from the start, empty while no alert fired
    assert text == "" or text.endswith("\n")
    assert all(json.loads(line)["kind"] for line in text.splitlines())


def test_resume_with_purge_step_does_not_duplicate_tensorboard_steps(tmp_path):
    import torch

    from hooks.monitor.monitor import Monitor
    from tests.support import zoo

    def run(start: int, stop: int, purge: int | None) -> None:
        case = zoo.nanogpt()
        gen = torch.Generator().manual_seed(start)
        monitor = Monitor(case.model, logdir=tmp_path, every=1, purge_step=purge, signals=("spectra",))
        for step in range(start, stop):
            case.loss(case.model, case.make_batch(gen)).backward()
            monitor.step(step, loss=float(step))
            case.model.zero_grad()
        monitor.close()

    run(0, 6, None)  # crashed after step 5; the last checkpoint was at step 3
    # A real resume is a later process. TensorBoard orders a folder's event files by name: the creation second,
    # then a per-process writer counter compared as text ('10' < '9'); within one second and process the
    # resumed file could sort first, so wait for the next second as a resumed process would.
    time.sleep(1.1)
    run(3, 8, 3)  # resumed from the checkpoint of step 3
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss")]
    assert steps == sorted(set(steps)) == list(range(8))
