"""Checkpoints saved during training, analysed afterwards with ``python -m diag analyze``.

    python examples/03_analyze_checkpoints.py --logdir runs/ckpt     # about 20 s on a CPU
    tensorboard --logdir runs/ckpt

Trains the demo's small character-level GPT (2 layers of 2 heads, d_model 64; no warmup, a
high learning rate) with the live Monitor attached, and every ``--every`` steps saves a
nanoGPT-style checkpoint, ``{"model", "model_args", "iter_num"}``, before that step's update
(the weights the step's forward saw: the Monitor's convention). Then it runs

    python -m diag analyze <logdir>/checkpoints --out <logdir>/analyze --overwrite

which reads the series in step order (weights only, nothing unpickled as code), writes the
weight-side signals to TensorBoard and ``metrics.jsonl`` with the live run's tags, and a report
(``<logdir>/analyze/report/index.html``). Last, it prints sigma_1 per layer from both: at the
same steps the spectra agree, because the checkpoints hold the weights the Monitor measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from hooks import Monitor
from hooks.demo import GPT, GPTConfig, get_batch, load_text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/ckpt", help="live run in <logdir>/live, checkpoints in "
                        "<logdir>/checkpoints, analysis in <logdir>/analyze (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5,
                        help="sample and checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train(args: argparse.Namespace, ckpt_dir: Path) -> Monitor:
    text = load_text(max_chars=200_000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)  # (N,)
    cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=2, n_head=2, n_embd=64, batch_size=8)
    model_args = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in ckpt_dir.glob("ckpt_*.pt"):  # a rerun with other settings must not mix series
        old.unlink()
    with Monitor(model, logdir=Path(args.logdir) / "live", every=args.every, signals=("spectra", "updates")) as monitor:
        model.train()
        for step in range(args.steps):
            x, y = get_batch(data, cfg, gen)  # (B, T) each
            loss = model(x, y)
            loss.backward()
            monitor.step(step, loss=loss)
            if step % args.every == 0:  # before the update: the weights this step's forward saw
                torch.save({"model": model.state_dict(), "model_args": model_args, "iter_num": step},
                           ckpt_dir / f"ckpt_{step:04d}.pt")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return monitor


def sigma_by_step(metrics: Path) -> dict[int, dict[str, float]]:
    """step -> {layer tag: value} of ``qk_sigma1/Lxx/max`` from a metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row["tag"].startswith("qk_sigma1/") and row["tag"].endswith("/max"):
            out.setdefault(row["step"], {})[row["tag"].split("/")[1]] = row["value"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = Path(args.logdir)
    monitor = train(args, root / "checkpoints")
    print(f"live run: {monitor.logdir}; {len(list((root / 'checkpoints').glob('ckpt_*.pt')))} checkpoints saved")
    command = [sys.executable, "-m", "diag", "analyze", str(root / "checkpoints"), "--out", str(root / "analyze"),
               "--overwrite"]
    print("$ " + " ".join(["python"] + command[1:]), flush=True)
    result = subprocess.run(command)
    if result.returncode != 0:
        sys.exit(f"diag analyze failed with exit code {result.returncode}")

    live, offline = sigma_by_step(monitor.logdir / "metrics.jsonl"), sigma_by_step(root / "analyze" / "metrics.jsonl")
    print("step  layer  sigma_1 max live  sigma_1 max from checkpoint")
    for step in sorted(offline):
        for layer, value in sorted(offline[step].items()):
            print(f"{step:4d}  {layer:5s}  {live[step][layer]:16.6f}  {value:27.6f}")
    print(f"report: {root / 'analyze' / 'report' / 'index.html'}")
    print(f"look at both: tensorboard --logdir {root}")


if __name__ == "__main__":
    main()
