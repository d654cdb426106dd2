"""Memory over a long run: resident memory every N steps with the Monitor at every=1.

    .venv/bin/python benchmarks/soak.py --steps 20000 --report 1000

A tiny nanoGPT-style model (the demo's architecture, 2 layers x 2 heads, d_model
32, context 32) trains on random tokens with ``Monitor(model, logdir, every=1)``:
every step is sampled, so every code path of the monitor runs 20,000 times. The
script prints the resident set size (from /proc/self/statm) every ``--report``
steps and, at the end, the growth between the first report and the last.
Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import torch

from hooks.demo import GPT, GPTConfig
from hooks.monitor.monitor import Monitor


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--report", type=int, default=1_000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, batch_size=4)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    seen = []
    with tempfile.TemporaryDirectory() as logdir, Monitor(model, logdir=logdir, every=1) as monitor:
        start = time.perf_counter()
        for step in range(args.steps):
            x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=gen)
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            monitor.step(step, loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.report == 0 or step == args.steps - 1:
                seen.append(rss_mib())
                print(f"step {step:6d}  rss {seen[-1]:8.1f} MiB  {time.perf_counter() - start:7.1f}s", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"growth from the first report to the last: {seen[-1] - seen[0]:+.1f} MiB; peak rss {peak:.1f} MiB")


if __name__ == "__main__":
    main()
