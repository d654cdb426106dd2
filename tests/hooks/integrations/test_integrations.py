"""The Hugging Face and Lightning callbacks, in a real ``Trainer.train()`` and ``Trainer.fit()``.

Tiny models built from configs (GPT-2: 2 layers, 2 heads, E 32; the zoo's nanoGPT in a
LightningModule), a few optimizer steps on the CPU. Every logged value is checked against a
reference taken independently in the same run by a callback of the test's own, registered after
the Monitor's: Q/K/V gradient norms sliced by hand from ``.grad`` at the hook where the Monitor
read them (after HF's clipping; after Lightning's AMP unscaling), the step numbers the trainer
itself reports, the loss the trainer logs or the training step returned, and the attention
entropy recomputed in float64 from eager attention probabilities of the micro-batch that should
have been captured. Also: training is bit-for-bit the same with and without the callback, no
hook is left behind, the detectors' state survives checkpoint and resume, and HF's own
TensorBoard run and the Monitor's can both be read back from one ``--logdir``.
"""

from __future__ import annotations

import json
import math
import sys
import warnings

import numpy as np
import pytest
import torch

import hooks
from diag.errors import ConfigError
from diag.math.attention import stats_from_probabilities_reference
from diag.outputs.sinks import MemorySink
from tests.support import zoo
from tests.support.harness import MODULE_HOOK_ATTRS, assert_no_function_mode, assert_no_hooks

E, H, LAYERS, VOCAB, T = 32, 2, 2, 64, 16
D = E // H
REL = 1e-4


def per_head(record, metric: str, label: str, n: int = H) -> np.ndarray:
    return np.array([record.scalars[f"{metric}/{label}/H{h:02d}"] for h in range(n)])


def by_step(sink: MemorySink, prefix: str) -> dict[int, object]:
    """The record of each step that holds a tag starting with ``prefix`` (spectra/attention/grads, not updates)."""
    return {r.step: r for r in sink.records if any(t.startswith(prefix) for t in r.scalars)}


def test_importing_hooks_imports_no_framework():
    import subprocess

    code = ("import sys, hooks, hooks.integrations; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert hooks.Monitor is not None


# ====================================================================== Hugging Face

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hooks.integrations.hf import STATE_FILE, MonitorCallback  # noqa: E402


def gpt2(dropout: float = 0.0, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=E, n_layer=LAYERS, n_head=H, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # GPT-2's init (std 0.02) gives near-uniform attention, the same for every batch
        for block in model.transformer.h:
            block.attn.c_attn.weight.copy_(0.5 * torch.randn(block.attn.c_attn.weight.shape, generator=gen))
    return model


def token_dataset(n: int = 24) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (n, T), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_grad_norm=0.05, learning_rate=5e-3, lr_scheduler_type="constant", logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=123, disable_tqdm=True,
                dataloader_pin_memory=False)
    base.update(kw)
    return TrainingArguments(**base)


class HFReference(TrainerCallback):
    """Registered after MonitorCallback: what the Monitor should have seen, taken independently."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        self.model = model
        self.steps: list[int] = []
        self.grads: dict[int, dict] = {}
        self.total_norm: dict[int, float] = {}
        self.first_batch: dict[int, torch.Tensor] = {}
        self.entropy: dict[int, list[np.ndarray]] = {}
        self._step = None
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled() and self._step is not None:
            self.first_batch.setdefault(self._step, kwargs["input_ids"].detach().clone())

    def on_step_begin(self, args, state, control, **kw):
        self._step = state.global_step

    def on_pre_optimizer_step(self, args, state, control, **kw):
        t = state.global_step
        self.steps.append(t)
        self.live_hooks = len(our_hooks(self.model))  # while training: the loss hook (and capture hooks when armed)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.total_norm[t] = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item()
        per_layer = []
        for block in self.model.transformer.h:
            g = block.attn.c_attn.weight.grad.double()  # Conv1D: (E, 3E), columns [Q | K | V]
            per_layer.append({name: np.array([g[:, i * E + h * D : i * E + (h + 1) * D].norm().item()
                                              for h in range(H)]) for i, name in enumerate("qkv")})
        self.grads[t] = per_layer
        self.entropy[t] = self._entropy(self.first_batch[t][:2])  # the Monitor's attn_seqs=2
        self._step = None

    @torch.no_grad()
    def _entropy(self, ids: torch.Tensor) -> list[np.ndarray]:
        """Per-head entropy from eager attention probabilities, float64, of the weights the step's forward saw."""
        out = self.model(ids, output_attentions=True)  # no grad: the Monitor's capture ignores it
        allowed = torch.ones(ids.shape[0], T, T, dtype=torch.bool).tril()
        return [stats_from_probabilities_reference(a.double(), allowed)[0].numpy() for a in out.attentions]


def spy_on(monitor, seen: list) -> None:
    """Wrap ``monitor``'s detectors: every observation they are given is appended to ``seen``."""
    inner = monitor.detectors

    class Spy:
        def observe(self, obs):
            seen.append(obs)
            return inner.observe(obs)

        def __getattr__(self, name):
            return getattr(inner, name)

    monitor.detectors = Spy()


class Given(TrainerCallback):
    """Registered after MonitorCallback: keeps every observation its Monitor's detectors are given."""

    def __init__(self, callback: MonitorCallback) -> None:
        self.callback, self.seen = callback, []

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        spy_on(self.callback.monitor, self.seen)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    model = gpt2()
    memory = MemorySink()
    callback = MonitorCallback(every=2, sinks=[memory])
    reference = HFReference(model)
    given = Given(callback)
    args = hf_args(out, report_to="tensorboard")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(),
                      callbacks=[callback, reference, given])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fault of the Monitor, no unarmed sampled step
        trainer.train()
    return {"out": out, "model": model, "memory": memory, "callback": callback, "ref": reference,
            "history": trainer.state.log_history, "given": given.seen}


