"""The monitor never changes training, and leaves nothing behind when it goes.

* Training with ``Monitor(every=1)`` is bit-for-bit the training without it
  (losses and final weights), dropout on, on every architecture of the zoo.
* A sampled ``step`` draws no random numbers and does not touch gradients.
* ``close()`` (also while armed, twice, via ``with``) and garbage collection
  remove every hook and leave no TorchFunctionMode active; the state dict is
  unchanged by attaching and closing.
* A forward that raises inside an armed attention layer leaves no mode active.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from copy import deepcopy

import pytest
import torch
from torch import nn

from diag.errors import SinkError, SpecError
from diag.outputs.sinks import MemorySink
from hooks import Monitor
from hooks.capture.capture import _Mode
from tests.support import zoo
from tests.support.harness import (  # noqa: F401 - re-exported for tests that import them from here
    BATCH_SEED,
    GLOBAL_HOOK_ATTRS,
    MODULE_HOOK_ATTRS,
    STEPS,
    TRAIN_SEED,
    assert_no_function_mode,
    assert_no_hooks,
    assert_states_equal,
    clone_state,
    function_modes,
    hook_state,
    train,
)

CASE_NAMES = list(zoo.CASES)


@pytest.fixture(autouse=True)
def _no_mode_leaks():
    assert_no_function_mode()
    yield
    assert_no_function_mode()


# ------------------------------------------------------ bit-for-bit training


@pytest.mark.parametrize("name", CASE_NAMES)
def test_training_is_bit_identical_with_monitor(name, tmp_path):
    losses_plain, state_plain = train(zoo.CASES[name]())
    case = zoo.CASES[name]()
    losses_mon, state_mon = train(case, monitor_kwargs={"every": 1}, tmp_path=tmp_path)

    assert len(losses_plain) == len(losses_mon) == STEPS
    for step, (a, b) in enumerate(zip(losses_plain, losses_mon)):
        assert torch.equal(a, b), f"loss differs at step {step}: {a.item()!r} vs {b.item()!r}"
        assert a.item() == b.item()
    assert_states_equal(state_plain, state_mon)
    # the monitor really measured: metrics.jsonl has every step, attention included
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"tag": "attn_entropy/L00/H00"' in text
    assert f'"step": {STEPS - 1}' in text
    assert_no_hooks(case.model)


# --------------------------------------------------- RNG and gradients of step


@pytest.mark.parametrize("name", CASE_NAMES)
def test_step_draws_no_random_numbers_and_leaves_grads_alone(name, tmp_path):
    checked = []

    def on_step(step, monitor, model, loss):
        grads = [(n, p, p.grad, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
        assert grads, "backward produced no gradients"
        rng_before = torch.get_rng_state()
        assert monitor.should_sample(step)
        monitor.step(step, loss=loss)
        rng_after = torch.get_rng_state()
        assert torch.equal(rng_before, rng_after), f"monitor.step({step}) consumed RNG"
        for n, p, grad, copy in grads:
            assert p.grad is grad, f"{n}.grad replaced by monitor.step({step})"
            assert torch.equal(p.grad, copy), f"{n}.grad changed by monitor.step({step})"
        checked.append(step)

    train(zoo.CASES[name](), steps=3, monitor_kwargs={"every": 1}, tmp_path=tmp_path, on_step=on_step)
    assert checked == [0, 1, 2]


def test_rng_untouched_by_close_with_pending_updates(tmp_path):
    case = zoo.nanogpt()
    model = case.model
    monitor = Monitor(model, every=1, logdir=tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = case.loss(model, case.make_batch(torch.Generator().manual_seed(0)))
    loss.backward()
    monitor.step(0, loss=loss)
    opt.step()
    rng = torch.get_rng_state()
    monitor.close()  # measures the pending update
    assert torch.equal(rng, torch.get_rng_state())
    assert '"tag": "update_ratio_q/L00"' in (tmp_path / "metrics.jsonl").read_text()


# ------------------------------------------------------------ nothing behind


@pytest.mark.parametrize("name", CASE_NAMES)
def test_close_after_training_removes_everything(name, tmp_path):
    case = zoo.CASES[name]()
    model = case.model
    before_hooks = hook_state(model)
    assert_no_hooks(model)  # the zoo's models start without hooks
    before_state = clone_state(model)
    before_keys = [(n, id(p)) for n, p in model.named_parameters()]

    monitor = Monitor(model, every=2, logdir=tmp_path)
    assert_states_equal(before_state, clone_state(model))  # attaching changes nothing
    gen = torch.Generator().manual_seed(0)
    for step in range(2):  # step 1 arms the forward of step 2, which is sampled
        loss = case.loss(model, case.make_batch(gen))
        loss.backward()
        monitor.step(step, loss=loss)
        model.zero_grad(set_to_none=True)
    assert monitor.capture.armed  # close() comes while armed, after real training steps
    monitor.close()
    assert hook_state(model) == before_hooks
    assert_no_hooks(model)
    assert_no_function_mode()
    assert_states_equal(before_state, clone_state(model))  # no optimizer: weights as they were
    assert [(n, id(p)) for n, p in model.named_parameters()] == before_keys
    monitor.close()  # idempotent
    assert_no_hooks(model)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_close_while_armed_before_any_forward(name, tmp_path):
    model = zoo.CASES[name]().model
    before_hooks = hook_state(model)
    before_state = clone_state(model)
    monitor = Monitor(model, every=5, logdir=tmp_path)
    assert monitor.capture.armed
    assert hook_state(model) != before_hooks  # sanity: the check sees the capture's hooks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.close()
        assert hook_state(model) == before_hooks
        monitor.close()
        monitor.close()
    assert [str(w.message) for w in caught] == []
    assert hook_state(model) == before_hooks
    assert_no_hooks(model)
    assert_no_function_mode()
    assert_states_equal(before_state, clone_state(model))


def test_close_idempotent_without_logdir():
    model = zoo.nanogpt().model
    monitor = Monitor(model, sinks=[MemorySink()])
    monitor.close()
    monitor.close()
    assert_no_hooks(model)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after-steps"])
@pytest.mark.parametrize("with_logdir", [False, True], ids=["memory", "logdir"])
def test_garbage_collected_monitor_leaves_no_hooks(stepped, with_logdir, tmp_path):
    case = zoo.nanogpt()
    model = case.model
    before_hooks = hook_state(model)
    if with_logdir:
        monitor = Monitor(model, every=1, logdir=tmp_path)
    else:
        monitor = Monitor(model, every=1, sinks=[MemorySink()])
    if stepped:
        gen = torch.Generator().manual_seed(0)
        for step in range(2):
            loss = case.loss(model, case.make_batch(gen))
            loss.backward()
            monitor.step(step, loss=loss)
            model.zero_grad(set_to_none=True)
    assert monitor.capture.armed
    assert hook_state(model) != before_hooks
    ref = weakref.ref(monitor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # unclosed metrics.jsonl is not our topic
        del monitor
        gc.collect()
    assert ref() is None, "the Monitor was not garbage collected"
    assert hook_state(model) == before_hooks
    assert_no_hooks(model)
    assert_no_function_mode()


@pytest.mark.parametrize("name", ["nanogpt", "llama-sdpa"])
def test_context_manager_form(name, tmp_path):
    case = zoo.CASES[name]()
    model = case.model
    before_hooks = hook_state(model)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Monitor(model, every=1, logdir=tmp_path) as monitor:
        assert isinstance(monitor, Monitor)
        assert monitor.capture.armed
        for step in range(3):
            loss = case.loss(model, case.make_batch(gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            monitor.step(step, loss=loss)
            opt.step()
    assert monitor._closed
    assert hook_state(model) == before_hooks
    assert_no_hooks(model)
    assert_no_function_mode()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"step": 2, "tag": "update_ratio_q/L00"' in text  # the pending update written at exit


def test_context_manager_exits_cleanly_on_exception(tmp_path):
    model = zoo.nanogpt().model
    before_hooks = hook_state(model)
    with pytest.raises(KeyError, match="boom"), Monitor(model, every=1, logdir=tmp_path):
        raise KeyError("boom")  # not swallowed by __exit__
    assert hook_state(model) == before_hooks
    assert_no_function_mode()


def test_failed_construction_leaves_no_hooks(tmp_path):
    model = zoo.nanogpt().model
    before_hooks = hook_state(model)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SinkError):
        Monitor(model, logdir=blocker / "run")
    with pytest.raises(SpecError):
        Monitor(nn.Sequential(nn.Linear(4, 4)))
    gc.collect()
    assert hook_state(model) == before_hooks
    assert_no_function_mode()


# --------------------------------------------------- exceptions mid-forward


class Raiser(nn.Module):
    """Stands in for a submodule; notes which function modes are active, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.modes_seen: list | None = None

    def forward(self, *args, **kwargs):
        self.modes_seen = function_modes()
        raise RuntimeError("raised inside the model")


