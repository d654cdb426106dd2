"""Each example in examples/ runs as a script (``sys.executable``, a temporary ``--logdir``) and writes
what it says: the tags at the sampled steps, alerts that agree with what it printed, the Trainer's
TensorBoard run beside the Monitor's with the step convention the docs state, the detector state in
a Lightning checkpoint, a checkpoint analysis that equals the live run. (examples/06_timm_vit.py runs
in tests/integration/test_timm.py, in .venv-timm.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(command: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def run_example(name: str, *args: str) -> str:
    """A user example, run as a script."""
    return _run([str(ROOT / "examples" / name), *args])


def run_evaluation(module: str, *args: str) -> str:
    """A module of the evaluation package, run from the checkout as ``python -m evaluation.<module>``."""
    return _run(["-m", f"evaluation.{module}", *args])


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(rows: list[dict], tag: str) -> list[int]:
    return sorted(r["step"] for r in rows if r["tag"] == tag)


def printed_alerts(stdout: str) -> list[tuple[int, str, str, str]]:
    rows = [line.split() for line in stdout.splitlines() if line.startswith("alert ")]
    return sorted((int(r[2]), r[3], r[4], r[5] if len(r) > 5 else "") for r in rows)


def written_alerts(path: Path) -> list[tuple[int, str, str, str]]:
    alerts = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((a["step"], a["level"], a["kind"], a["where"]) for a in alerts)


def check_live_run(logdir: Path, stdout: str, sampled: list[int]) -> list[dict]:
    """The four signal families and the loss at the sampled steps; alerts written == alerts printed."""
    rows = metrics(logdir / "metrics.jsonl")
    for tag in ("qk_sigma1/L00/H00", "attn_entropy/L01/H01", "grad_norm_q/L00/H00", "update_ratio_q/L01", "loss"):
        assert steps_of(rows, tag) == sampled, tag
    assert all(r["value"] is not None for r in rows if r["tag"] == "loss")
    assert list(logdir.glob("events.out.tfevents.*"))
    alerts = printed_alerts(stdout)
    assert alerts == (written_alerts(logdir / "alerts.jsonl") if alerts else [])
    return rows


def test_plain_loop(tmp_path):
    out = run_example("01_plain_loop.py", "--logdir", str(tmp_path), "--steps", "15")
    check_live_run(tmp_path, out, [0, 5, 10])
    # no warmup, lr 5e-3: the first updates are as large as the weights, and an info note says what that is (no
    # collapse warning)
    assert any(kind == "large_early_updates" for _, _, kind, _ in printed_alerts(out))
    assert f"tensorboard --logdir {tmp_path}" in out


def test_hf_trainer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_example("04_hf_trainer.py", "--logdir", str(tmp_path), "--steps", "10")
    rows = check_live_run(tmp_path / "attnscope", out, [0, 5])
    (hf_run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    events = EventAccumulator(str(hf_run))
    events.Reload()
    hf_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(hf_loss) == list(range(1, 11))
    for row in rows:
        if row["tag"] == "loss":  # the Trainer logs optimizer step t's loss at global_step t + 1
            assert row["value"] == pytest.approx(hf_loss[row["step"] + 1], rel=1e-5)
    assert f"tensorboard --logdir {tmp_path}" in out


def test_lightning_fit(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_example("05_lightning_fit.py", "--logdir", str(tmp_path), "--steps", "10")
    version = tmp_path / "lightning_logs" / "version_0"
    check_live_run(version / "attnscope", out, [0, 5])
    events = EventAccumulator(str(version))
    events.Reload()
    assert "train_loss" in events.Tags()["scalars"]
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["MonitorCallback"]
    assert len(state["detectors"]["losses"]) == 2  # the losses of sampled steps 0 and 5
    assert f"tensorboard --logdir {tmp_path / 'lightning_logs'}" in out


def test_analyze_checkpoints(tmp_path):
    out = run_example("03_analyze_checkpoints.py", "--logdir", str(tmp_path), "--steps", "15")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt_0000.pt", "ckpt_0005.pt", "ckpt_0010.pt"]
    live, offline = metrics(tmp_path / "live" / "metrics.jsonl"), metrics(tmp_path / "analyze" / "metrics.jsonl")
    spectra = {(r["step"], r["tag"]): r["value"] for r in live if r["tag"].startswith("qk_")}
    compared = 0
    for row in offline:
        if row["tag"].startswith("qk_") and (row["step"], row["tag"]) in spectra:
            assert row["value"] == pytest.approx(spectra[row["step"], row["tag"]], rel=1e-6), row
            compared += 1
    assert compared >= 3 * 2 * 2 * 4  # 3 checkpoints x 2 layers x 2 heads x 4 spectral metrics at least
    assert steps_of(offline, "update_ratio_q/L00") == [0, 5]  # between consecutive checkpoints
    assert (tmp_path / "analyze" / "report" / "index.html").exists()
    assert (tmp_path / "analyze" / "report" / "sigma1.png").exists()
    table = [line.split() for line in out.splitlines() if line[:4].strip().isdigit() and "L0" in line]
    assert len(table) == 6 and all(float(r[2]) == pytest.approx(float(r[3]), rel=1e-5) for r in table)
    # The live run notes its first update (one step, a ratio over note_ratio = 0.25); the analysis's update at
    # step 0 spans the 5 steps to the next checkpoint, judged by the least ratio one of them had, (1 + r)^(1/5) - 1
    assert [a[2] for a in written_alerts(tmp_path / "live" / "alerts.jsonl")][:1] == ["large_early_updates"]
    first = max(r["value"] for r in offline if r["step"] == 0 and r["tag"].startswith(("update_ratio_q/L",
                                                                                        "update_ratio_k/L")))
    noted = [a for a in written_alerts(tmp_path / "analyze" / "alerts.jsonl") if a[2] == "large_early_updates"]
    assert bool(noted) == ((1 + first) ** (1 / 5) - 1 >= 0.25), first


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert", "modernbert", "roformer", "vit"])
def test_evaluation_records_each_healthy_family_with_a_zero_configuration_monitor(tmp_path, model):
    """The healthy side of docs/alerts.md#evaluation, shortened: each family is monitored with no arguments
    (its per-head tags reach the detectors), the recorder keeps what they saw at the default cadence
    (the closer look asks them ``wants_attention`` every step: a recorder hiding it made every update sample
    fail), its loss falls, and evaluation/detectors.py judges the recording: 30 steps raise no alert."""
    import warnings

    from evaluation import detectors as evaluate_detectors
    from evaluation.runs import record
    from evaluation.spec import RunSpec
    from evaluation.truth import load_run

    spec = RunSpec("hf", 3, 1e-3, 30, model=model, every=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(record(spec, tmp_path))
    assert not [w for w in caught if "failed at this step" in str(w.message)], [str(w.message) for w in caught]
    assert run.name == f"hf-{model}-lr0.001-s3" and len(run.losses) == 30
    assert sum(run.losses[-5:]) < sum(run.losses[:5])
    assert [o.step for o in run.obs if o.loss is not None] == [0, 10, 20]  # the default cadence's loss samples
    layers = [m for o in run.obs for m in o.layers.values()]
    assert any("update_ratio_q" in m for m in layers) and any(len(m.get("attn_entropy", ())) == 4 for m in layers)
    row = evaluate_detectors.judge_hf(run, evaluate_detectors.AlertConfig(), "default", None)
    assert row["bad"] == [] and row["plateau_alerts"] == 0


def test_the_normsoftmax_twin_of_a_language_model_trains(tmp_path):
    """The causal twin of a language model's plateau (evaluation/healthy.py): NormSoftmax as a transformers
    attention function, with causal rows of one key (no spread: its gradient must stay finite)."""
    from evaluation.runs import record
    from evaluation.spec import RunSpec
    from evaluation.truth import load_run

    run = load_run(record(RunSpec("hf", 0, 1e-3, 20, model="gpt2", every=0, twin="normsoftmax"), tmp_path))
    assert all(math.isfinite(x) for x in run.losses) and sum(run.losses[-5:]) < sum(run.losses[:5])


def test_a_masked_model_without_an_attention_function_has_no_normsoftmax_twin_and_says_so(tmp_path):
    """RoFormer computes its attention in its own code: a NormSoftmax "twin" would silently be the softmax run,
    so it is refused, naming the model, why and what to take instead."""
    from evaluation.healthy import train_spec
    from evaluation.spec import RunSpec

    with pytest.raises(ValueError, match=r"model='roformer'.*no NormSoftmax twin.*modernbert"):
        train_spec(RunSpec("hf", 0, 1e-3, 5, model="roformer", every=0, twin="normsoftmax"), tmp_path)


def test_zero_config_sweep_prints_one_row_per_model_and_attention():
    """evaluation/sweep.py on three Hugging Face types: a decoder measured whole at both attention
    settings, CodeGen (its [Q | V | K] groups read from the kernel, no spec) and Longformer (weight side only,
    and no SDPA attention in transformers)."""
    out = run_evaluation("sweep", "--hf", "llama", "codegen", "longformer")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| model")}
    assert rows[("llama", "eager")][:4] == rows[("llama", "sdpa")][:4] == ["2", "2", "2", "0"]
    assert rows[("codegen", "sdpa")][:4] == ["2", "2", "2", "0"] and rows[("codegen", "sdpa")][4] == "q,k"
    assert rows[("longformer", "eager")][:4] == ["2", "2", "0", "0"]
    assert "no sdpa attention" in rows[("longformer", "sdpa")][0]


def test_alert_webhook_example_posts_each_episode_once(tmp_path):
    """examples/07_alert_webhook.py at a local HTTP server that records the posts: one post per alert record of
    alerts.jsonl at or above --min-level (the first steps at lr 5e-3 raise large_early_updates, info)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    posts: list[dict] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = run_example("07_alert_webhook.py", "--steps", "12", "--min-level", "info", "--logdir",
                          str(tmp_path / "run"), "--url", f"http://127.0.0.1:{server.server_address[1]}/hook")
    finally:
        server.shutdown()
        server.server_close()
    alerts = [json.loads(line) for line in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert alerts and len(posts) == len({(a["kind"], a["where"], a["since"], a["status"]) for a in alerts})
    assert f"{len(posts)} message(s) posted" in out
    assert all(set(p) == {"text"} and "diag alert " in p["text"] for p in posts)