def test_hf_steps_follow_the_trainers_counter(hf_run):
    ref, memory = hf_run["ref"], hf_run["memory"]
    assert ref.steps == [0, 1, 2, 3]  # global_step at on_pre_optimizer_step: one call per optimizer step
    assert sorted(by_step(memory, "qk_sigma1/")) == [0, 2]
    assert sorted(by_step(memory, "update_ratio_q/")) == [0, 2]  # the update of step 2 measured at close


def test_hf_gradients_are_read_after_clipping(hf_run):
    ref, records = hf_run["ref"], by_step(hf_run["memory"], "qk_sigma1/")
    for t, record in records.items():
        assert ref.total_norm[t] == pytest.approx(0.05, rel=1e-4)  # max_grad_norm really clipped
        for layer, grads in enumerate(ref.grads[t]):
            label = f"L{layer:02d}"
            for name in "qkv":
                np.testing.assert_allclose(per_head(record, f"grad_norm_{name}", label), grads[name], rtol=REL)
            ratio = (grads["q"].mean() + grads["k"].mean()) / (2 * grads["v"].mean())
            assert record.scalars[f"grad_ratio_qk_v/{label}"] == pytest.approx(ratio, rel=REL)


def test_hf_loss_is_the_loss_the_trainer_logs(hf_run):
    logged = {entry["step"]: entry["loss"] for entry in hf_run["history"] if "loss" in entry}
    records = by_step(hf_run["memory"], "qk_sigma1/")
    for t, record in records.items():
        # the Trainer logs the loss of optimizer step t (global_step t before it) at global_step t + 1
        assert record.scalars["loss"] == pytest.approx(logged[t + 1], rel=1e-6)
    assert len({logged[t + 1] for t in records}) == len(records)  # two different losses: not a constant
    # every step's loss reaches the Monitor: the detectors get the mean of the steps since the last sample (step
    # 2: steps 1 and 2), the plateau detector's loss (hooks/monitor/lossmean.py)
    means = {o.step: o.loss_mean for o in hf_run["given"] if o.loss is not None}
    assert sorted(means) == [0, 2]
    assert means[0] == pytest.approx(logged[1], rel=1e-6)
    assert means[2] == pytest.approx((logged[2] + logged[3]) / 2, rel=1e-6)


