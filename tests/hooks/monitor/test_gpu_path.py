"""The accelerator path: no host synchronisation where none is needed, work on the tensors' own device.

Host reads (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``float(t)``, ...) are what
synchronise a CUDA stream with the host. On any device they are counted with a
``TorchFunctionMode``: a non-sampled ``monitor.step`` (other than the call that
measures the update ratios of the step before) issues no tensor operation at all,
and a step that samples the loss and the gradient norms reads the host exactly once.

Tests marked ``cuda`` run where a CUDA device is present and are skipped (with that
reason) elsewhere: there ``torch.cuda.set_sync_debug_mode("error")`` turns any
synchronisation of a non-sampled step into an error, and the metrics of a model on the
GPU must equal those of the same model on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from diag.outputs.sinks import MemorySink
from hooks import Monitor
from tests.support import zoo

# numpy() is not among them: it works on CPU tensors only, so a device tensor reaches it through .cpu().
# nonzero() is: its output size depends on the data, so on CUDA it waits for the device.
HOST_READS = {"__bool__", "item", "tolist", "cpu", "__float__", "__int__", "__index__", "nonzero"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


class Calls(TorchFunctionMode):
    """Every torch function called while active, and those that read a tensor on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.host_reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls.append(name)
        to_cpu = name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list((kwargs or {}).values()))
        if name in HOST_READS or to_cpu:
            self.host_reads.append(name)
        return func(*args, **(kwargs or {}))


def run(device: str, steps: int, at_once: int | None = None, loss: bool = True,
        **kwargs) -> tuple[MemorySink, dict[int, Calls]]:
    case = zoo.nanogpt(dropout=0.0)
    model = case.model.to(device)
    sink = MemorySink()
    monitor = Monitor(model, sinks=[sink], images=False, **kwargs)
    if at_once is not None:
        monitor._updates_at_once = at_once  # update ratios of steps before this measured on the next step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    counted = {}
    for step in range(steps):
        batch = {k: v.to(device) for k, v in case.make_batch(gen).items()}
        value = case.loss(model, batch)
        value.backward()
        with Calls() as calls:
            monitor.step(step, loss=value if loss else None)
        counted[step] = calls
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    return sink, counted


def test_non_sampled_steps_issue_no_tensor_operation():
    """Default cadence: step 0 samples everything, step 1 measures its update ratios; steps 2-9 and
    11-19 sample nothing and touch no tensor but the loss's ``detach()`` (a view, no kernel: kept for the mean
    loss since the last sample, hooks/monitor/lossmean.py); steps 10 and 20 sample loss, gradient norms and
    spectra. Without a loss, nothing at all."""
    _, counted = run("cpu", 21)
    for step, calls in counted.items():
        if step not in (0, 1, 10, 20):
            assert calls.calls == ["detach"], (step, calls.calls[:10])
    _, counted = run("cpu", 21, loss=False)
    assert all(counted[step].calls == [] for step in range(2, 10))


def test_a_loss_and_gradient_sample_reads_the_host_once():
    sink, counted = run("cpu", 21, cadence={"spectra": 100})
    for step in (10, 20):
        assert counted[step].host_reads == ["cpu"], counted[step].host_reads
        assert counted[step].calls, "the step sampled nothing"
    assert [s for s, _ in sink.scalars("loss")] == [0, 10, 20]


def test_the_step_after_an_update_sample_reads_nothing_from_the_host():
    """Update ratios (every 100 steps by default): step 101 computes dW in place and reads nothing from the
    host; step 110, the next sampled step, measures the ratios of step 100, equal to those measured at once
    (as the steps of a run's first ``note_horizon`` are: step 1 measures step 0's)."""
    sink, counted = run("cpu", 111)
    assert counted[101].calls and counted[101].host_reads == [], counted[101].host_reads
    assert "sub_" in counted[101].calls
    assert "tolist" in counted[110].host_reads and "tolist" in counted[1].host_reads
    for step in range(102, 110):
        assert counted[step].calls == ["detach"], step  # the loss kept for the mean since the last sample
    eager, _ = run("cpu", 111, at_once=10**9)
    tags = [t for r in sink.records if r.step == 100 for t in r.scalars if t.startswith("update_ratio")]
    assert tags
    for tag in tags:
        assert sink.scalars(tag) == eager.scalars(tag), tag  # the same values, bit for bit, at steps 0 and 100
    assert [s for s, _ in sink.scalars(tags[0])] == [0, 100]


@pytest.mark.cuda
@needs_cuda
def test_non_sampled_steps_do_not_synchronise_on_cuda():
    case = zoo.nanogpt(dropout=0.0)
    model = case.model.cuda()
    monitor = Monitor(model, sinks=[MemorySink()], images=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(112):
        batch = {k: v.cuda() for k, v in case.make_batch(gen).items()}
        loss = case.loss(model, batch)
        loss.backward()
        if step in (0, 1) or step % 10 == 0:  # sampled, or measuring the update ratios of step 0 (101: dW only)
            monitor.step(step, loss=loss)
        else:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                monitor.step(step, loss=loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        model.zero_grad(set_to_none=True)
    monitor.close()


@pytest.mark.cuda
@needs_cuda
def test_metrics_on_cuda_equal_the_cpu_ones():
    """Every tag at every step, computed on the GPU (where the tensors live), equals the CPU run's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, _ = run("cpu", 11, every=5)
    got, counted = run("cuda", 11, every=5)
    a = {(r.step, t): v for r in ref.records for t, v in r.scalars.items()}
    b = {(r.step, t): v for r in got.records for t, v in r.scalars.items()}
    assert set(a) == set(b)
    bad = [k for k in a if not math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6)]
    assert not bad, [(k, a[k], b[k]) for k in bad[:5]]
    for step in (2, 3, 4, 7, 8, 9):  # every=5: 0, 5, 10 sampled, 1, 6 measure the update ratios
        assert counted[step].calls == [], step


@pytest.mark.cuda
@needs_cuda
def test_a_loss_on_the_cpu_beside_a_model_on_the_gpu_is_logged():
    """The loss may live on another device than the model (a loss computed on the host, a model split over
    devices): the sample still holds every metric and the loss, with no failed-sample warning."""
    import warnings

    case = zoo.nanogpt(dropout=0.0)
    model = case.model.cuda()
    sink = MemorySink()
    monitor = Monitor(model, sinks=[sink], images=False, every=1)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            loss = case.loss(model, {k: v.cuda() for k, v in case.make_batch(gen).items()})
            loss.backward()
            monitor.step(step, loss=loss.detach().cpu())
            model.zero_grad(set_to_none=True)
    monitor.close()
    assert [s for s, _ in sink.scalars("loss")] == [0, 1, 2]
    assert any(t.startswith("attn_entropy") for r in sink.records for t in r.scalars)
