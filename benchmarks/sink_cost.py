"""What the MLflow sink costs a training step, at the default cadence, on a 32-layer x 32-head metric set.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sink_cost.py --steps 400   # ~3 min on 2 cores
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sink_cost.py --per-head   # every head, 1,024 heads

1. The metric set: the Monitor at its default cadence (every=None) on a 32-layer, 32-head GPT of tiny width
   (hooks.demo's model, d_model 64) for one whole period of the cadence (100 steps, the update ratios' period),
   into a MemorySink: the records, with the tags the Monitor writes for 32 x 32 heads.
2. A real MLflow server on 127.0.0.1 (SQLite store, tests/support/mlflow_server.py).
3. In one process, with one torch thread:
   * the time the training thread spends in ``MLflowSink.write`` for the 32 x 32 records of one period,
     per step;
   * the same records sent synchronously (``Metric`` objects and ``log_batch`` on the caller's thread), per step:
     what a sink with no sender thread would cost;
   * the demo (``python -m diag demo``'s model and data, Monitor at the default cadence, no logdir), paired: two
     copies trained one step of each in turn, one plain, one whose steps also feed an MLflowSink the 32 x 32
     records the cadence gives that step (replayed from 1.); the difference in wall time and in the training
     thread's CPU time, and the CPU time of the other threads (the sender's conversion and sends).
Prints each, and each as a fraction of the demo's step time. No result is asserted: the numbers go to
docs/cost.md#mlflow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diag.outputs.sinks import MemorySink, Record  # noqa: E402
from hooks.demo import GPT, GPTConfig  # noqa: E402
from hooks.demo.data import encode, get_batch, load_text  # noqa: E402
from hooks.demo.loop import adamw  # noqa: E402
from hooks.demo.run import DEFAULT_LR  # noqa: E402
from hooks.monitor.monitor import Monitor  # noqa: E402
from tests.support.mlflow_server import mlflow_server  # noqa: E402

PERIOD = 100  # steps of the default cadence after which every family has been sampled (updates: every 100)


def big_records(per_head: bool | None) -> dict[int, list[Record]]:
    """{step within the period: the records the Monitor wrote at that step} for 32 layers x 32 heads."""
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=32, n_head=32, n_embd=64, batch_size=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    memory = MemorySink()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 32))
    with Monitor(model, every=None, sinks=[memory], per_head=per_head) as monitor:
        for step in range(PERIOD + 1):  # the update ratios of step 0 are written at step 1
            loss = model(idx, idx)
            loss.backward()
            monitor.step(step, loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    out: dict[int, list[Record]] = {}
    for r in memory.records:
        if r.step >= PERIOD:
            continue
        out.setdefault(r.step % PERIOD, []).append(r)
    return out


class Demo:
    """The demo's model, data, optimizer and a Monitor at the default cadence; :meth:`step` trains one step and
    returns its (wall, training-thread CPU) seconds; ``extra(step)`` runs after the Monitor's step."""

    def __init__(self, extra=None) -> None:
        self.cfg = GPTConfig()
        self.data, self.cfg.vocab_size = encode(load_text(500_000))
        torch.manual_seed(0)
        self.gen = torch.Generator().manual_seed(0)
        self.model = GPT(self.cfg)
        self.opt = adamw(self.model, DEFAULT_LR)
        self.monitor = Monitor(self.model, every=None)
        self.extra, self.n = extra, 0

    def step(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        loss = self.model(*get_batch(self.data, self.cfg, self.gen))
        loss.backward()
        self.monitor.step(self.n, loss=loss)
        if self.extra is not None:
            self.extra(self.n)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.n += 1
        return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="demo steps per measurement (default 200)")
    parser.add_argument("--per-head", action="store_true", help="the 32 x 32 set with every head's scalars "
                        "(Monitor(per_head=True)); default: the Monitor's default, per-layer statistics at 1,024 heads")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the demo's compute on the training thread: its CPU time is the step's
    from diag.outputs.mlflow_sink import MLflowSink

    t0 = time.perf_counter()
    records = big_records(True if args.per_head else None)
    n_values = sum(len(r.scalars) for rs in records.values() for r in rs)
    n_tags = len({t for rs in records.values() for r in rs for t in r.scalars})
    print(f"32 layers x 32 heads{', per_head=True' if args.per_head else ''}, default cadence: {n_values} scalar "
          f"values in one period of {PERIOD} steps ({n_values / PERIOD:.0f} per step on average; {n_tags} tags), "
          f"collected in {time.perf_counter() - t0:.0f} s")

    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp) / "server") as uri:
        # the training thread's time in write(), one period
        sink = MLflowSink(tracking_uri=uri, experiment="sink_cost", flush_every=5.0)
        t = time.perf_counter()
        for step in range(PERIOD):
            for r in records.get(step, ()):
                sink.write(r)
        write_s = (time.perf_counter() - t) / PERIOD
        t = time.perf_counter()
        sink.close()
        drain_s = time.perf_counter() - t
        assert sink.unsent == 0

        # the same records sent on the caller's thread: conversion and log_batch, in MLflow's chunks
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        run_id = client.create_run(client.get_experiment_by_name("sink_cost").experiment_id).info.run_id
        t = time.perf_counter()
        for step in range(PERIOD):
            metrics = [Metric(k, v, int(time.time() * 1000), r.step) for r in records.get(step, ())
                       for k, v in r.scalars.items()]
            for i in range(0, len(metrics), 1000):
                client.log_batch(run_id, metrics=metrics[i: i + 1000], synchronous=True)
        sync_s = (time.perf_counter() - t) / PERIOD
        client.set_terminated(run_id)

        # the demo, paired: two copies, one plain and one whose Monitor also feeds an MLflowSink the 32 x 32
        # records of each step, one step of each in turn (a drift of the machine hits both alike)
        sink = MLflowSink(tracking_uri=uri, experiment="sink_cost", flush_every=5.0)

        def replay(step: int) -> None:
            for r in records.get(step % PERIOD, ()):
                sink.write(Record(step, r.scalars))

        plain, fed = Demo(), Demo(replay)
        for _ in range(5):  # warm-up: allocator, first samples
            plain.step()
            fed.step()
        base, with_sink = [], []
        p0 = time.process_time()
        for _ in range(args.steps):
            base.append(plain.step())
            with_sink.append(fed.step())
        other_cpu = time.process_time() - p0 - sum(c for _, c in base + with_sink)  # threads other than this one
        sink.close()
        plain.monitor.close()
        fed.monitor.close()

    step_wall = statistics.mean(w for w, _ in base)
    step_cpu = statistics.mean(c for _, c in base)
    print(f"\ndemo step (4 layers x 2 heads, d_model 128, batch 16 x 128, default cadence, torch threads "
          f"{torch.get_num_threads()}), {args.steps} steps: wall {step_wall * 1e3:.1f} ms (median "
          f"{statistics.median(w for w, _ in base) * 1e3:.1f}), training-thread CPU {step_cpu * 1e3:.1f} ms")
    print(f"{'':58s}{'per step':>12s}{'/ demo step':>14s}")
    rows = [
        ("MLflowSink.write on the training thread (wall)", write_s, step_wall),
        ("sending the same synchronously, no sender thread (wall)", sync_s, step_wall),
        ("paired: training-thread CPU with the sink minus without",
         statistics.mean(c for _, c in with_sink) - step_cpu, step_cpu),
        ("paired: wall with the sink minus without", statistics.mean(w for w, _ in with_sink) - step_wall, step_wall),
        ("paired: CPU of the other threads (the sender)", other_cpu / args.steps, step_cpu),
    ]
    for name, s, ref in rows:
        print(f"{name:58s}{s * 1e3:10.3f} ms{s / ref:13.2%}")
    print(f"close() with a period's records buffered: {drain_s:.2f} s (the last send, the end of the run)")


if __name__ == "__main__":
    main()
