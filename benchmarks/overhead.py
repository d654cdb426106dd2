"""What watching costs: ratios measured side by side in one run (not a timed test).

    .venv/bin/python benchmarks/overhead.py --model small --reps 5
    .venv/bin/python benchmarks/overhead.py --model tiny
    .venv/bin/python benchmarks/overhead.py --model medium --only 1 --reps 1   # 24 layers x 1024

Prints, for a GPT-2-shaped model (Hugging Face, sdpa attention, random init,
batch 4 x 128 tokens):
  1. exact spectra of all heads (d_head x d_head core) vs the naive full SVD of each
     d_model x d_model product: time ratio and the largest relative disagreement;
  2. training-step time with the Monitor at every=1, 10, 100 vs no Monitor, over
     whole sampling periods (100 steps for every=100), each window run back to back
     with the same steps unmonitored: median (min, max) time ratios (incl. the final
     close()), and the Monitor's accounted share of the window (time inside
     monitor.step plus the sampled steps' extra forward+backward: its own parts,
     so far less noisy than the ratio of two windows on a shared machine);
  3. the cost of one non-sampled ``monitor.step`` call, relative to a training step;
  4. the cost of each signal family on a sampled step, as a fraction of one step
     (update ratios of W_Q, W_K, W_V, W_O: around a real AdamW step, cold at the
     first sample, then warm);
  5. peak resident memory of a training run with the Monitor (every=1, all signals)
     and without, each in its own child process, alternated;
  6. attention capture cost as the sequence grows (128 .. 2,048 tokens, batch 1,
     a 2-layer model of GPT-2-small width): capture time against the same forward
     and backward without it.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch

from diag.layouts.vocab import split_qkv
from diag.math.spectral import qk_singular_values, qk_singular_values_reference
from diag.outputs.sinks import MemorySink
from hooks import Monitor
from hooks.discovery import discover

SHAPES = {"small": (12, 12, 768), "medium": (24, 16, 1024), "tiny": (2, 4, 64)}  # layers, heads, d_model


def build(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, heads, width = SHAPES[size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=8192, n_positions=256)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def spectra(model, reps: int) -> None:
    layers = discover(model)
    qs, ks = zip(*(split_qkv({n: p.detach() for n, p in a.params().items()}, a.layout)[:2] for a in layers))
    wq, wk = torch.cat(qs), torch.cat(ks)
    fast, slow = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sv = qk_singular_values(wq, wk)
        t1 = time.perf_counter()
        ref = torch.stack([qk_singular_values_reference(wq[h], wk[h]) for h in range(wq.shape[0])])
        t2 = time.perf_counter()
        fast.append(t1 - t0)
        slow.append(t2 - t1)
    err = ((sv - ref).abs() / ref[:, :1]).max().item()
    ratio = [s / f for s, f in zip(slow, fast)]
    print(f"1. spectra of {wq.shape[0]} heads: core {statistics.median(fast) * 1e3:.1f} ms, naive SVD "
          f"{statistics.median(slow) * 1e3:.0f} ms; naive/core {statistics.median(ratio):.1f}x "
          f"(min {min(ratio):.1f}, max {max(ratio):.1f}); max |diff|/sigma_1 {err:.1e}")


def train_steps(model, monitor, steps: int, start: int, parts: list | None = None) -> list[float]:
    """Step times; with ``parts``, also appends (forward+backward seconds, monitor.step seconds) per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(start, start + steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t1 = time.perf_counter()
        if monitor is not None:
            monitor.step(step, loss=loss)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if parts is not None:
            parts.append((t1 - t0, t2 - t1))
    return times


def accounted(plain_parts: list, watched_parts: list, every: int, close: float, base: float) -> float:
    """The Monitor's share of a window from its own parts, far less noisy than a ratio of two windows:
    the time inside monitor.step (incl. close) plus, on sampled steps (where the capture is armed),
    forward+backward beyond the plain window's median. As a fraction of the window's plain time."""
    plain_fb = statistics.median(fb for fb, _ in plain_parts)
    extra = close + sum(m for _, m in watched_parts)
    extra += sum(fb - plain_fb for i, (fb, _) in enumerate(watched_parts) if i % every == 0)
    return extra / (base * len(watched_parts))


def overhead(model, reps: int, steps: int, everys=(1, 10, 100)) -> float:
    """Each every=N window covers whole sampling periods: steps 0 .. max(N, steps)-1 rounded up to a
    multiple of N (so the share of sampled steps is exactly 1/N), against the same steps without the
    Monitor, the two run back to back in every repetition."""
    train_steps(model, None, 2, 0)  # warm up
    base_times: list[float] = []
    print("2. training-step time with the Monitor / without (same steps, back to back):")
    for every in everys:
        n = -(-max(every, steps) // every) * every
        ratios, shares = [], []
        for _ in range(reps):
            plain_parts: list = []
            plain = sum(train_steps(model, None, n, 0, plain_parts))
            monitor = Monitor(model, every=every, sinks=[MemorySink()])
            watched_parts: list = []
            watched = sum(train_steps(model, monitor, n, 0, watched_parts))
            t0 = time.perf_counter()
            monitor.close()  # measures the last sampled step's pending update ratios
            close = time.perf_counter() - t0
            ratios.append((watched + close) / plain)
            shares.append(accounted(plain_parts, watched_parts, every, close, plain / n))
            base_times.append(plain / n)
        print(f"   every={every:<4} ({n:3d} steps): time ratio {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); accounted share of the Monitor "
              f"{statistics.median(shares) * 100:.2f}% (min {min(shares) * 100:.2f}, max {max(shares) * 100:.2f})")
    base = statistics.median(base_times)
    print(f"   training step without monitor: {base * 1e3:.0f} ms (median)")
    return base


def non_sampled_cost(model, base: float) -> None:
    monitor = Monitor(model, every=1000, sinks=[MemorySink()])
    monitor.capture.disarm()
    n = 20000
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        if step % 1000:
            monitor.step(step)
    per_call = (time.perf_counter() - t0) / n
    monitor.close()
    print(f"3. one non-sampled monitor.step: {per_call * 1e6:.2f} us = {per_call / base * 100:.5f}% of a step")


def _fwd_bwd(model, ids) -> float:
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def families(model, base: float, reps: int) -> None:
    """Weight-side families: the duration of the monitor.step calls that do their work.
    Update ratios: a real AdamW step between the sampled call and the next one (so dW is a
    real update); the first sample is cold, later ones warm-start from the previous.
    Attention: forward+backward with the capture armed minus without, interleaved."""
    print("4. sampled-step cost per signal family (fraction of one training step):")
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    for family in ("spectra", "grads", "updates"):
        monitor = Monitor(model, every=2, signals=(family,), sinks=[MemorySink()])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        costs = []
        for rep in range(reps + (family == "updates")):
            _fwd_bwd(model, ids)
            t0 = time.perf_counter()
            monitor.step(2 * rep)  # sampled
            spent = time.perf_counter() - t0
            opt.step()
            model.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            monitor.step(2 * rep + 1)  # not sampled: measures the update of the sampled step
            costs.append(spent + (time.perf_counter() - t1))
        monitor.close()
        if family == "updates":
            print(f"   {family:>9}: first (cold) sample {costs[0] / base * 100:6.2f}%; then", end="")
            costs = costs[1:]
        else:
            print(f"   {family:>9}:", end="")
        print(f" {statistics.median(costs) / base * 100:6.2f}% "
              f"(min {min(costs) / base * 100:.2f}, max {max(costs) / base * 100:.2f})")
    monitor = Monitor(model, every=1, signals=("attention",), sinks=[MemorySink()])
    costs = []
    for _ in range(reps):
        monitor.capture.arm()
        armed = _fwd_bwd(model, ids)
        monitor.capture.take()
        plain = _fwd_bwd(model, ids)
        costs.append(armed - plain)
        model.zero_grad(set_to_none=True)
    monitor.close()
    print(f"   attention: {statistics.median(costs) / base * 100:6.2f}% "
          f"(min {min(costs) / base * 100:.2f}, max {max(costs) / base * 100:.2f})")


def memory_child(size: str, monitored: bool, steps: int) -> None:
    """Child process of item 5: train ``steps`` steps, print the peak RSS in KiB."""
    model = build(size)
    monitor = Monitor(model, every=1, sinks=[MemorySink()]) if monitored else None
    train_steps(model, monitor, steps, 0)
    if monitor is not None:
        monitor.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def memory(size: str, reps: int, threads: int) -> None:
    peaks: dict[bool, list[int]] = {False: [], True: []}
    for _ in range(reps):
        for monitored in (False, True):
            cmd = [sys.executable, __file__, "--model", size, "--threads", str(threads), "--memory-child",
                   "monitored" if monitored else "plain"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peaks[monitored].append(int(out.strip().splitlines()[-1]))
    plain, watched = statistics.median(peaks[False]), statistics.median(peaks[True])
    print(f"5. peak RSS over 4 training steps (every=1, all signals): without {plain / 1024:.0f} MiB, with "
          f"{watched / 1024:.0f} MiB: +{(watched - plain) / 1024:.0f} MiB = {(watched / plain - 1) * 100:+.1f}% "
          f"(each median of {reps} child processes)")


def attention_scaling(reps: int, lengths: tuple[int, ...]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=12, n_embd=768, vocab_size=8192, n_positions=max(lengths))
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    monitor = Monitor(model, every=1, signals=("attention",), sinks=[MemorySink()])
    print("6. attention capture vs sequence length (2 layers x 12 heads, d_model 768, batch 1, sdpa):")
    previous = None
    for n in lengths:
        ids = torch.randint(0, 8192, (1, n), generator=torch.Generator().manual_seed(n))
        _fwd_bwd(model, ids)
        costs, plains = [], []
        for _ in range(reps):
            monitor.capture.arm()
            armed = _fwd_bwd(model, ids)
            results, problems = monitor.capture.take()
            plain = _fwd_bwd(model, ids)
            costs.append(armed - plain)
            plains.append(plain)
            model.zero_grad(set_to_none=True)
        assert len(results) == 2 and not problems, problems
        cost, plain = statistics.median(costs), statistics.median(plains)
        growth = "" if previous is None else f"; x{cost / previous[0]:.1f} capture, x{plain / previous[1]:.1f} step"
        print(f"   {n:5d} tokens: step {plain * 1e3:7.0f} ms, capture {cost * 1e3:7.0f} ms "
              f"({cost / plain * 100:5.1f}% of the step{growth})")
        previous = (cost, plain)
    monitor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--everys", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--only", nargs="+", choices=["1", "2", "3", "4", "5", "6"], default=None,
                        help="run only these items (item 3 and 4 need item 2's step time: it runs too)")
    parser.add_argument("--memory-child", choices=["plain", "monitored"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.model, args.memory_child == "monitored", 4)
        return
    model = build(args.model)
    layers, heads, width = SHAPES[args.model]
    print(f"model: GPT-2 shape {layers} layers x {heads} heads, d_model {width}; batch 4 x 128; "
          f"{args.threads} threads")
    only = set(args.only or "123456")
    if "1" in only:
        spectra(model, args.reps)
    if only & {"2", "3", "4"}:
        base = overhead(model, args.reps, args.steps, args.everys)
        if "3" in only:
            non_sampled_cost(model, base)
        if "4" in only:
            families(model, base, args.reps)
    if "5" in only:
        memory(args.model, args.reps, args.threads)
    if "6" in only:
        attention_scaling(args.reps, tuple(args.lengths))


if __name__ == "__main__":
    main()
