"""Faults inside the monitor or its outputs never reach training, and cost only what failed.

* The linear algebra of the spectra raises (``torch.linalg.LinAlgError``, as an SVD or
  eigensolver that does not converge would): the spectra are NaN at that step, one
  warning, no alert, and loss, gradients, attention and updates are still logged.
* A dead head (all-zero Wq rows): its spectral values are 0, with no warning and no NaN.
* The logdir deleted mid-run, a TensorBoard writer that raises: reported once per sink,
  the other sinks keep every step, training goes on.
* ``alerts.jsonl`` is appended with one ``os.write`` per emit on an ``O_APPEND``
  descriptor, like ``metrics.jsonl``: a killed process leaves whole lines.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings

import pytest
import torch

from diag.detectors import Alert
from diag.outputs.alert_sink import AlertSink
from diag.outputs.sinks import FanOut, MemorySink
from hooks import Monitor
from tests.support import zoo

STEPS = 4
SPECTRAL = ("qk_sigma1/", "qk_sec/", "qk_erank/", "qk_stable_rank/")


def train(case: zoo.Case, monitor: Monitor, steps: int = STEPS, on_step=None) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        loss = case.loss(case.model, case.make_batch(gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        monitor.step(step, loss=loss)
        opt.step()
        losses.append(loss.item())
    return losses


def diag_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("diag:")]


def kill_head_queries(case: zoo.Case, layer: int = 0, head: int = 1) -> None:
    """Zero the query rows (and bias) of one head of a nanoGPT layer: Wq_h = 0, a dead head."""
    attn = case.model.h[layer].attn
    d = attn.n_embd // attn.n_head
    with torch.no_grad():
        attn.c_attn.weight[head * d : (head + 1) * d].zero_()
        attn.c_attn.bias[head * d : (head + 1) * d].zero_()


# ------------------------------------------------------------ failing linear algebra


def _raise_from_spectral(monkeypatch, name: str) -> list[int]:
    """torch.linalg.<name> raises LinAlgError when called from diag.math.spectral; elsewhere it works."""
    real = getattr(torch.linalg, name)
    calls = []

    def fake(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "diag.math.spectral":
            calls.append(1)
            raise torch.linalg.LinAlgError(f"{name}: the algorithm failed to converge")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, name, fake)
    return calls


# svdvals and qr are used by the route for singular heads only: a dead head takes it.
@pytest.mark.parametrize(
    "name, dead_head", [("eigvalsh", False), ("cholesky_ex", False), ("svdvals", True), ("qr", True)]
)
def test_failing_spectral_solver_gives_nan_spectra_and_the_rest(name, dead_head, monkeypatch):
    case = zoo.nanogpt()
    keep_dead = (lambda step: kill_head_queries(case)) if dead_head else None  # dead at every step
    calls = _raise_from_spectral(monkeypatch, name)
    memory, alerts = MemorySink(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(case.model, every=1, sinks=[memory], on_alert=alerts.append, stop_on_critical=True) as monitor:
            losses = train(case, monitor, on_step=keep_dead)
    assert len(calls) == STEPS, "the patched solver was never reached"
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)  # training went on
    messages = diag_warnings(caught)
    assert len(messages) == 1 and "spectra failed" in messages[0] and "LinAlgError" in messages[0], messages
    assert alerts == []  # a solver failure is not "non-finite weights"

    sampled = [r for r in memory.records if "loss" in r.scalars]
    assert [r.step for r in sampled] == list(range(STEPS))  # no sampled step was dropped
    for record in sampled:
        spectral = {t: v for t, v in record.scalars.items() if t.startswith(SPECTRAL)}
        assert spectral and all(math.isnan(v) for v in spectral.values())
        others = {t: v for t, v in record.scalars.items() if not t.startswith(SPECTRAL)}
        for family in (
            "loss",
            "grad_norm_q/L00/H00",
            "grad_ratio_qk_v/L01",
            "attn_entropy/L00/H00",
            "attn_rank/L01/H03",
        ):
            assert family in others, family
        assert all(math.isfinite(v) for v in others.values())
    assert [s for s, _ in memory.scalars("update_ratio_q/L00")] == list(range(STEPS))


def test_dead_head_gives_zeros_without_warning_or_nan():
    case = zoo.nanogpt()
    kill_head_queries(case, layer=0, head=1)
    memory = MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(case.model, every=1, sinks=[memory]) as monitor:
            loss = case.loss(case.model, case.make_batch(torch.Generator().manual_seed(0)))
            loss.backward()
            monitor.step(0, loss=loss)  # no optimizer step: the head is still dead when measured
    assert diag_warnings(caught) == []
    scalars = memory.records[0].scalars
    assert all(math.isfinite(v) for v in scalars.values()), [t for t, v in scalars.items() if not math.isfinite(v)]
    for metric in ("qk_sigma1", "qk_sec", "qk_erank", "qk_stable_rank"):
        assert scalars[f"{metric}/L00/H01"] == 0.0, metric
        assert scalars[f"{metric}/L00/H00"] > 0 and scalars[f"{metric}/L01/H01"] > 0, metric
        assert scalars[f"{metric}/L00/min"] == 0.0
    assert scalars["attn_entropy/L00/H01"] > 0  # q = 0: uniform attention over the allowed keys


# --------------------------------------------------------------------- failing sinks


def _jsonl_steps(path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in path.read_text().splitlines():
        step = json.loads(line)["step"]
        counts[step] = counts.get(step, 0) + 1
    return counts


def test_tensorboard_writer_that_raises_is_reported_once_and_jsonl_keeps_every_step(tmp_path, monkeypatch):
    from torch.utils.tensorboard.writer import FileWriter

    calls = []

    def broken(self, *args, **kwargs):
        calls.append(args[0])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileWriter, "add_summary", broken)  # the TensorBoard sink writes every event through it
    case, memory = zoo.nanogpt(), MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(case.model, every=1, logdir=tmp_path, sinks=[memory]) as monitor:
            losses = train(case, monitor)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert len(calls) > STEPS  # it kept being offered records
    about = [m for m in diag_warnings(caught) if "TensorBoardSink" in m]
    assert len(about) == 1 and "No space left" in about[0], diag_warnings(caught)
    assert diag_warnings(caught) == about
    # metrics.jsonl has every scalar of every record, as the memory sink does
    expected: dict[int, int] = {}
    for record in memory.records:
        expected[record.step] = expected.get(record.step, 0) + len(record.scalars)
    assert _jsonl_steps(tmp_path / "metrics.jsonl") == expected
    assert sorted(expected) == list(range(STEPS))


def test_logdir_deleted_mid_run_is_reported_once_per_sink_and_training_goes_on(tmp_path, monkeypatch):
    import threading

    # TensorBoard's writer thread dies on the missing file (its own traceback): keep test output clean.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    logdir = tmp_path / "run"
    case, memory = zoo.nanogpt(), MemorySink()

    def on_step(step: int) -> None:
        if step == 2:
            shutil.rmtree(logdir)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(case.model, every=1, logdir=logdir, sinks=[memory])
        losses = train(case, monitor, steps=6, on_step=on_step)
        monitor.close()  # must not raise either
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert [s for s, _ in memory.scalars("loss")] == list(range(6))  # the other sink kept everything
    messages = diag_warnings(caught)
    jsonl = [m for m in messages if "JsonlSink" in m]
    assert len(jsonl) == 1 and "deleted" in jsonl[0], messages
    # TensorBoard writes from a thread: its failure shows at a later write or at close, once at most
    assert len([m for m in messages if "TensorBoardSink" in m]) <= 1, messages
    assert all("Sink" in m for m in messages), messages
    assert not logdir.exists()  # nothing recreated behind the user's back


# ------------------------------------------------------------------- alerts.jsonl


def test_alerts_jsonl_is_one_os_write_per_emit(tmp_path, monkeypatch):
    path = tmp_path / "alerts.jsonl"
    sink = AlertSink(FanOut([]), path)
    writes = []
    real_write = os.write

    def spy(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    big = [Alert(7, "malignant_collapse", "warning", f"L00/H{h:02d}", "x" * 3000, {"v": float(h)}) for h in range(8)]
    sink.emit(big)  # 24 kB: more than one buffer of a buffered text file
    sink.emit([Alert(8, "nonfinite_loss", "critical", "", "non-finite loss at step 8")])
    assert len(writes) == 2
    assert writes[0].endswith(b"\n") and writes[0].count(b"\n") == 8
    lines = path.read_text().split("\n")
    assert lines[-1] == ""
    assert [json.loads(line)["step"] for line in lines[:-1]] == [7] * 8 + [8]
    with open(path, "rb") as f:  # opened for appending: another writer's lines are never overwritten
        assert f.read() == b"".join(writes)


def test_alerts_jsonl_in_a_deleted_folder_is_reported_once(tmp_path, caplog):
    folder = tmp_path / "gone"
    folder.mkdir()
    sink = AlertSink(FanOut([]), folder / "alerts.jsonl")
    shutil.rmtree(folder)
    with caplog.at_level("ERROR", logger="diag"):
        for step in range(3):
            sink.emit([Alert(step, "nonfinite_loss", "critical", "", f"non-finite loss at step {step}")])
    assert len([r for r in caplog.records if "alerts.jsonl" in r.getMessage()]) == 1
    assert len(sink.history) == 3


def _one_sampled_step(monitor: Monitor, model: torch.nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ), generator=torch.Generator().manual_seed(0))
    zoo._lm_loss(model(x), x).backward()
    monitor.step(0)
    opt.step()


def test_close_measure_pending_false_drops_the_pending_update_ratio():
    for measure in (True, False):
        torch.manual_seed(0)
        model, sink = zoo.NanoGPT(n_head=2, n_embd=16), MemorySink()
        monitor = Monitor(model, every=1, sinks=[sink], signals=("updates",))
        _one_sampled_step(monitor, model)
        monitor.close(measure_pending=measure)
        tags = {t for r in sink.records for t in r.scalars}
        assert any(t.startswith("update_ratio_q/") for t in tags) is measure


def test_with_block_exception_on_one_process_still_measures_pending():
    torch.manual_seed(0)
    model, sink = zoo.NanoGPT(n_head=2, n_embd=16), MemorySink()
    with pytest.raises(KeyError), Monitor(model, every=1, sinks=[sink], signals=("updates",)) as monitor:
        _one_sampled_step(monitor, model)
        raise KeyError("the user's own error")
    assert any(t.startswith("update_ratio_q/") for r in sink.records for t in r.scalars)
