"""torch.compile and mixed precision: the Monitor's numbers and the compiler's counters.

* Compiled models: a counting backend shows that every non-sampled forward runs the
  one compiled graph (no recompile, no graph break, per ``torch._dynamo`` counters)
  and the sampled forward runs eagerly; the metrics equal an eager run's.
* bf16 autocast, fp16 autocast with ``GradScaler`` (the Monitor, called after
  ``scaler.unscale_``, sees unscaled gradients), and a model cast to bf16: every
  metric is computed in float32 or better and matches a float64 per-head reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from diag.math.spectral import qk_singular_values_reference
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo

EVERY, STEPS = 3, 8
N_HEAD, N_EMBD = 4, 32
HEAD = N_EMBD // N_HEAD


def tiny() -> zoo.NanoGPT:
    torch.manual_seed(0)
    return zoo.NanoGPT(n_head=N_HEAD, n_embd=N_EMBD, dropout=0.0)


def ids_at(step: int) -> torch.Tensor:
    return torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ), generator=torch.Generator().manual_seed(step))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return zoo._lm_loss(logits.float(), ids)


class CountingBackend:
    """A torch.compile backend that counts compilations and runs of the compiled graphs."""

    def __init__(self) -> None:
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiles += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def train(model: torch.nn.Module, forward: torch.nn.Module, watched: torch.nn.Module, backend=None):
    sink = MemorySink()
    monitor = Monitor(watched, every=EVERY, sinks=[sink])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    runs = []
    for step in range(STEPS):
        before = backend.runs if backend else 0
        loss = lm_loss(forward, ids_at(step))
        loss.backward()
        monitor.step(step, loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        runs.append((backend.runs if backend else 0) - before)
    monitor.close()
    return sink.records, runs


@pytest.fixture(scope="module")
def eager_records():
    model = tiny()
    return train(model, model, model)[0]


@pytest.mark.parametrize("watch", ["compiled", "compiled_later"])
def test_compiled_model_non_sampled_steps_stay_compiled(watch, eager_records):
    """``Monitor(torch.compile(model))`` and ``Monitor(model)`` with the model compiled afterwards."""
    torch._dynamo.reset()
    counters.clear()
    model, backend = tiny(), CountingBackend()
    compiled = torch.compile(model, backend=backend)
    records, runs = train(model, compiled, compiled if watch == "compiled" else model, backend)
    assert backend.compiles == 1, "the Monitor caused a recompile"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # Sampled forwards (0, 3, 6) run eagerly while the capture is armed; every other one runs the graph.
    assert runs == [0 if step % EVERY == 0 else 1 for step in range(STEPS)]
    assert [r.step for r in records] == [r.step for r in eager_records]
    for got, ref in zip(records, eager_records):
        assert set(got.scalars) == set(ref.scalars)
        assert any(tag.startswith("attn_entropy/") for tag in ref.scalars) or "update_ratio_q/L00" in ref.scalars
        for tag, value in ref.scalars.items():
            assert got.scalars[tag] == pytest.approx(value, rel=1e-6, abs=1e-9), (got.step, tag)
    compiled(ids_at(0))  # the stance is restored after close: compiled again
    assert backend.runs == sum(runs) + 1 and backend.compiles == 1


# ------------------------------------------------------------------ mixed precision


def per_head_reference(model: zoo.NanoGPT, grads: list[torch.Tensor] | None = None) -> dict[str, np.ndarray]:
    """Float64 per-head loops over each block's fused c_attn weight (rows [Q | K | V], head h rows hD..hD+D)."""
    out: dict[str, np.ndarray] = {}
    for i, block in enumerate(model.h):
        w = block.attn.c_attn.weight.detach().double()
        g = (block.attn.c_attn.weight.grad if grads is None else grads[i]).double()
        label = f"L{i:02d}"
        wq, wk = w[:N_EMBD], w[N_EMBD : 2 * N_EMBD]
        heads = [slice(h * HEAD, (h + 1) * HEAD) for h in range(N_HEAD)]
        out[f"qk_sigma1/{label}"] = np.array([float(qk_singular_values_reference(wq[s], wk[s])[0]) for s in heads])
        for j, name in enumerate("qkv"):
            part = g[j * N_EMBD : (j + 1) * N_EMBD]
            out[f"grad_norm_{name}/{label}"] = np.array([float(torch.linalg.norm(part[s])) for s in heads])
    return out


def per_head_logged(scalars: dict[str, float], tag: str) -> np.ndarray:
    metric, label = tag.split("/")
    return np.array([scalars[f"{metric}/{label}/H{h:02d}"] for h in range(N_HEAD)])


def check_against_reference(scalars: dict[str, float], reference: dict[str, np.ndarray], rtol: float) -> None:
    for tag, ref in reference.items():
        np.testing.assert_allclose(per_head_logged(scalars, tag), ref, rtol=rtol, err_msg=tag)
    assert all(math.isfinite(v) for v in scalars.values())


