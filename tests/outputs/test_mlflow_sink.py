"""MLflowSink against a real MLflow tracking server (SQLite store, local artifacts) started once for the module.

The demo's training, a few dozen steps with a logdir and an MLflowSink: every scalar of ``metrics.jsonl`` is read
back from the run (same steps, same values; null there is NaN in MLflow), the alerts are the run's tags and its
``attnscope/alerts.json``, the report is an artifact. Also: a user's active run is written into and left running
(no second run, the user's own metrics untouched); a record larger than MLflow's per-call limit arrives whole;
a server that is down does not reach training and the loss is reported.
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, path_not_unique, validate_param_and_metric_name

from diag.detectors.base import Alert
from diag.outputs.mlflow_sink import ALERT_TAG_PREFIX, MLflowSink, mlflow_key, tag_of_key
from diag.outputs.sinks import Record
from tests.support.mlflow_server import free_port, mlflow_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def same(a: float | None, b: float) -> bool:
    """A value of metrics.jsonl (None: not finite) and MLflow's."""
    return math.isnan(b) if a is None else a == b


def test_importing_diag_and_hooks_imports_no_mlflow():
    code = ("import sys, diag, hooks, diag.outputs.sinks, diag.outputs.mlflow_sink, hooks.monitor.monitor; "
            "print('mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("tag", ["loss", "qk_sigma1/L03/H07", "attn_entropy/L03.cross/min", "alerts/loss_spike",
                                 "x/L02/H00+H03", "a-b:c", "p%q", "entropé", "日本/L00", "-2b"])
def test_keys_are_valid_mlflow_names_and_read_back(tag):
    key = mlflow_key(tag)
    assert validate_param_and_metric_name(key) and not path_not_unique(key)
    assert ":" not in key  # Windows refuses it
    assert tag_of_key(key) == tag
    if re.fullmatch(r"[A-Za-z0-9_./ ]*", tag):
        assert key == tag  # the tags of diag keep their names


def demo_run(logdir: Path, sink: MLflowSink, steps: int = 40):
    """The demo's model, data and loop (hooks.demo), shorter, with the sink beside the logdir's files."""
    from hooks.demo import GPT, GPTConfig
    from hooks.demo.data import encode, get_batch, load_text
    from hooks.demo.loop import Schedule, adamw, train_steps
    from hooks.demo.run import DEFAULT_LR
    from hooks.monitor.monitor import Monitor

    cfg = GPTConfig()
    data, cfg.vocab_size = encode(load_text(200_000))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT(cfg)
    monitor = Monitor(model, logdir=logdir, every=10, sinks=[sink])
    try:
        train_steps(model, lambda: get_batch(data, cfg, gen), lambda batch: model(*batch), adamw(model, DEFAULT_LR),
                    steps, schedule=Schedule(0), monitor=monitor)
    finally:
        monitor.close()
    return monitor