# The projection each attention module calls after its attention kernel.
OUT_PROJ = {
    "nanogpt": "c_proj",
    "gpt2-eager": "c_proj",
    "gpt2-sdpa": "c_proj",
    "llama-eager": "o_proj",
    "llama-sdpa": "o_proj",
}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_exception_inside_armed_attention_leaves_no_mode(name, tmp_path):
    case = zoo.CASES[name]()
    model = case.model
    model.train()
    before_hooks = hook_state(model)
    monitor = Monitor(model, every=1, logdir=tmp_path)
    attn = monitor.layers[0].module
    gen = torch.Generator().manual_seed(0)
    batch = case.make_batch(gen)
    raiser = None
    if name in OUT_PROJ:
        original = getattr(attn, OUT_PROJ[name])
        raiser = Raiser()
        setattr(attn, OUT_PROJ[name], raiser)
        bad_batch = batch
    else:  # nn.MultiheadAttention calls no submodule: a malformed padding mask makes it raise inside
        bad_batch = dict(batch, pad=torch.zeros(zoo.BATCH, zoo.SEQ + 1, dtype=torch.bool))

    with pytest.raises((RuntimeError, AssertionError)):
        case.loss(model, bad_batch)
    if raiser is not None:
        # sanity: the exception really was raised while the capture's mode was active
        assert raiser.modes_seen is not None and any(isinstance(m, _Mode) for m in raiser.modes_seen)
        setattr(attn, OUT_PROJ[name], original)
    assert_no_function_mode()

    # the training run can go on: the next step works and measures
    loss = case.loss(model, batch)
    assert_no_function_mode()
    loss.backward()
    monitor.step(0, loss=loss)
    assert_no_function_mode()
    monitor.close()
    assert hook_state(model) == before_hooks
    assert_no_function_mode()