def test_bf16_autocast_metrics_in_float32_or_better():
    model = tiny()
    ref_model = tiny()
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink])
    ids = ids_at(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, ids)
    loss.backward()
    monitor.step(0, loss=loss)
    monitor.close()
    scalars = sink.records[0].scalars
    # Weights and grads are float32 under autocast: exact against the float64 reference.
    check_against_reference(scalars, per_head_reference(model), rtol=1e-5)
    # Attention of bf16 q and k: within bf16 rounding of the float32 model's float64 probabilities.
    with torch.no_grad():
        x = ref_model.wte(ids) + ref_model.wpe(torch.arange(ids.shape[1]))
        probs = ref_model.h[0].attn.reference_probs(ref_model.h[0].ln_1(x))[:2]  # (2, H, T, T)
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean((0, 2))
    np.testing.assert_allclose(per_head_logged(scalars, "attn_entropy/L00"), entropy.numpy(), rtol=3e-2)


def test_fp16_grad_scaler_monitor_sees_unscaled_grads():
    model, ref_model = tiny(), tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink])
    ids = ids_at(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model, ids)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # the Monitor goes after this: it reads p.grad as the optimizer will use it
    reference = per_head_reference(model)  # the unscaled grads in float64
    monitor.step(0, loss=loss)
    scaler.step(opt)
    scaler.update()
    monitor.close()
    scalars = sink.records[0].scalars
    check_against_reference(scalars, reference, rtol=1e-5)
    # ... and they are the float32 model's gradients up to fp16 rounding, not 4096 times larger.
    lm_loss(ref_model, ids).backward()
    fp32 = per_head_reference(ref_model)
    for tag in ("grad_norm_q/L00", "grad_norm_v/L01"):
        np.testing.assert_allclose(per_head_logged(scalars, tag), fp32[tag], rtol=5e-2)


def test_model_cast_to_bf16_metrics_in_float32_or_better():
    model = tiny().to(torch.bfloat16)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        loss = lm_loss(model, ids_at(step))
        loss.backward()
        if step == 0:
            reference = per_head_reference(model)  # float64 of the bf16 weights and bf16 grads
        weights = model.h[1].attn.c_attn.weight.detach().double()[:N_EMBD].clone()  # L01's W_Q
        if step == 0:
            before = weights
        monitor.step(step, loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    first = sink.records[0].scalars
    check_against_reference(first, reference, rtol=1e-5)
    assert not monitor._warn_once.seen, monitor._warn_once.seen
    # The update ratio of step 0 (logged at step 0, measured at step 1) against a float64 full SVD.
    updates = {t: v for r in sink.records if r.step == 0 for t, v in r.scalars.items() if t.startswith("update_")}
    expected = torch.linalg.matrix_norm(weights - before, 2) / torch.linalg.matrix_norm(before, 2)
    assert updates["update_ratio_q/L01"] == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.parametrize("with_scaler", [True, False])
def test_fp16_overflow_is_info_with_the_scaler_critical_without(with_scaler):
    """An overflowed fp16 step (the scaler skips it) is routine when the Monitor knows the scaler."""
    model = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink], grad_scaler=scaler if with_scaler else None)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model, ids_at(0))
    scaler.scale(loss).backward()
    model.h[0].attn.c_attn.weight.grad[0, 0] = math.inf  # an fp16 overflow, as the scaler sees it
    scaler.unscale_(opt)
    monitor.step(0, loss=loss)
    scaler.step(opt)  # skipped: found inf
    scaler.update()
    monitor.close()
    kinds = {(a.kind, a.level) for a in monitor.alert_sink.history}
    if with_scaler:
        assert ("gradient_overflow", "info") in kinds and not any(k == "nonfinite_gradients" for k, _ in kinds)
    else:
        assert ("nonfinite_gradients", "critical") in kinds
    assert math.isinf(sink.records[0].scalars["grad_norm_q/L00/max"])  # the value itself is still logged


def test_grad_scaler_argument_checked():
    from diag.errors import ConfigError

    with pytest.raises(ConfigError, match="grad_scaler"):
        Monitor(tiny(), grad_scaler=object())


def test_compiler_stance_restored_whatever_order_monitors_close():
    from torch._dynamo import eval_frame

    before = eval_frame._stance.stance
    for order in ((0, 1), (1, 0)):
        monitors = [Monitor(tiny(), every=2), Monitor(tiny(), every=2)]  # both armed for their first forward
        assert eval_frame._stance.stance == "force_eager"
        monitors[order[0]].close()
        assert eval_frame._stance.stance == "force_eager"  # the other one still holds it
        monitors[order[1]].close()
        assert eval_frame._stance.stance == before
