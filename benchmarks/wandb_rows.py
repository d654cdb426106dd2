"""Every row of a user's W&B run, read back right after ``run.finish()``: the user loop many times, several at once,
beside other W&B runs.

    python benchmarks/wandb_rows.py --runs 30 --at-once 3 --others 1 --late-every 5

The user loop, as a user writes it: ``wandb.init`` (offline), a 2-layer GPT-2 (transformers, built from a config)
with ``Monitor(model, every=1, sinks=[WandbSink()])``, 6 steps of AdamW, each ``monitor.step(t, loss=loss)`` then
the user's own ``wandb.log({"user/loss": ...}, step=t)``, ``monitor.close()``, ``run.finish()``. Right after
``run.finish()`` the run is read back twice:

* at once, without waiting (``read_offline_run(..., partial=True)``: ``wandb leet inspect --json`` alone), which
  gets what is on disk at that moment;
* with :func:`diag.outputs.wandb_read.read_offline_run`, which waits for the run's exit record.

Each must hold ``user/loss`` at every step 0-5 and every Monitor step 0-5 (``attnscope/step``).

``--at-once N`` processes run the loops (``--runs`` split between them, one after another in each) while
``--others`` processes write other offline W&B runs (tables and images, row after row) until the loops are done.
W&B's service writes the end of a run's file when it closes the run, on a message ``run.finish()`` sends without
waiting for an answer (docs/integrations.md#weights-biases, "Reading a run back"); every ``--late-every``-th
run of each process holds that message back for ``--late`` seconds, as a machine too busy to run the service
promptly does: there the read at once misses rows, so does any reader that starts within those seconds and does
not wait for the exit record (``wandb leet inspect --json`` alone takes 1-4 s to start), and ``read_offline_run``
must still get them all.

Prints one line per run and the counts; exits 1 when a run read with ``read_offline_run`` lacks a row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 6


def offline_env(home: Path) -> dict[str, str]:
    from tests.support.wandb_runs import offline_env

    return {**os.environ, **offline_env(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


def _hold_finish(seconds: float):
    """Sends W&B's finish message ``seconds`` late; returns the function that undoes it."""
    from wandb.sdk.lib.service import service_connection

    cls = service_connection.ServiceConnection
    send = cls.inform_finish

    def late(conn, run_id: str) -> None:
        threading.Timer(seconds, send, (conn, run_id)).start()

    cls.inform_finish = late
    return lambda: setattr(cls, "inform_finish", send)


def _steps(rows: list[dict], key: str, step: str) -> list:
    return sorted(row[step] for row in rows if key in row)


