"""The callbacks write into the trainer's own W&B run, offline: a Hugging Face Trainer with ``report_to="wandb"``
and a Lightning Trainer with ``WandbLogger(offline=True)``. Read back from the run's ``.wandb`` file: the Monitor's
metrics are in the trainer's run (same run id) and no second run was started."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import wandb

from diag.outputs.wandb_read import read_offline_run
from diag.outputs.wandb_sink import STEP_METRIC, WandbSink, wandb_key
from tests.support import wandb_runs, zoo


def _monitor_keys(rows: list[dict]) -> set[tuple[int, str]]:
    return {(row[STEP_METRIC], key) for row in rows if STEP_METRIC in row for key, value in row.items()
            if "/" in key and not key.startswith(("_", "train/", "trainer/", "attnscope_charts/"))
            and key != STEP_METRIC and isinstance(value, int | float) and "." not in key}


def _metrics(logdir: Path) -> set[tuple[int, str]]:
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert rows
    return {(r["step"], wandb_key(r["tag"])) for r in rows}


def test_hf_trainer_reporting_to_wandb_gets_the_monitor_in_its_run(tmp_path, offline):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from hooks.integrations.hf import MonitorCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2),
                                         attn_implementation="eager")
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=5e-3, logging_steps=1, report_to="wandb", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_pin_memory=False, run_name="hf-run")
    callback = MonitorCallback(logdir=tmp_path / "logs", every=1, images=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    sinks = [s for s in callback.monitor.sinks.sinks if isinstance(s, WandbSink)]
    assert len(sinks) == 1 and not sinks[0].own
    run = wandb.run
    assert run is not None and sinks[0].run is run  # the Trainer's run, still open: not the sink's to finish
    run_dir = Path(run.dir).parent
    run.finish()

    assert wandb_runs.run_dirs(offline) == [run_dir]  # one run
    back = read_offline_run(run_dir)
    assert back.run_id == run.id
    rows = back.history
    assert _monitor_keys(rows) == _metrics(tmp_path / "logs")
    assert [r["train/global_step"] for r in rows if "train/loss" in r] == [1, 2, 3]  # the Trainer's own rows


def test_hf_trainer_without_wandb_gets_no_wandb_sink(tmp_path, offline):
    from transformers import TrainingArguments

    from hooks.integrations.hf import _reports_to_wandb

    assert not _reports_to_wandb(TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    assert _reports_to_wandb(TrainingArguments(output_dir=str(tmp_path), report_to=["tensorboard", "wandb"]))


class _Lit:
    @staticmethod
    def module():
        import lightning.pytorch as pl

        class LitGPT(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.model = zoo.NanoGPT()

            def training_step(self, batch, batch_idx):
                (ids,) = batch
                loss = zoo._lm_loss(self.model(ids), ids)
                self.log("train_loss", loss)
                return loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=5e-3)

        return LitGPT()


def test_lightning_wandb_logger_gets_the_monitor_in_its_run(tmp_path, offline):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import WandbLogger

    from hooks.integrations.lightning import MonitorCallback

    logger = WandbLogger(offline=True, save_dir=str(tmp_path / "lit"), project="attnscope-lit")
    callback = MonitorCallback(logdir=tmp_path / "logs", every=1, images=False)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=logger, callbacks=[callback],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         log_every_n_steps=1)
    ids = torch.randint(0, zoo.VOCAB, (9, zoo.SEQ), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(_Lit.module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=3))
    (sink,) = [s for s in callback.monitor.sinks.sinks if isinstance(s, WandbSink)]
    run = logger.experiment
    assert sink.run is run and not sink.own
    run_dir = Path(run.dir).parent
    run.finish()

    assert wandb_runs.run_dirs(tmp_path / "lit") == [run_dir] and wandb_runs.run_dirs(offline) == []
    back = read_offline_run(run_dir)
    assert back.run_id == run.id
    rows = back.history
    assert _monitor_keys(rows) == _metrics(tmp_path / "logs")
    assert [r["trainer/global_step"] for r in rows if "train_loss" in r] == [0, 1, 2]  # Lightning's own rows


def test_a_wandb_sink_in_sinks_is_the_only_one(tmp_path, offline):
    """A user who passes a WandbSink gets no second one from the integration."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import WandbLogger

    from hooks.integrations.lightning import _wandb_sinks

    logger = WandbLogger(offline=True, save_dir=str(tmp_path / "lit"))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False)
    own = WandbSink(start_run=False)
    assert _wandb_sinks(trainer, [own]) == []
    (made,) = _wandb_sinks(trainer, [])
    assert made.run is logger.experiment