def test_hf_attention_is_from_the_first_micro_batch_of_the_sampled_step(hf_run):
    ref, records = hf_run["ref"], by_step(hf_run["memory"], "attn_entropy/")
    assert sorted(records) == [0, 2]
    for t, record in records.items():
        for layer, entropy in enumerate(ref.entropy[t]):
            np.testing.assert_allclose(per_head(record, "attn_entropy", f"L{layer:02d}"), entropy, rtol=REL)
            assert entropy.max() < 0.9 * math.log(T)  # far from uniform: another micro-batch would differ


def test_hf_tensorboard_runs_coexist(hf_run):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    out, memory = hf_run["out"], hf_run["memory"]
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(out))
    mux.Reload()
    runs = mux.Runs()
    assert "attnscope" in runs
    hf_runs = [r for r in runs if r.startswith("runs")]
    assert len(hf_runs) == 1, runs
    hf_loss = {e.step: e.value for e in mux.Scalars(hf_runs[0], "train/loss")}
    assert sorted(hf_loss) == [1, 2, 3, 4]
    ours = {e.step: e.value for e in mux.Scalars("attnscope", "qk_sigma1/L01/H01")}
    assert ours == pytest.approx(dict(memory.scalars("qk_sigma1/L01/H01")), rel=1e-6)
    our_loss = {e.step: e.value for e in mux.Scalars("attnscope", "loss")}
    assert our_loss == pytest.approx({t: hf_loss[t + 1] for t in (0, 2)}, rel=1e-5)
    lines = [json.loads(x) for x in (out / "attnscope" / "metrics.jsonl").read_text().splitlines()]
    assert {x["step"] for x in lines if x["tag"] == "attn_entropy/L00/H00"} == {0, 2}


def our_hooks(model: torch.nn.Module) -> list:
    """Hooks of attnscope's code still registered on ``model`` (transformers keeps its own output-recording
    hooks after an ``output_attentions`` forward, and the test's reference has one)."""
    found = []
    for name, module in model.named_modules():
        for attr in MODULE_HOOK_ATTRS:
            for fn in getattr(module, attr, {}).values():
                owner = getattr(fn, "__module__", "") or getattr(getattr(fn, "__func__", None), "__module__", "")
                if owner.split(".")[0] in ("hooks", "diag"):
                    found.append((name, attr, fn))
    return found


def test_hf_leaves_nothing_behind(hf_run):
    assert hf_run["ref"].live_hooks > 0  # the check below sees attnscope's hooks when there are some
    assert our_hooks(hf_run["model"]) == []
    assert_no_function_mode()
    assert hf_run["callback"].monitor._closed
    assert hf_run["callback"]._loss_hook is None


def hf_train(out, callbacks, dropout=0.1, **kw) -> tuple[list[float], dict]:
    """Train a fresh GPT-2 (dropout on); afterwards the model holds no hook at all."""
    model = gpt2(dropout=dropout)
    trainer = Trainer(model=model, args=hf_args(out, **kw), train_dataset=token_dataset(),
                      callbacks=callbacks(model) if callable(callbacks) else callbacks)
    trainer.train()
    assert_no_hooks(model)
    assert_no_function_mode()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and "step" in entry
              and "train_loss" not in entry]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_training_is_bit_identical_with_the_callback(tmp_path):
    """Dropout on, every optimizer step sampled: the same losses and weights with and without."""
    plain_losses, plain_state = hf_train(tmp_path / "plain", [])
    memory = MemorySink()
    mon_losses, mon_state = hf_train(tmp_path / "mon", [MonitorCallback(every=1, sinks=[memory])])
    assert len(plain_losses) == 4 and len(set(plain_losses)) == 4
    assert plain_losses == mon_losses
    assert plain_state.keys() == mon_state.keys()
    for key in plain_state:
        assert torch.equal(plain_state[key], mon_state[key]), key
    assert sorted(by_step(memory, "attn_entropy/")) == [0, 1, 2, 3]


