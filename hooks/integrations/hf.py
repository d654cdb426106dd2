"""The Monitor as a Hugging Face ``TrainerCallback``.

    from hooks.integrations.hf import MonitorCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[MonitorCallback(every=10)])
    trainer.train()

Step semantics (see docs/integrations.md): ``monitor.step`` runs in ``on_pre_optimizer_step``,
after the Trainer's gradient clipping and before ``optimizer.step()``, once per optimizer step
whatever ``gradient_accumulation_steps`` is. Its step number is ``state.global_step`` at that
moment: the optimizer steps already taken, so values at step t describe the weights saved in
``checkpoint-t`` (the checkpoint analysis numbers them the same way); the Trainer logs this
step's own loss at ``global_step`` t + 1. The attention is captured from the first training
micro-batch of a sampled step. The loss is the model's own ``outputs.loss``, summed over the
micro-batches as the Trainer sums it, passed at every step (the detectors read the mean loss since the last
sample: with one micro-batch per step the loss itself, a view, no kernel; with several, their sum or mean).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diag.detectors import TrainingHalted
from diag.outputs.wandb_sink import WandbSink  # imports no wandb: building one does
from hooks.integrations import callback_options, with_mlflow_sink
from hooks.monitor.monitor import Monitor

__all__ = ["MonitorCallback", "STATE_FILE", "default_logdir", "reports_to_mlflow"]

log = logging.getLogger("diag")

STATE_FILE = "attnscope_state.json"
  # the detectors' state, written into each checkpoint-N folder
LAYOUT_FILE = "attnscope_layout.json"  # the Monitor's layouts (diag.offline.layoutfile), in each checkpoint-N


def _reports_to(args: Any, backend: str) -> bool:
    """Whether the Trainer logs to ``backend``: ``report_to`` names it, or is ``"all"`` and it is installed."""
    report_to = getattr(args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in report_to:
        from transformers.integrations import get_available_reporting_integrations

        report_to = get_available_reporting_integrations()
    return backend in report_to


def _reports_to_wandb(args: Any) -> bool:
    """Whether the Trainer logs to W&B (``report_to`` names ``"wandb"``, or is ``"all"`` with wandb installed)."""
    return _reports_to(args, "wandb")


def reports_to_mlflow(args: Any) -> bool:
    """Whether the Trainer logs to MLflow: ``report_to`` holds "mlflow", or "all" and mlflow is installed."""
    return _reports_to(args, "mlflow")


def default_logdir(args: Any) -> Path:
    """Beside the Trainer's own TensorBoard run, so that one ``tensorboard --logdir`` shows both.

    ``$TENSORBOARD_LOGGING_DIR/attnscope`` when that is set (the Trainer's TensorBoard folder in
    transformers 5), else ``args.logging_dir/attnscope`` where the arguments still have one
    (transformers 4), else ``args.output_dir/attnscope``.
    """
    base = os.getenv("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None)
    return Path(base or args.output_dir) / "attnscope"


class MonitorCallback(TrainerCallback):
    """Builds a ``hooks.Monitor`` on the Trainer's model at ``on_train_begin`` and steps it once per
    optimizer step; closes it at ``on_train_end``.

    Args:
        logdir: the Monitor's run directory; default :func:`default_logdir`.
        every: as ``Monitor(every=...)``: None (default) for the per-family cadence of
            :mod:`hooks.monitor.cadence`, N for every family at ``global_step % N == 0``.
        **monitor_kwargs: passed to ``Monitor`` (``per_head``, ``spec``, ``signals``, ``alerts``,
            ``on_alert``, ``stop_on_critical``, ``sinks``, ...).

    With ``report_to`` naming ``"wandb"``, the main process also writes into the Trainer's W&B run
    (:class:`diag.outputs.wandb_sink.WandbSink`, unless ``sinks`` holds one already; docs/integrations.md).
    Only the main process (``state.is_world_process_zero``) writes (logdir, ``sinks``, the state
    file); every process steps a Monitor of its own, and with ``stop_on_critical`` every process judges the main
    process's observation, so all of them raise ``TrainingHalted`` at the same step
    (:class:`hooks.parallel.detectors.SharedDetectors`). The detectors' state is saved as
    ``checkpoint-N/attnscope_state.json`` and loaded when training resumes from
    ``<output_dir>/checkpoint-N``.

    When ``args.report_to`` holds ``"mlflow"`` (or ``"all"`` with mlflow installed), the main process adds an
    :class:`~diag.outputs.mlflow_sink.MLflowSink` (unless ``sinks`` holds one): it writes into the run the
    Trainer's MLflowCallback started, found at the first write (``mlflow.active_run()``), whichever callback
    runs first at ``on_train_begin``; it never starts a run of its own beside the Trainer's.
    """

    def __init__(
        self, logdir: str | os.PathLike | None = None, every: int | None = None, **monitor_kwargs: Any
    ) -> None:
        self.logdir, self.every, self.monitor_kwargs = logdir, every, callback_options(every, monitor_kwargs)
        self.monitor: Monitor | None = None
        self._loss_hook: torch.utils.hooks.RemovableHandle | None = None
        self._losses: list[tuple[Tensor, bool]] = []  # (micro-batch loss, normalised by the step's token count)
        self._loss_factor = 1.0

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        self.close()  # a second train() on the same callback starts afresh
        if model is None:
            raise RuntimeError("MonitorCallback: the Trainer passed no model to on_train_begin; create the Trainer "
                               "with model=... (or call the callback's on_train_begin with model=your_model)")
        main = state.is_world_process_zero
        kwargs_here = dict(self.monitor_kwargs)
        if not main:
            kwargs_here["sinks"] = ()
        else:
            if _reports_to_wandb(args) and not any(isinstance(s, WandbSink) for s in kwargs_here.get("sinks", ())):
                # the Trainer's own run (its WandbCallback starts it in on_train_begin, before or after this one):
                # the sink writes into whichever run is active, and commits rows as the Trainer's logger does
                kwargs_here["sinks"] = [*kwargs_here.get("sinks", ()), WandbSink(start_run=False, commit=True)]
            if reports_to_mlflow(args):
                from diag.outputs.mlflow_sink import MLflowSink

                kwargs_here = with_mlflow_sink(kwargs_here, MLflowSink)
        logdir = (self.logdir or default_logdir(args)) if main else None
        self.monitor = Monitor(model, logdir, self.every, purge_step=state.global_step or None, **kwargs_here)
        if state.global_step > 0:
            self._load_state(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / STATE_FILE)
        self._loss_factor = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        self._loss_hook = model.register_forward_hook(self._record_loss, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.monitor is not None:
            self._losses.clear()

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self.monitor is None:
            return
        step = state.global_step
        loss = self._step_loss()
        self._losses.clear()
        try:
            self.monitor.step(step, loss=loss)
        except BaseException as err:
            # The Trainer has no exception event: leave no hook behind. A halt is raised on every rank
            # together; any other error may be this rank's alone, so no collective on the way out.
            self.close(measure_pending=isinstance(err, TrainingHalted) or getattr(args, "world_size", 1) == 1)
            raise

    def on_save(self, args, state, control, **kwargs) -> None:
        if self.monitor is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        try:
            tmp = folder / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps(self.monitor.state_dict()))
            os.replace(tmp, folder / STATE_FILE)
        except OSError as err:  # a checkpoint without our state is still a checkpoint
            log.warning("diag: cannot write %s (%s); resuming from it starts the detectors afresh",
                        folder / STATE_FILE, err)
        try:  # the layouts, so that `python -m diag analyze checkpoint-N` needs no options
            self.monitor.save_layout(folder / LAYOUT_FILE)
        except OSError as err:
            log.warning("diag: cannot write %s (%s); analysing this checkpoint may need --layout",
                        folder / LAYOUT_FILE, err)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.close()

    def close(self, measure_pending: bool = True) -> None:
        """Close the Monitor (pending update ratios, hooks, sinks). ``on_train_end`` does it; call it
        yourself if ``trainer.train()`` raised."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self.monitor is not None:
            self.monitor.close(measure_pending)
        self._losses.clear()

    # --------------------------------------------------------------- internals

    def _record_loss(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """Forward hook on the model: keep the loss of each training micro-batch (``detach``: a view)."""
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, Tensor) and loss.numel() == 1:
            self._losses.append((loss.detach(), kwargs.get("num_items_in_batch") is not None))

    def _step_loss(self) -> Tensor | None:
        """The Trainer's loss of this optimizer step: the micro-batch losses summed when the model
        divided by the step's token count (``num_items_in_batch``), else averaged."""
        if not self._losses:
            return None
        if len(self._losses) == 1 and not (self._losses[0][1] and self._loss_factor != 1):
            return self._losses[0][0].reshape(())  # one micro-batch: its loss, with no kernel
        losses = torch.stack([loss.float().reshape(()) for loss, _ in self._losses])
        if all(normalised for _, normalised in self._losses):
            return losses.sum() * self._loss_factor
        return losses.mean()

    def _load_state(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log.warning("diag: resuming at a step with no readable detector state (%s: %s); "
                        "the detectors start afresh", path, err)
            return
        self.monitor.load_state_dict(state)
