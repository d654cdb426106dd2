"""Checkpoint weight analysis: ``diag.offline.series.analyze_checkpoints`` vs weightwatcher's ``analyze()``.

    .venv/bin/pip install weightwatcher        # not a dependency of ours: the peer we compare with
    .venv/bin/python benchmarks/analyze_vs_weightwatcher.py --reps 3

One GPT-2-small-shaped checkpoint (12 layers, 12 heads, d_model 768, random
init) is written once with ``save_pretrained`` (safetensors + config.json).
Then, alternating, several repetitions of:

* ours: ``analyze_checkpoints([folder])`` from the files (loading included): the
  exact spectrum of every head's Wq_h^T Wk_h, SEC, effective and stable rank;
* weightwatcher: ``WeightWatcher(model=model).analyze()`` on the same weights
  loaded as a model (the load timed apart): per weight matrix, the empirical
  spectral density and its power-law fit; it has no notion of heads or of the
  Wq^T Wk product.

Prints median (min, max) seconds and the time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoint(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=12, n_head=12, n_embd=768)).save_pretrained(folder)


def ours(folder: Path) -> float:
    from diag.offline.series import analyze_checkpoints

    t0 = time.perf_counter()
    analysis = analyze_checkpoints([folder])
    elapsed = time.perf_counter() - t0
    assert not analysis.failures and len(analysis.layers) == 12, analysis.failures
    return elapsed


def weightwatcher(folder: Path) -> tuple[float, float]:
    import weightwatcher as ww
    from transformers import GPT2LMHeadModel

    t0 = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(folder)
    t1 = time.perf_counter()
    details = ww.WeightWatcher(model=model).analyze()
    t2 = time.perf_counter()
    assert len(details) > 0
    return t1 - t0, t2 - t1


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds of rest before each timed call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2-small"
        write_checkpoint(folder)
        ours(folder)  # warm imports and caches for both sides
        ours_t, load_t, ww_t = [], [], []
        for _ in range(args.reps):
            # A pause before each timed call: thread pools of the previous call (BLAS/OpenMP threads spin
            # for a while after their work) otherwise compete with the next one on 2 cores.
            time.sleep(args.pause)
            ours_t.append(ours(folder))
            time.sleep(args.pause)
            load, analyse = weightwatcher(folder)
            load_t.append(load)
            ww_t.append(analyse)
    ratios = [w / o for w, o in zip(ww_t, ours_t)]
    print(f"GPT-2-small-shaped checkpoint, {args.threads} threads, {args.reps} alternating repetitions")
    print(f"  ours: analyze_checkpoints (load + every head's exact spectrum) {summary(ours_t)}")
    print(f"  weightwatcher: load as a model {summary(load_t)}; analyze() {summary(ww_t)}")
    print(f"  weightwatcher analyze() / ours: {statistics.median(ratios):.0f}x "
          f"(min {min(ratios):.0f}, max {max(ratios):.0f})")


if __name__ == "__main__":
    main()
