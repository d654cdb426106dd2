"""The callbacks write into the trainer's own MLflow run: a Hugging Face Trainer with ``report_to="mlflow"`` and a
Lightning Trainer with an ``MLFlowLogger``, both at a real MLflow server (SQLite store) on 127.0.0.1. The Monitor's
metrics are in that run, beside the trainer's own, and the experiment holds that one run only."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient
from transformers import Trainer

from diag.outputs.mlflow_sink import SHARED_RUN_PREFIX, MLflowSink, mlflow_key
from tests.hooks.integrations.test_integrations import LitGPT, gpt2, hf_args, lit_fit, token_dataset
from tests.support.mlflow_server import mlflow_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def monitor_metrics(logdir) -> dict[str, dict[int, float | None]]:
    out: dict[str, dict[int, float | None]] = {}
    for line in (logdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["tag"], {})[row["step"]] = row["value"]
    return out


def assert_in_run(client: MlflowClient, run_id: str, expected: dict[str, dict[int, float | None]]) -> None:
    """Every value of metrics.jsonl under ``attnscope/<tag>`` (a run the sink did not create)."""
    assert expected
    for tag, values in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_key(SHARED_RUN_PREFIX + tag))}
        assert set(got) == set(values), tag
        assert all(got[s] == v for s, v in values.items() if v is not None), tag


def test_hf_trainer_reporting_to_mlflow(server, tmp_path, monkeypatch):
    from hooks.integrations.hf import MonitorCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    callback = MonitorCallback(logdir=tmp_path / "attnscope", every=1)
    trainer = Trainer(model=gpt2(), args=hf_args(tmp_path, report_to="mlflow", run_name="hf-run"),
                      train_dataset=token_dataset(), callbacks=[callback])
    trainer.train()
    client = MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name("hf").experiment_id])
    assert len(runs) == 1  # the Trainer's run, and no other
    run = runs[0]
    assert run.info.run_name == "hf-run"
    trainer_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(trainer_loss) == [1, 2, 3, 4]  # the Trainer's own loss, apart from attnscope/loss
    [sink] = [s for s in callback.monitor.sinks.sinks if isinstance(s, MLflowSink)]
    assert sink.run_id == run.info.run_id and not sink.owns_run and sink.unsent == 0
    assert_in_run(client, run.info.run_id, monitor_metrics(tmp_path / "attnscope"))


def test_hf_keeps_the_users_own_mlflow_sink(server, tmp_path, monkeypatch):
    from hooks.integrations.hf import MonitorCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    mine = MLflowSink(tracking_uri=server, experiment="mine")
    callback = MonitorCallback(logdir=tmp_path / "attnscope", every=2, sinks=[mine])
    Trainer(model=gpt2(), args=hf_args(tmp_path, report_to="mlflow", max_steps=2), train_dataset=token_dataset(),
            callbacks=[callback]).train()
    assert [s for s in callback.monitor.sinks.sinks if isinstance(s, MLflowSink)] == [mine]


def test_lightning_mlflow_logger(server, tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger

    from hooks.integrations.lightning import MonitorCallback

    logger = MLFlowLogger(experiment_name="lightning", tracking_uri=server, run_name="lit-run")
    callback = MonitorCallback(logdir=tmp_path / "attnscope", every=1)
    lit_fit(tmp_path, LitGPT(), [callback], logger=logger)
    client = MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name("lightning").experiment_id])
    assert [r.info.run_id for r in runs] == [logger.run_id]
    assert "train_loss" in runs[0].data.metrics  # the logger's own metric, beside the Monitor's
    [sink] = [s for s in callback.monitor.sinks.sinks if isinstance(s, MLflowSink)]
    assert sink.run_id == logger.run_id and not sink.owns_run and sink.unsent == 0
    assert_in_run(client, logger.run_id, monitor_metrics(tmp_path / "attnscope"))
    assert client.get_run(logger.run_id).info.status == "FINISHED"  # ended by the logger