def test_exception_in_later_module_of_wrapped_model_leaves_no_mode(tmp_path):
    """A wrapper whose module after the attention layers raises (the mode must be gone already)."""
    case = zoo.nanogpt()

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.after = Raiser()

        def forward(self, ids):
            return self.after(self.inner(ids))

    model = Wrapped(case.model).train()
    monitor = Monitor(model, every=1, logdir=tmp_path)
    ids = case.make_batch(torch.Generator().manual_seed(0))["input_ids"]
    with pytest.raises(RuntimeError, match="raised inside the model"):
        model(ids)
    assert model.after.modes_seen == []  # the capture's mode ended with each attention layer
    assert_no_function_mode()
    monitor.close()
    assert_no_hooks(model)
    assert_no_function_mode()


class _PerHeadWithBatchNorm(nn.Module):
    """A module that normalises its own input (``norm``, TinyViT-style) before a qkv packed per head
    [Q_h | K_h | V_h], and has a BatchNorm over as many features, registered first, applied to its output. The
    kernel's q and k are projections of norm(x), so the layout inference tries the module's norm-like
    children on the input: it must never run the BatchNorm (in training mode that updates its running
    statistics, and the Monitor must not change the model)."""

    def __init__(self, e: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, e // heads
        self.bn = nn.BatchNorm1d(e)
        self.norm = nn.LayerNorm(e)
        self.qkv = nn.Linear(e, 3 * e)
        self.proj = nn.Linear(e, e)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, self.num_heads, 3 * self.head_dim).transpose(1, 2).chunk(3, -1)
        y = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, e)
        return self.bn(self.proj(y))


def test_the_layout_inference_never_runs_a_norm_with_running_statistics(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(_PerHeadWithBatchNorm())
    with torch.no_grad():  # a LayerNorm whose gains matter
        model[0].norm.weight.uniform_(0.5, 2.0)
        model[0].norm.bias.uniform_(-1.0, 1.0)
    twin = deepcopy(model)
    x = torch.randn(3, 8, 8)  # 8 tokens of width 8: a BatchNorm1d(8) would accept it as (batch, channels, length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = Monitor(model, every=1, sinks=[MemorySink()])
        model(x).sum().backward()
        monitor.step(0)
        monitor.close()
    twin(x).sum().backward()
    assert monitor.layers[0].layout.packing == "fused_per_head" and not monitor.refused  # read through norm
    for name, buffer in model[0].bn.named_buffers():
        assert torch.equal(buffer, dict(twin[0].bn.named_buffers())[name]), name