def test_hf_detector_state_survives_checkpoint_and_resume(tmp_path):
    seen = {}

    class Peek(TrainerCallback):
        def __init__(self, callback):
            self.callback = callback

        def on_train_begin(self, args, state, control, **kw):
            seen["state"] = self.callback.monitor.state_dict()
            seen["step"] = state.global_step

    first = MonitorCallback(every=1, sinks=[MemorySink()])
    hf_train(tmp_path, [first], save_strategy="steps", save_steps=2)
    assert first.monitor._closed
    saved = json.loads((tmp_path / "checkpoint-2" / STATE_FILE).read_text())
    assert len(saved["detectors"]["losses"]) == 2 and saved["detectors"]["risk"]["trends"]  # it had seen steps 0, 1
    last = json.loads((tmp_path / "checkpoint-4" / STATE_FILE).read_text())["detectors"]
    assert last["losses"] == first.monitor.state_dict()["detectors"]["losses"] and len(last["losses"]) == 4

    memory = MemorySink()
    second = MonitorCallback(every=1, sinks=[memory])
    model = gpt2(dropout=0.1)
    trainer = Trainer(model=model, args=hf_args(tmp_path), train_dataset=token_dataset(),
                      callbacks=[second, Peek(second)])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert seen["step"] == 2 and seen["state"] == saved
    assert sorted(by_step(memory, "qk_sigma1/")) == [2, 3]  # numbering continues with the Trainer's


