"""What QK-clip costs per training step (not a timed test).

    .venv/bin/python benchmarks/qkclip_overhead.py --reps 5
    .venv/bin/python benchmarks/qkclip_overhead.py --attn eager

A 4-layer GPT-2 (Hugging Face, d_model 256, 4 heads, random init, batch 4 x 128 tokens), AdamW plain and
followed by :class:`hooks.QKClip` at every step (tau=100: the largest logit of every head is read from every
attention call of every forward; at this init no head exceeds it, so the cost is the reading, the one host
transfer and the check). Windows of ``--steps`` whole training steps (forward + backward + optimizer step, and
the clip) run back to back, plain then clipped, ``--reps`` times in one process; prints the median (min, max)
ratio and the absolute times side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hooks import QKClip


def build(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation=attn).train()


def window(model, opt, batch, steps: int) -> float:
    """Seconds per whole training step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tau", type=float, default=100.0)
    args = parser.parse_args()
    model = build(args.attn)
    batch = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # small lr: the weights stay sane over the reps
    clip = QKClip(model, args.tau)
    print(f"GPT-2 4 x 256 ({args.attn}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"batch 4 x 128, {torch.get_num_threads()} threads, {args.reps} reps of {args.steps} steps")
    window(model, opt, batch, 2)  # warm-up, unclipped
    plain, clipped, ratios, heads = [], [], [], 0
    for _ in range(args.reps):
        clip.remove()
        plain.append(window(model, opt, batch, args.steps))
        clip = QKClip(model, args.tau, optimizer=opt)
        clipped.append(window(model, opt, batch, args.steps))
        ratios.append(clipped[-1] / plain[-1])
        heads += clip.n_interventions
    clip.remove()
    ms = lambda xs: f"{1e3 * statistics.median(xs):7.1f} ms"  # noqa: E731
    print(f"step without QKClip      {ms(plain)}")
    print(f"step with QKClip (every) {ms(clipped)}")
    print(f"ratio                    x{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"heads clipped: {heads}")


if __name__ == "__main__":
    main()
