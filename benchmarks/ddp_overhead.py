"""What watching costs under DDP (or FSDP2): monitored vs unmonitored step time, side by side.

    .venv/bin/python benchmarks/ddp_overhead.py                       # 2 CPU processes (gloo), tiny GPT-2
    .venv/bin/python benchmarks/ddp_overhead.py --nproc 2 --model small --every 10 --rounds 5
    .venv/bin/python benchmarks/ddp_overhead.py --fsdp                # FSDP2 (fully_shard) instead of DDP

Launches itself with ``torch.distributed.run`` (gloo on CPU, NCCL when CUDA is there).
Each round trains ``--every`` steps per window (a whole sampling period: one sampled
step, one update-ratio step, the rest non-sampled) twice, back to back on the same
model: once without a Monitor, once with ``Monitor(every=--every)`` attached. A step is
forward, backward, ``monitor.step``, optimizer step; its time is the slowest rank's.
Prints per round the ratio monitored/unmonitored, then the median (min, max) ratio and
the median time of a non-sampled ``monitor.step`` call. Not a test: machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

SHAPES = {"small": (12, 12, 768), "tiny": (2, 4, 64)}


def build(size: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, heads, width = SHAPES[size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=8192, n_positions=256)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def wrap(model: torch.nn.Module, fsdp: bool, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def window(model, opt, ids, steps: int, start: int, monitor) -> tuple[float, list[float]]:
    """Seconds for ``steps`` training steps (slowest rank) and the non-sampled monitor.step times."""
    quiet = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(start, start + steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if monitor is not None:
            t = time.perf_counter()
            monitor.step(step, loss=loss)
            if step % monitor.every not in (0, 1):  # neither sampled nor measuring an update
                quiet.append(time.perf_counter() - t)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # outside the timed window
    return float(elapsed), quiet


def worker(args: argparse.Namespace) -> None:
    from diag.outputs.sinks import MemorySink
    from hooks.monitor.monitor import Monitor

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = wrap(build(args.model), args.fsdp, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=gen).to(device)
    window(model, opt, ids, 2, 0, None)  # warm-up
    ratios, quiet, step = [], [], 0
    for _ in range(args.rounds):
        plain, _ = window(model, opt, ids, args.every, step, None)
        monitor = Monitor(model, every=args.every, sinks=[MemorySink()])
        watched, q = window(model, opt, ids, args.every, 0, monitor)
        monitor.close()
        ratios.append(watched / plain)
        quiet += q
        step += args.every
        if rank == 0:
            print(f"round: {args.every} steps unmonitored {plain:.3f} s, monitored {watched:.3f} s, "
                  f"ratio {watched / plain:.3f}", flush=True)
    if rank == 0:
        kind = "FSDP2" if args.fsdp else "DDP"
        print(f"{kind}, {dist.get_world_size()} ranks, {args.model}, batch {args.batch}x{args.seq} per rank, "
              f"every={args.every}: monitored/unmonitored step time median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} rounds")
        if quiet:
            print(f"non-sampled monitor.step: median {statistics.median(quiet) * 1e6:.1f} us")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