def test_hf_stop_on_critical_raises_and_cleans_up(tmp_path):
    from diag.detectors import TrainingHalted

    model = gpt2()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[0, 0] = math.nan  # non-finite weights: a critical alert
    callback = MonitorCallback(every=1, stop_on_critical=True, sinks=[MemorySink()])
    trainer = Trainer(model=model, args=hf_args(tmp_path, max_grad_norm=0.0), train_dataset=token_dataset(),
                      callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(TrainingHalted) as info:
            trainer.train()
    assert info.value.alert.step == 0 and info.value.alert.level == "critical"
    assert callback.monitor._closed
    assert_no_hooks(model)
    assert_no_function_mode()
    # Fixed and trained again with the same callback: the last run's alert does not halt this one.
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[0, 0] = 0.0
    model.zero_grad(set_to_none=True)
    trainer.train()
    assert callback.monitor._closed and not any(a.level == "critical" for a in callback.monitor.alert_sink.history)


def test_hf_default_logdir_follows_the_trainers_tensorboard_folder(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hooks.integrations.hf import default_logdir

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    assert default_logdir(SimpleNamespace(output_dir=str(tmp_path))) == tmp_path / "attnscope"  # transformers 5
    v4 = SimpleNamespace(output_dir=str(tmp_path), logging_dir=str(tmp_path / "runs" / "x"))
    assert default_logdir(v4) == tmp_path / "runs" / "x" / "attnscope"  # transformers 4: args.logging_dir
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    assert default_logdir(v4) == tmp_path / "tb" / "attnscope"


@pytest.mark.parametrize("kwargs, words", [
    ({"every": 0}, ["every=0", "integer >= 1"]),
    ({"purge_step": 3}, ["purge_step", "the callback sets it"]),
    ({"evry": 3}, ["evry", "not an argument of hooks.Monitor", "per_head"]),
])
def test_callbacks_refuse_bad_arguments_at_construction(kwargs, words):
    from hooks.integrations.lightning import MonitorCallback as LightningCallback

    for cls in (MonitorCallback, LightningCallback):
        with pytest.raises(ConfigError) as info:
            cls(**kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)


# ========================================================================= Lightning

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from hooks.integrations.lightning import MonitorCallback as LitCallback  # noqa: E402

LE, LH = 32, 4  # the zoo's nanoGPT: n_embd 32, 4 heads, fused c_attn Linear with rows [Q | K | V]
LD = LE // LH
SCALE = 2.0**10


class LitGPT(pl.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.NanoGPT(dropout=dropout)
        self.losses: list[tuple[int, torch.Tensor]] = []  # (global_step, loss) of every training_step

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = zoo._lm_loss(self.model(ids), ids)
        self.losses.append((self.trainer.global_step, loss.detach().float().clone()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=5e-3)


def lit_loader() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, zoo.VOCAB, (24, zoo.SEQ), generator=torch.Generator().manual_seed(3))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=3)


def lit_fit(root, module, callbacks, ckpt_path=None, **kw) -> pl.Trainer:
    base = dict(max_steps=4, accelerator="cpu", devices=1, accumulate_grad_batches=2, default_root_dir=str(root),
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                num_sanity_val_steps=0, log_every_n_steps=1)
    base.update(kw)
    trainer = pl.Trainer(callbacks=callbacks, **base)
    torch.manual_seed(1234)  # dropout's draws; the Monitor is built after this and draws nothing
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, lit_loader(), ckpt_path=ckpt_path)
    return trainer


class LitReference(pl.Callback):
    """Registered after the Monitor's callback; with ``recompute``, the step's gradients are recomputed from a
    copy of the weights under fp16 autocast with no loss scaling: the unscaled reference."""

    def __init__(self, recompute: bool = False) -> None:
        self.recompute = recompute
        self.steps: list[int] = []
        self.grads: dict[int, list[dict]] = {}
        self.total_norm: dict[int, float] = {}
        self.recomputed: dict[int, list[dict]] = {}
        self.entropy: dict[int, list[np.ndarray]] = {}
        self.scale: dict[int, float] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._batches: list[torch.Tensor] = []
        self._copy = None

    def on_train_start(self, trainer, pl_module):
        for i, block in enumerate(pl_module.model.h):
            block.attn.register_forward_pre_hook(
                lambda mod, args, i=i: self._inputs.setdefault(i, args[0].detach().float().clone())
                if mod.training and torch.is_grad_enabled() else None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self._batches and self.recompute:
            import copy

            self._copy = copy.deepcopy(pl_module.model)  # the weights this optimizer step's forwards see
        self._batches.append(batch[0])

    @staticmethod
    def per_head(model) -> list[dict]:
        out = []
        for block in model.h:
            g = block.attn.c_attn.weight.grad.double()  # (3E, E)
            out.append({name: np.array([g[i * LE + h * LD : i * LE + (h + 1) * LD].norm().item() for h in range(LH)])
                        for i, name in enumerate("qkv")})
        return out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        t = trainer.global_step
        self.steps.append(t)
        self.grads[t] = self.per_head(pl_module.model)
        grads = [p.grad.double().norm() for p in pl_module.parameters() if p.grad is not None]
        self.total_norm[t] = torch.linalg.vector_norm(torch.stack(grads)).item()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scale[t] = scaler.get_scale() if scaler is not None else 1.0
        if self.recompute:
            for ids in self._batches:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = zoo._lm_loss(self._copy(ids), ids) / len(self._batches)
                loss.backward()
            self.recomputed[t] = self.per_head(self._copy)
        else:
            self.entropy[t] = self._entropy(pl_module.model)
        self._inputs.clear()
        self._batches.clear()

    @torch.no_grad()
    def _entropy(self, model) -> list[np.ndarray]:
        """From the first micro-batch's attention input of each layer, float64 eager probabilities."""
        out = []
        for i, block in enumerate(model.h):
            x = self._inputs[i][:2].double()
            probs = block.attn.double().reference_probs(x)
            block.attn.float()
            allowed = torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool).tril()
            out.append(stats_from_probabilities_reference(probs, allowed)[0].numpy())
        return out


def step_losses(module: LitGPT) -> dict[int, float]:
    """The mean of the training-step losses of each optimizer step (accumulate_grad_batches=2)."""
    per_step: dict[int, list[float]] = {}
    for t, loss in module.losses:
        per_step.setdefault(t, []).append(loss.item())
    return {t: float(np.mean(v)) for t, v in per_step.items()}


class LitGiven(pl.Callback):
    """Registered after the Monitor's callback: keeps every observation its Monitor's detectors are given."""

    def __init__(self, callback: LitCallback) -> None:
        self.callback, self.seen = callback, []

    def on_train_start(self, trainer, pl_module):
        spy_on(self.callback.monitor, self.seen)


@pytest.fixture(scope="module")
def lit_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lit")
    module = LitGPT()
    memory = MemorySink()
    callback = LitCallback(every=2, sinks=[memory])
    reference = LitReference()
    given = LitGiven(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer = lit_fit(root, module, [callback, reference, given], gradient_clip_val=0.05)
    return {"root": root, "module": module, "memory": memory, "callback": callback, "ref": reference,
            "trainer": trainer, "given": given.seen}


def test_lightning_steps_losses_and_gradients(lit_run):
    ref, memory, module = lit_run["ref"], lit_run["memory"], lit_run["module"]
    assert ref.steps == [0, 1, 2, 3]
    records = by_step(memory, "qk_sigma1/")
    assert sorted(records) == [0, 2] and sorted(by_step(memory, "update_ratio_q/")) == [0, 2]
    losses = step_losses(module)
    # every step's loss reaches the Monitor: the detectors get the mean of the steps since the last sample (step
    # 2: steps 1 and 2), the plateau detector's loss (hooks/monitor/lossmean.py)
    means = {o.step: o.loss_mean for o in lit_run["given"] if o.loss is not None}
    assert means == pytest.approx({0: losses[0], 2: (losses[1] + losses[2]) / 2}, rel=1e-6)
    for t, record in records.items():
        assert record.scalars["loss"] == pytest.approx(losses[t], rel=1e-6)
        # Lightning clips after on_before_optimizer_step: the Monitor reads the unclipped gradients
        assert ref.total_norm[t] > 0.05 * 2
        for layer, grads in enumerate(ref.grads[t]):
            for name in "qkv":
                got = per_head(record, f"grad_norm_{name}", f"L{layer:02d}", n=LH)
                np.testing.assert_allclose(got, grads[name], rtol=REL)


def test_lightning_attention_is_from_the_first_micro_batch(lit_run):
    ref, records = lit_run["ref"], by_step(lit_run["memory"], "attn_entropy/")
    assert sorted(records) == [0, 2]
    for t, record in records.items():
        for layer, entropy in enumerate(ref.entropy[t]):
            np.testing.assert_allclose(per_head(record, "attn_entropy", f"L{layer:02d}", n=LH), entropy, rtol=REL)


def test_lightning_writes_beside_its_logger_and_leaves_nothing_behind(lit_run):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    root, trainer = lit_run["root"], lit_run["trainer"]
    logdir = root / "lightning_logs" / "version_0" / "attnscope"
    assert trainer.log_dir == str(root / "lightning_logs" / "version_0")
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(root / "lightning_logs"))
    mux.Reload()
    assert {"version_0", "version_0/attnscope"} <= set(mux.Runs())
    # Lightning's own run, readable beside ours, logs self.log values at the same global_step convention
    assert sorted(e.step for e in mux.Scalars("version_0", "train_loss")) == [0, 1, 2, 3]
    ours = {e.step: e.value for e in mux.Scalars("version_0/attnscope", "grad_norm_q/L01/H03")}
    assert ours == pytest.approx(dict(lit_run["memory"].scalars("grad_norm_q/L01/H03")), rel=1e-6)
    assert (logdir / "metrics.jsonl").exists()
    assert lit_run["callback"].monitor._closed
    for block in lit_run["module"].model.h:  # the reference's own pre-hooks are the only ones left
        block.attn._forward_pre_hooks.clear()
    assert_no_hooks(lit_run["module"])
    assert_no_function_mode()


def test_lightning_16_mixed_gradients_are_unscaled(tmp_path):
    """fp16 autocast with a GradScaler (loss scale 1024) on the CPU: the gradient norms and the loss the
    Monitor logs equal an fp16-autocast recomputation with no loss scaling."""
    module = LitGPT()
    memory = MemorySink()
    reference = LitReference(recompute=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))
    lit_fit(tmp_path, module, [LitCallback(every=1, sinks=[memory], signals=("grads",)), reference],
            plugins=[plugin], logger=False)
    records = by_step(memory, "grad_norm_q/")
    assert sorted(records) == [0, 1, 2, 3]
    losses = step_losses(module)
    for t, record in records.items():
        assert reference.scale[t] == SCALE  # the gradients were really scaled by 1024 in backward
        assert record.scalars["loss"] == pytest.approx(losses[t], rel=1e-6)
        for layer, grads in enumerate(reference.recomputed[t]):
            for name in "qkv":
                got = per_head(record, f"grad_norm_{name}", f"L{layer:02d}", n=LH)
                np.testing.assert_allclose(got, grads[name], rtol=1e-3)
                np.testing.assert_allclose(got, reference.grads[t][layer][name], rtol=REL)