def test_demo_run_is_in_mlflow(server, tmp_path):
    sink = MLflowSink(tracking_uri=server, experiment="demo", run_name="demo", flush_every=0.5)
    demo_run(tmp_path / "run", sink)
    assert sink.owns_run and sink.unsent == 0 and sink.prefix == ""  # its own run: the tags as they are
    client = MlflowClient(server)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"

    expected: dict[str, dict[int, float | None]] = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        expected.setdefault(row["tag"], {})[row["step"]] = row["value"]
    assert len(expected) > 50 and {tag_of_key(k) for k in run.data.metrics} == set(expected)
    for tag, values in expected.items():
        got = history(client, sink.run_id, mlflow_key(tag))
        assert set(got) == set(values), tag
        assert all(same(values[s], got[s]) for s in values), (tag, values, got)

    alerts = [json.loads(line) for line in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert alerts, "the demo configuration raises no alert: nothing of the alerts is tested"
    artifact = Path(client.download_artifacts(sink.run_id, "attnscope/alerts.json", str(tmp_path / "dl")))
    assert json.loads(artifact.read_text()) == alerts
    latest = {a["kind"]: a for a in alerts}
    tags = {k[len(ALERT_TAG_PREFIX):]: v for k, v in run.data.tags.items() if k.startswith(ALERT_TAG_PREFIX)}
    assert set(tags) == set(latest)
    for kind, a in latest.items():
        assert tags[kind].startswith(f"{a['status']} {a['level']}") and f"step {a['step']}" in tags[kind]
    assert "attnscope/report.html" in [f.path for f in client.list_artifacts(sink.run_id, "attnscope")]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_writes_into_the_users_active_run(server):
    mlflow.set_tracking_uri(server)
    try:
        experiment = mlflow.set_experiment("user")
        with mlflow.start_run() as run:
            for step in range(3):
                mlflow.log_metric("user_loss", 1.0 / (step + 1), step=step)
            sink = MLflowSink(flush_every=0.2)
            big = {f"m/L{i // 100:02d}/H{i % 100:02d}": float(i) for i in range(2 * MAX_METRICS_PER_BATCH + 500)}
            sink.write(Record(0, big))  # more than one log_batch call may carry
            sink.write(Record(1, {"loss": 2.0}))
            sink.write_alerts([Alert(1, "loss_spike", "warning", "", "the loss jumped")])
            sink.close()
            assert mlflow.active_run().info.run_id == run.info.run_id  # the user's run, still theirs
            client = MlflowClient(server)
            assert client.get_run(run.info.run_id).info.status == "RUNNING"
        assert sink.run_id == run.info.run_id and not sink.owns_run
        runs = client.search_runs([experiment.experiment_id])
        assert [r.info.run_id for r in runs] == [run.info.run_id]
        data = runs[0].data
        assert history(client, run.info.run_id, "user_loss") == {0: 1.0, 1: 0.5, 2: 1.0 / 3}
        assert sink.prefix == "attnscope/" and set(data.metrics) == {"user_loss", *map(sink.key, [*big, "loss"])}
        assert all(data.metrics["attnscope/" + k] == v for k, v in big.items()) and data.metrics["attnscope/loss"] == 2
        assert data.tags[ALERT_TAG_PREFIX + "loss_spike"].startswith("firing warning, step 1")
    finally:
        mlflow.set_tracking_uri(None)


def test_a_server_that_is_down_never_reaches_training(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast: the test waits for the close
    from hooks.demo import GPT, GPTConfig
    from hooks.monitor.monitor import Monitor

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, batch_size=2)
    model = GPT(cfg)
    sink = MLflowSink(tracking_uri=f"http://127.0.0.1:{free_port()}", flush_every=0.05, close_timeout=30)
    idx = torch.randint(0, 32, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="diag"), \
            Monitor(model, logdir=tmp_path / "run", every=1, sinks=[sink]) as monitor:
        for step in range(6):
            loss = model(idx, idx)
            loss.backward()
            monitor.step(step, loss=loss)
            opt.step()
            opt.zero_grad()
    assert sink.run_id is None and sink.unsent > 0
    messages = [r.getMessage() for r in caplog.records if "MLflowSink" in r.getMessage()]
    assert sum("cannot create a run" in m for m in messages) == 1  # reported once, however often it was tried
    lost = [m for m in messages if "did not reach" in m]
    assert len(lost) == 1 and f"{sink.unsent} of {sink.unsent} scalar values" in lost[0]
    assert str(tmp_path / "run" / "metrics.jsonl") in lost[0]


def test_values_beyond_max_pending_are_dropped_and_counted(monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    sink = MLflowSink(tracking_uri=f"http://127.0.0.1:{free_port()}", flush_every=60, close_timeout=30,
                      max_pending=10)
    with caplog.at_level(logging.WARNING, logger="diag"):
        for step in range(5):
            sink.write(Record(step, {f"m{i}": float(i) for i in range(4)}))
        assert sink.unsent <= 10
        sink.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("the oldest are dropped" in m for m in messages) == 1
    assert sum("20 of 20 scalar values did not reach" in m for m in messages) == 1


def test_demo_command_writes_its_run_to_the_tracking_server(server, tmp_path, capsys):
    """``python -m diag demo --mlflow URI``: a run of its own in the experiment attnscope-demo, named after the
    logdir, ended, holding every value of metrics.jsonl at its step; the command says where it is."""
    from diag.cli.main import main

    logdir = tmp_path / "demo-mlflow"
    assert main(["demo", "--logdir", str(logdir), "--steps", "3", "--every", "1", "--mlflow", server, "--quiet"]) == 0
    client = MlflowClient(server)
    experiment = client.get_experiment_by_name("attnscope-demo")
    (run,) = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'demo-mlflow'")
    assert run.info.status == "FINISHED"
    assert f"MLflow run:  {run.info.run_id} in experiment attnscope-demo at {server}" in capsys.readouterr().out
    expected: dict[str, dict[int, float | None]] = {}
    for line in (logdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        expected.setdefault(row["tag"], {})[row["step"]] = row["value"]
    assert len(expected) > 50 and {tag_of_key(k) for k in run.data.metrics} == set(expected)
    for tag, values in expected.items():
        got = history(client, run.info.run_id, mlflow_key(tag))
        assert set(got) == set(values) and all(same(values[s], got[s]) for s in values), (tag, values, got)
    assert "attnscope/report.html" in [f.path for f in client.list_artifacts(run.info.run_id, "attnscope")]

    # docs/integrations.md's snippet, as a user copies it, at this server: the newest run of attnscope-demo
    from tests.support.doc_snippets import python_block

    code = python_block("integrations.md", "**Reading a run back** from a script, with MLflow's client")
    assert '"http://127.0.0.1:5000"' in code
    scope: dict = {}
    exec(compile(code.replace('"http://127.0.0.1:5000"', repr(server)), "docs/integrations.md", "exec"), scope)  # noqa: S102
    assert scope["run"].info.run_id == run.info.run_id
    wanted = expected["qk_sigma1/L00/max"]
    assert len(wanted) == 3 and len(scope["points"]) == 3
    assert all(same(wanted[step], value) for step, value in scope["points"])


def test_demo_command_exits_1_when_the_server_gets_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    from diag.cli.main import main

    logdir = tmp_path / "demo-down"
    uri = f"http://127.0.0.1:{free_port()}"
    assert main(["demo", "--logdir", str(logdir), "--steps", "2", "--every", "1", "--mlflow", uri, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"error: --mlflow {uri}: " in err and "values did not reach the tracking server" in err
    assert str(logdir / "metrics.jsonl") in err and (logdir / "metrics.jsonl").stat().st_size > 0
