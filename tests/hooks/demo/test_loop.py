"""hooks.demo.train_steps, the one training loop of the demo and the evaluation: its schedule, where it steps the
Monitor (after backward and clipping, before the optimizer), its callbacks, and autocast on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from diag import ConfigError
from hooks.demo import GPT, GPTConfig, Schedule, adamw, train_steps


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))


class Watch:
    """A stand-in Monitor: at each step, the learning rate and the total gradient norm it is shown."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.seen = model, optimizer, []

    def step(self, step: int, loss: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()]))
        self.seen.append((step, self.optimizer.param_groups[0]["lr"], float(norm), loss.item()))


def test_the_schedule_warms_up_linearly_then_holds_or_decays_to_zero_at_the_end():
    assert [Schedule(4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert Schedule()(0) == Schedule()(99) == 1.0
    cosine = Schedule(10, "cosine", 110)
    assert cosine(9) == 1.0 and cosine(10) == 1.0
    assert cosine(60) == pytest.approx(0.5) and cosine(109) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.99)))
    with pytest.raises(ConfigError, match="decay='linear'"):
        Schedule(decay="linear")
    with pytest.raises(ConfigError, match="warmup=-1"):
        Schedule(-1)


def test_the_monitor_sees_each_step_clipped_gradients_at_the_scheduled_lr_and_callbacks_follow():
    model = _gpt()
    optimizer = adamw(model, 1e-2)
    watch, calls = Watch(model, optimizer), []
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))

    def evaluate(step: int, losses: list[float]) -> None:
        calls.append((step, list(losses)))
        model.eval()  # the loop puts the model back in train mode

    losses = train_steps(model, lambda: (ids, ids), lambda batch: model(*batch), optimizer, 5,
                         schedule=Schedule(2, "cosine", 5), clip=0.1, monitor=watch, callbacks=(evaluate,))
    assert [s for s, *_ in watch.seen] == list(range(5)) and model.training is False
    assert [lr for _, lr, *_ in watch.seen] == pytest.approx([1e-2 * Schedule(2, "cosine", 5)(s) for s in range(5)])
    assert all(norm <= 0.1 + 1e-6 for _, _, norm, _ in watch.seen)
    assert [loss for *_, loss in watch.seen] == losses and len(calls) == 5
    assert [(step, len(seen)) for step, seen in calls] == [(s, s + 1) for s in range(5)] and calls[-1][1] == losses


def test_autocast_trains_in_bfloat16_on_the_cpu():
    model = _gpt()
    dtypes = []
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    model.h[0].attn.c_attn.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    losses = train_steps(model, lambda: (ids, ids), lambda batch: model(*batch), adamw(model, 1e-3), 3,
                         autocast=torch.bfloat16)
    assert dtypes == [torch.bfloat16] * 3 and all(math.isfinite(x) for x in losses)
    assert all(p.dtype == torch.float32 for p in model.parameters())