def test_lightning_bf16_mixed(tmp_path):
    """bf16 autocast has no loss scaler: the loss and the gradients are logged as Lightning holds them."""
    module = LitGPT()
    memory = MemorySink()
    reference = LitReference()
    lit_fit(tmp_path, module, [LitCallback(every=1, sinks=[memory], signals=("grads",)), reference],
            precision="bf16-mixed", logger=False)
    records = by_step(memory, "grad_norm_q/")
    assert sorted(records) == [0, 1, 2, 3]
    losses = step_losses(module)
    for t, record in records.items():
        assert reference.scale[t] == 1.0
        assert record.scalars["loss"] == pytest.approx(losses[t], rel=1e-6)
        for layer, grads in enumerate(reference.grads[t]):
            got = per_head(record, "grad_norm_k", f"L{layer:02d}", n=LH)
            np.testing.assert_allclose(got, grads["k"], rtol=REL)


def test_lightning_training_is_bit_identical_with_the_callback(tmp_path):
    plain = LitGPT(dropout=0.1)
    lit_fit(tmp_path / "plain", plain, [], logger=False)
    watched = LitGPT(dropout=0.1)
    memory = MemorySink()
    lit_fit(tmp_path / "mon", watched, [LitCallback(every=1, sinks=[memory], logdir=tmp_path / "tb")], logger=False)
    assert [t for t, _ in plain.losses] == [t for t, _ in watched.losses] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.losses, watched.losses))
    assert len({loss.item() for _, loss in plain.losses}) == 8
    for (key, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), key
    assert sorted(by_step(memory, "attn_entropy/")) == [0, 1, 2, 3]
    assert_no_hooks(watched)
    assert_no_function_mode()


