"""The Monitor as a Lightning ``Callback``.

    from hooks.integrations.lightning import MonitorCallback

    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[MonitorCallback(every=10)])
    trainer.fit(module, loader)

Step semantics (see docs/integrations.md): ``monitor.step`` runs in ``on_before_optimizer_step``,
once per optimizer step (after ``accumulate_grad_batches`` backward passes), with the number
``trainer.global_step`` has then: the optimizer steps already taken. Under ``16-mixed`` Lightning
unscales the gradients before this hook, so they are the true gradients; it clips them only
after this hook, so with ``gradient_clip_val`` the logged gradients are the unclipped ones. The
loss is what the training steps of this optimizer step returned (the sum of the losses Lightning
backpropagates, each divided by ``accumulate_grad_batches``, with the AMP loss scale taken out).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from diag.offline.checkpoint import LAYOUT_KEY
from hooks.integrations import callback_options, with_mlflow_sink
from hooks.monitor.monitor import Monitor

__all__ = ["MonitorCallback", "mlflow_logger"]


def mlflow_logger(trainer: pl.Trainer):
    """The trainer's ``MLFlowLogger``, or None (the class is looked up only when mlflow is installed)."""
    try:
        from lightning.pytorch.loggers import MLFlowLogger
    except ImportError:
        return None
    return next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)


def _wandb_sinks(trainer: pl.Trainer, sinks: Any) -> list:
    """A WandbSink into the run of the trainer's ``WandbLogger``, if it has one and ``sinks`` holds no WandbSink."""
    from lightning.pytorch.loggers import WandbLogger  # imports no wandb

    from diag.outputs.wandb_sink import WandbSink  # imports no wandb: building one does

    if any(isinstance(s, WandbSink) for s in sinks):
        return []
    for logger in getattr(trainer, "loggers", []):
        if isinstance(logger, WandbLogger):
            # the logger's run (started on first use); rows committed as the logger commits its own
            return [WandbSink(logger.experiment, commit=True)]
    return []


class MonitorCallback(pl.Callback):
    """Builds a ``hooks.Monitor`` on the LightningModule at ``on_train_start`` (after a checkpoint's
    state is restored) and closes it at ``on_train_end``, ``on_exception`` or ``teardown``.

    Args:
        logdir: the Monitor's run directory; default ``<trainer.log_dir>/attnscope`` (inside the
            logger's version folder, so ``tensorboard --logdir lightning_logs`` shows both).
        every: as ``Monitor(every=...)``: None (default) for the per-family cadence of
            :mod:`hooks.monitor.cadence`, N for every family at ``global_step % N == 0``.
        **monitor_kwargs: passed to ``Monitor`` (``per_head``, ``spec``, ``signals``, ``alerts``,
            ``on_alert``, ``stop_on_critical``, ``sinks``, ...).

    With a ``WandbLogger`` among ``trainer.loggers``, rank 0 also writes into its run
    (:class:`diag.outputs.wandb_sink.WandbSink`, unless ``sinks`` holds one already; docs/integrations.md).
    Only global rank 0 writes (logdir and ``sinks``); every rank steps a Monitor of its own, and with
    ``stop_on_critical`` every rank judges rank 0's observation, so all of them raise ``TrainingHalted`` at the
    same step (:class:`hooks.parallel.detectors.SharedDetectors`).
    ``state_dict``/``load_state_dict`` carry the detectors' state in Lightning checkpoints.

    When one of ``trainer.loggers`` is an ``MLFlowLogger``, global rank 0 adds an
    :class:`~diag.outputs.mlflow_sink.MLflowSink` (unless ``sinks`` holds one) that writes into that logger's run
    (``logger.run_id`` at the logger's tracking URI); the logger ends its run, the sink never does.
    """

    def __init__(
        self, logdir: str | os.PathLike | None = None, every: int | None = None, **monitor_kwargs: Any
    ) -> None:
        self.logdir, self.every, self.monitor_kwargs = logdir, every, callback_options(every, monitor_kwargs)
        self.monitor: Monitor | None = None
        self._pending_state: dict | None = None  # restored from a checkpoint before the Monitor exists
        self._loss: Tensor | None = None

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()
        # trainer.log_dir broadcasts from rank 0: every rank must ask
        logdir = Path(self.logdir) if self.logdir is not None else Path(trainer.log_dir) / "attnscope"
        main = trainer.is_global_zero
        kwargs = dict(self.monitor_kwargs)
        if not main:
            kwargs["sinks"] = ()
        else:
            kwargs["sinks"] = [*kwargs.get("sinks", ()), *_wandb_sinks(trainer, kwargs.get("sinks", ()))]
            if (logger := mlflow_logger(trainer)) is not None:
                from diag.outputs.mlflow_sink import MLflowSink

                kwargs = with_mlflow_sink(kwargs,
                                          lambda: MLflowSink(logger.run_id, tracking_uri=logger._tracking_uri))
        self.monitor = Monitor(pl_module, logdir if main else None, self.every,
                               purge_step=trainer.global_step or None, **kwargs)
        if self._pending_state:
            self.monitor.load_state_dict(self._pending_state)
        self._pending_state = None
        self._loss = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.monitor is None:  # every step's loss: the detectors read the mean loss since the last sample
            return
        value = loss.detach().float()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():  # 16-mixed scales the loss before this hook
            value = value / scaler.get_scale()
        self._loss = value if self._loss is None else self._loss + value

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.monitor is None:
            return
        step, loss = trainer.global_step, self._loss
        self._loss = None
        self.monitor.step(step, loss=loss)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close(measure_pending=getattr(trainer, "world_size", 1) == 1)  # no collective other ranks may not join

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        if self.monitor is not None:
            return self.monitor.state_dict()
        return dict(self._pending_state or {})

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """The layouts go into the checkpoint (``attnscope_layout``): ``python -m diag analyze`` reads them."""
        if self.monitor is not None:
            checkpoint[LAYOUT_KEY] = self.monitor.layout_document()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def close(self, measure_pending: bool = True) -> None:
        """Close the Monitor (pending update ratios, hooks, sinks); idempotent."""
        if self.monitor is not None:
            self.monitor.close(measure_pending)
