"""Shared checks for tests that train with and without the Monitor: hook and function-mode leaks, state
equality, a seeded training loop, one monitored step of a model nobody configured and its sigma_1 against the
full SVD. Imported by tests in several folders (tests/ is on sys.path, see conftest.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.modules.module as module_globals
from torch import nn

from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo

STEPS = 12
TRAIN_SEED = 1234
BATCH_SEED = 7

# Hook dictionaries of nn.Module (all of them, not only the three the brief names).
MODULE_HOOK_ATTRS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)
GLOBAL_HOOK_ATTRS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


# ------------------------------------------------------------------ helpers


def one_step(model: nn.Module, loss: Callable[[], torch.Tensor], **monitor_kwargs):
    """One training step with ``Monitor(model, every=1, sinks=[MemorySink()], **monitor_kwargs)``: ``loss()`` runs
    the forward, its backward follows, then ``monitor.step(0)`` and ``close()``. Returns the monitor, the
    record of step 0, what the layout check compared per layer (``capture.checked`` before close) and every
    warning's text."""
    sink = MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[sink], **monitor_kwargs)
        value = loss()
        value.backward()
        checked = dict(monitor.capture.checked)
        monitor.step(0, loss=value)
        monitor.close()
    return monitor, sink.records[0], checked, [str(w.message) for w in caught]


def assert_sigma1_by_hand(scalars: dict, label: str, wq: torch.Tensor, wk: torch.Tensor, rel: float) -> None:
    """Every head's logged ``qk_sigma1/<label>/Hxx`` equals the float64 full SVD of ``wq[h].T @ wk[h]`` (per-head
    (H, D, E) weights sliced by hand, each test by its family's own documented split)."""
    wq, wk = wq.detach().double(), wk.detach().double()
    for h in range(wq.shape[0]):
        sigma = torch.linalg.svdvals(wq[h].T @ wk[h])[0].item()
        assert scalars[f"qk_sigma1/{label}/H{h:02d}"] == pytest.approx(sigma, rel=rel), (label, h)


def hook_state(model: nn.Module) -> dict:
    """Every hook registered on every module and parameter of ``model``, and globally."""
    state: dict = {}
    for name, module in model.named_modules():
        state[("module", name)] = tuple(
            tuple(getattr(module, attr, {}).keys()) for attr in MODULE_HOOK_ATTRS
        )
    for name, p in model.named_parameters():
        state[("param", name)] = (
            tuple((p._backward_hooks or {}).keys()),
            tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).keys()),
        )
    for attr in GLOBAL_HOOK_ATTRS:
        state[("global", attr)] = tuple(getattr(module_globals, attr, {}).keys())
    return state


def assert_no_hooks(model: nn.Module) -> None:
    leftovers = {key: value for key, value in hook_state(model).items() if any(value)}
    assert leftovers == {}, f"hooks left behind: {leftovers}"


def function_modes() -> list:
    return list(torch.overrides._get_current_function_mode_stack())


def assert_no_function_mode() -> None:
    assert function_modes() == []
    assert torch._C._len_torch_function_stack() == 0


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), f"{key} differs"


def train(case: zoo.Case, steps: int = STEPS, monitor_kwargs: dict | None = None, tmp_path=None,
          on_step=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Train ``case.model`` (dropout on, AdamW); with a Monitor when ``monitor_kwargs`` is given."""
    model = case.model
    model.train()
    torch.manual_seed(TRAIN_SEED)
    gen = torch.Generator().manual_seed(BATCH_SEED)
    # The monitor is built after seeding: RNG drawn at construction would show.
    monitor = None if monitor_kwargs is None else Monitor(model, logdir=tmp_path, **monitor_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        batch = case.make_batch(gen)
        loss = case.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if monitor is not None:
            if on_step is not None:
                on_step(step, monitor, model, loss)
            else:
                monitor.step(step, loss=loss)
        opt.step()
        losses.append(loss.detach().clone())
    if monitor is not None:
        monitor.close()
    return losses, clone_state(model)