def test_lightning_detector_state_in_checkpoints_and_resume(tmp_path):
    seen = {}

    class Peek(pl.Callback):
        def __init__(self, callback):
            self.callback = callback

        def on_train_start(self, trainer, pl_module):
            seen["state"], seen["step"] = self.callback.monitor.state_dict(), trainer.global_step

    first = LitCallback(every=1, sinks=[MemorySink()])
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    lit_fit(tmp_path, LitGPT(), [first, saver], enable_checkpointing=True, logger=False)
    paths = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(paths) == 2, paths
    step2 = next(p for p in paths if "step=2" in p.name)
    saved = torch.load(step2, weights_only=False)["callbacks"]["MonitorCallback"]
    assert len(saved["detectors"]["losses"]) == 2 and saved["detectors"]["risk"]["trends"]

    memory = MemorySink()
    second = LitCallback(every=1, sinks=[memory])
    lit_fit(tmp_path, LitGPT(), [second, Peek(second)], ckpt_path=str(step2), logger=False)
    assert seen["step"] == 2 and seen["state"] == saved
    assert sorted(by_step(memory, "qk_sigma1/")) == [2, 3]
    assert len(second.state_dict()["detectors"]["losses"]) == 4


def test_lightning_other_ranks_run_detectors_without_writing(tmp_path):
    """A rank that is not global zero gets no logdir and no sinks, and its detectors observe every sampled step;
    ``stop_on_critical`` and ``on_alert`` go to its Monitor, whose detectors stop every rank together
    (hooks.parallel.detectors.SharedDetectors, tested under torchrun in tests/hooks/parallel/test_distributed.py)."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(is_global_zero=False, log_dir=str(tmp_path), global_step=0, precision_plugin=None)
    module = LitGPT()
    memory, seen = MemorySink(), []
    callback = LitCallback(every=1, sinks=[memory], stop_on_critical=True, on_alert=seen.append)
    callback.on_train_start(trainer, module)
    assert callback.monitor.logdir is None and list(tmp_path.iterdir()) == []
    assert callback.monitor.alert_sink.stop and callback.monitor.alert_sink.callback == seen.append
    (ids,) = next(iter(lit_loader()))
    loss = zoo._lm_loss(module.model(ids), ids)
    callback.on_before_backward(trainer, module, loss)
    loss.backward()
    callback.on_before_optimizer_step(trainer, module, None)
    assert memory.records == []  # rank != 0 writes nothing
    observed = callback.monitor.detectors.state_dict()  # but its detectors observed the step
    assert observed["losses"] == [pytest.approx(loss.item())] and sorted(observed["risk"]["trends"]) == ["L00", "L01"]
    callback.on_exception(trainer, module, RuntimeError("elsewhere"))
    assert callback.monitor._closed
    assert_no_hooks(module)