def user_loop(home: Path, late: float, at_once: bool) -> dict:
    """One run of the user loop, read back right after ``run.finish()``: with read_offline_run, and (``at_once``)
    as a reader that does not wait sees it, from a copy of the file taken the moment ``run.finish()`` returned."""
    import torch
    import wandb

    from diag.outputs.wandb_read import read_offline_run
    from diag.outputs.wandb_sink import STEP_METRIC, WandbSink
    from hooks import Monitor

    model = _gpt2()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = wandb.init(project="attnscope-rows", dir=str(home))
    monitor = Monitor(model, every=1, sinks=[WandbSink()])
    for t in range(STEPS):
        ids = torch.randint(0, 50, (3, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        monitor.step(t, loss=loss)
        opt.step()
        opt.zero_grad()
        wandb.log({"user/loss": loss.item()}, step=t)
    monitor.close()
    run_dir = Path(run.dir).parent
    log = run_dir / f"run-{run.id}.wandb"
    copy = home / "at-finish" / run_dir.name / log.name
    undo = _hold_finish(late) if late else (lambda: None)
    try:
        run.finish()
        if at_once:
            copy.parent.mkdir(parents=True)
            shutil.copyfile(log, copy)
        at_finish = log.stat().st_size
        rows = read_offline_run(run_dir).history
    finally:
        undo()
    out = {"run": run_dir.name, "late": late, "bytes_at_finish": at_finish, "bytes": log.stat().st_size,
           "read": {"user": _steps(rows, "user/loss", "_step"), "monitor": _steps(rows, STEP_METRIC, STEP_METRIC)}}
    if at_once:
        early = read_offline_run(copy, partial=True).history
        out["at_once"] = {"user": _steps(early, "user/loss", "_step"),
                          "monitor": _steps(early, STEP_METRIC, STEP_METRIC)}
    return out


def worker(home: Path, runs: int, late: float, late_every: int, at_once: bool) -> None:
    """``runs`` user loops one after another; one JSON line per run on stdout."""
    for i in range(runs):
        hold = late if late_every and i % late_every == late_every - 1 else 0.0
        print(json.dumps(user_loop(home, hold, at_once or hold > 0)), flush=True)


def others(home: Path, stop: Path) -> None:
    """Other offline W&B runs until ``stop`` exists: 20 rows each, a table and an image a row, 50 ms apart."""
    import numpy as np
    import wandb

    while not stop.exists():
        run = wandb.init(project="attnscope-others", dir=str(home))
        for t in range(20):
            run.log({"x": t, "img": wandb.Image(np.full((16, 16, 3), t, np.uint8)),
                     "tab": wandb.Table(columns=["a"], data=[[t]])})
            time.sleep(0.05)
        run.finish()


def complete(side: dict) -> bool:
    return side["user"] == list(range(STEPS)) and side["monitor"] == list(range(STEPS))


def _spawn(args: list[str], home: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], env=offline_env(home), cwd=ROOT, text=True, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="user loops in all (default: 30)")
    parser.add_argument("--at-once", type=int, default=3, help="processes running user loops (default: 3)")
    parser.add_argument("--others", type=int, default=1, help="processes writing other W&B runs (default: 1)")
    parser.add_argument("--late", type=float, default=8.0, help="seconds W&B's finish message is held back in "
                        "the late runs (default: 8, longer than a reader takes to start on a busy machine)")
    parser.add_argument("--late-every", type=int, default=5, help="every Nth run of each process is late; 0: "
                        "none (default: 5)")
    parser.add_argument("--read-at-once", action="store_true", help="in every run, not only the late ones, also "
                        "read the copy of the file taken when run.finish() returned")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-run results here")
    parser.add_argument("--worker", type=int, metavar="RUNS", help=argparse.SUPPRESS)
    parser.add_argument("--others-until", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(Path(os.environ["WANDB_DIR"]), args.worker, args.late, args.late_every, args.read_at_once)
        return 0
    if args.others_until:
        others(Path(os.environ["WANDB_DIR"]), args.others_until)
        return 0
    with tempfile.TemporaryDirectory(prefix="wandb-rows-") as tmp:
        return drive(args, args.out or Path(tmp))


def _shown(side: dict | None) -> str:
    return "-" if side is None else "every row" if complete(side) else f"user {side['user']} monitor {side['monitor']}"


def drive(args: argparse.Namespace, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    stop = out / "stop"
    start = time.perf_counter()
    bg = [_spawn(["--others-until", str(stop)], out / f"others{j}", stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL) for j in range(args.others)]
    shares = [args.runs // args.at_once + (i < args.runs % args.at_once) for i in range(args.at_once)]
    flags = ["--late", str(args.late), "--late-every", str(args.late_every)] + ["--read-at-once"] * args.read_at_once

    def one(i: int) -> tuple[list[dict], str]:
        proc = _spawn(["--worker", str(shares[i]), *flags], out / f"loops{i}", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
        stdout, stderr = proc.communicate()
        return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")], stderr

    try:
        with ThreadPoolExecutor(args.at_once) as pool:
            done = list(pool.map(one, range(args.at_once)))
    finally:
        stop.touch()
        for proc in bg:
            proc.wait(120)
    results = [r for rs, _ in done for r in rs]
    for r in results:
        print(f"{r['run']:40s} late {r['late']:3.1f} s  bytes at finish {r['bytes_at_finish']:7d} of {r['bytes']:7d}"
              f"  read at once: {_shown(r.get('at_once'))}  read_offline_run: {_shown(r['read'])}")
    for (rs, err), share in zip(done, shares):
        if len(rs) < share:
            print(f"a process ran {len(rs)} of its {share} loops:\n{err[-3000:]}", file=sys.stderr)
    kept = sum(complete(r["read"]) for r in results)
    short = sum(r["bytes_at_finish"] < r["bytes"] for r in results)
    read = [r["at_once"] for r in results if "at_once" in r]
    print(f"{len(results)} of {args.runs} runs in {time.perf_counter() - start:.0f} s; the end of the file not yet on "
          f"disk when run.finish() returned: {short}; read at once: {sum(map(complete, read))} of {len(read)} kept "
          f"every row; read_offline_run: {kept} of {len(results)} kept every row")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if kept == len(results) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
