"""The closer look on several ranks: a collapse under DDP and FSDP2 is watched and alerted as in one process.

tests/hooks/parallel/collapse_worker.py trains the demo's GPT (2 layers of 2 heads) at a learning rate of 5e-2
without warmup, in float64, for 45 steps: a head of layer 0 collapses into sparse, low-rank attention within 25
steps, the layer within 30, and the detectors ask for closer looks on the way (attention at every step while a head
nears the malignant lines). The same global batches in one process and on 2 gloo ranks; the loop passes the Monitor
the global batch's loss, so rank 0's detectors read the one process's inputs to float rounding (float64: the
losses of the two runs, whose gradients are reduced in another order, agree within 1e-8 relative up to step 25; the
collapse then amplifies the difference, to 1e-4 and more by step 40). Checked:

* every rank took rank 0's decision after every judged step: the same closer look after every ``monitor.step`` on
  both ranks, the same attention steps;
* the same steps sampled as one process, and looks that start at the same steps, up to the layer's
  ``malignant_collapse`` record (past it the runs part, so a look's last step may differ);
* every ``malignant_collapse`` record of the one process on the distributed run too, within one sampling interval
  (the loss's period, 10 steps: the closer look's while a layer is at risk) of its step; the layer's first one
  from a closer look (not on the plain attention cadence of every 50 steps, which samples step 0 alone in this run);
* the agreement's cost: one broadcast of 2 int64 from rank 0 inside every ``monitor.step`` that judged a step (each
  sampled step, and step 1, which measures step 0's update ratios), none on the others; under DDP nothing else.

In-process (a process group of one rank): only rank 0 asks its detectors; a broadcast that fails leaves no look until
the next agreement; a look that is off issues no collective.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hooks.monitor.sharedlook as sharedlook
from hooks.monitor.cadence import DEFAULT_CADENCE, resolve_cadence
from hooks.monitor.sharedlook import SharedCloserLook

WORKER = Path(__file__).with_name("collapse_worker.py")
ROOT = WORKER.parents[3]
RUN = ("--lr", "5e-2", "--steps", "45")
INTERVAL = DEFAULT_CADENCE["loss"]  # the closer look's period while a layer is at risk
BROADCAST = ["c10d.broadcast_", 2]  # rank 0's near_until and risk_until
# gloo can abort a rank at the exit of a run that wrote every output (tests/hooks/parallel/test_distributed.py);
# such a run is run once more
TEARDOWN_ABORT = "terminate called without an active exception"


def _run(mode: str, out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launch = [] if mode == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [sys.executable, *launch, str(WORKER), mode, str(out), *RUN, *extra]
    ranks = 1 if mode == "single" else 2
    out.mkdir()
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        written = all((out / f"rank{r}.json").exists() for r in range(ranks))
        if done.returncode == 0 or attempt == 2 or TEARDOWN_ABORT not in done.stderr or not written:
            break
        shutil.rmtree(out)
        out.mkdir()
    assert done.returncode == 0, f"{mode} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _collapses(out: Path) -> list[tuple[int, str]]:
    """(step, where) of every ``malignant_collapse`` record that starts an episode, from rank 0's alerts.jsonl."""
    rows = [json.loads(line) for line in (out / "logs" / "alerts.jsonl").read_text().splitlines()]
    return [(a["step"], a["where"]) for a in rows if a["kind"] == "malignant_collapse" and a["status"] == "firing"]


def _starts(looks: dict[str, list[int]]) -> list[int]:
    """The steps after which a closer look covers the next step while none covered this one."""
    until = {int(step): max(ends) for step, ends in looks.items()}
    return [s for s in sorted(until) if until[s] > s and until.get(s - 1, -1) < s]


@pytest.mark.parametrize("mode, extra", [("ddp", ()), ("fsdp", ("--twice",))])
def test_a_collapse_on_two_ranks_is_watched_and_alerted_as_in_one_process(mode, extra, tmp_path):
    """DDP: 8 sequences a step, 4 per rank. FSDP2 alone: layer i's attention is its owner's (rank i % 2's first
    sequences), so both ranks train on the same 4 sequences (``--twice``) and every layer's attention is the one
    process's."""
    (one,), ranks = _run("single", tmp_path / "single", *extra), _run(mode, tmp_path / mode, *extra)
    assert ranks[0]["looks"] == ranks[1]["looks"] and ranks[0]["attention"] == ranks[1]["attention"]
    expected, got = _collapses(tmp_path / "single"), _collapses(tmp_path / mode)
    layer = min(step for step, where in expected if "/" not in where)
    assert layer % DEFAULT_CADENCE["attention"], "the layer's collapse is seen on a closer look"
    assert [s for s in one["attention"] if s <= layer] == [s for s in ranks[0]["attention"] if s <= layer]
    assert any(s % INTERVAL for s in one["attention"] if s <= layer), "a look at every step before the record"
    starts = [s for s in _starts(one["looks"]) if s <= layer]
    assert starts and starts == [s for s in _starts(ranks[0]["looks"]) if s <= layer]
    for step, where in expected:
        assert any(w == where and abs(s - step) <= INTERVAL for s, w in got), (step, where, got)
    for rank in ranks:
        for step, calls in rank["collectives"].items():
            judged = int(step) in rank["sampled"]
            agreed = [c for c in calls if c[0] == BROADCAST[0]]
            assert agreed == [BROADCAST] * (judged + (step == "1")), (step, calls)
            assert calls == agreed or (mode == "fsdp" and (judged or step == "1")), (step, calls)


class Asking:
    """Detectors with a head near the lines and a layer at risk; counts how often they were asked."""

    def __init__(self) -> None:
        self.asked = 0

    def near(self) -> str:
        self.asked += 1
        return "a head came near"

    def at_risk(self) -> str:
        return "a layer at risk"


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone (rank 0 of 1)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rank_zero_decides_and_a_failed_broadcast_leaves_no_look(one_rank, monkeypatch):
    cadence = resolve_cadence(None, None, ("spectra", "attention"))
    look, ask = SharedCloserLook(cadence, True, torch.device("cpu")), Asking()
    assert look.heed(40, ask) == ["a head came near: attention sampled at every step",
                                  "a layer at risk: attention and the spectra sampled every 10 steps"]
    look.agree()  # rank 0's own ends, broadcast
    assert (look.near_until, look.risk_until, look.until) == (41, 50, 50) and look.adds(41) == {"attention"}
    look.device = torch.device("meta")  # a device the backend does not serve: the broadcast raises
    with pytest.raises(Exception):  # noqa: B017 - whatever the backend raises; the Monitor reports it
        look.agree()
    assert (look.near_until, look.risk_until, look.until) == (-1, -1, -1) and not look.adds(41)
    look.device = torch.device("cpu")
    look.heed(50, ask)
    look.agree()
    assert look.until == 60
    monkeypatch.setattr(sharedlook, "rank", lambda: 1)  # another rank: its detectors are not asked
    assert look.heed(60, ask) == [] and ask.asked == 2 and look.until == 60


def test_a_look_that_is_off_issues_no_collective(one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: calls.append(a))
    for off in (SharedCloserLook(resolve_cadence(None, None, ("spectra", "attention")), False, torch.device("cpu")),
                SharedCloserLook(resolve_cadence(10, None, ("spectra", "attention")), True, torch.device("cpu"))):
        assert off.period is None and off.heed(0, Asking()) == []
        off.agree()
    assert calls == []
