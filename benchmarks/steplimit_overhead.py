"""What the spectral step limit costs per training step (not a timed test).

    .venv/bin/python benchmarks/steplimit_overhead.py --model small --reps 5
    .venv/bin/python benchmarks/steplimit_overhead.py --model tiny

For a GPT-2-shaped model (Hugging Face, sdpa attention, random init, batch 4 x 128
tokens), AdamW plain vs wrapped in :class:`hooks.SpectralStepLimit` (Q/K/V slices,
attention output and MLP matrices; power iteration with 1 and 2 iterations, and the
exact ``matrix_norm(ord=2)`` mode). Windows of ``--steps`` training steps run back to
back, plain then wrapped, ``--reps`` times; prints the median (min, max) ratio of
whole training steps (forward + backward + optimizer step) and of the optimizer
step alone, and the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from overhead import SHAPES, build  # the same GPT-2 shapes as the overhead benchmark (this folder)

from hooks.layout.discover import discover
from hooks.steplimit.limit import SpectralStepLimit


def window(model, opt, batch, steps: int) -> tuple[float, float]:
    """Seconds per whole training step and per optimizer step, over ``steps`` steps."""
    total = step_only = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        total += t2 - t0
        step_only += t2 - t1
    return total / steps, step_only / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=["power x1", "power x2", "exact"],
                        default=["power x1", "power x2", "exact"], help='e.g. --modes "power x1" "power x2"')
    args = parser.parse_args()
    model = build(args.model)
    batch = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    layers = discover(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)  # small lr: the weights stay sane over the reps
    variants = {f"power x{i}": SpectralStepLimit(inner, 0.004, model=model, attention=layers, iters=i)
                for i in (1, 2)}
    variants["exact"] = SpectralStepLimit(inner, 0.004, model=model, attention=layers, exact=True)
    variants = {name: v for name, v in variants.items() if name in args.modes}
    n = len(next(iter(variants.values())).matrices)
    print(f"GPT-2 {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{n} bounded matrices, batch 4 x 128, {torch.get_num_threads()} threads")
    window(model, inner, batch, 2)  # warm-up
    for name, wrapped in variants.items():
        window(model, wrapped, batch, 1)
        whole, step, times = [], [], []
        for _ in range(args.reps):
            plain_t = window(model, inner, batch, args.steps)
            wrapped_t = window(model, wrapped, batch, args.steps)
            whole.append(wrapped_t[0] / plain_t[0])
            step.append(wrapped_t[1] / plain_t[1])
            times.append((plain_t, wrapped_t))
        p, w = times[len(times) // 2]
        print(f"{name:>9}: training step x{statistics.median(whole):.3f} (min {min(whole):.3f}, max "
              f"{max(whole):.3f}); optimizer step x{statistics.median(step):.2f} (min {min(step):.2f}, max "
              f"{max(step):.2f}); e.g. plain {p[0] * 1e3:.0f} ms (step {p[1] * 1e3:.1f} ms), wrapped "
              f"{w[0] * 1e3:.0f} ms (step {w[1] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
