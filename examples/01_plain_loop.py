"""The Monitor in a plain PyTorch training loop.

    python examples/01_plain_loop.py --logdir runs/plain          # about 10 s on a CPU
    tensorboard --logdir runs/plain

A small character-level GPT (the demo's nanoGPT-style model, 2 layers of 2 heads, d_model 64)
trained on the Python standard library's source with AdamW, gradient clipping and, by default,
no warmup and a high learning rate (5e-3): the setting in which sigma_1(Wq^T Wk) runs away; the
detectors note the large first updates (``large_early_updates``, info) at once, log each layer's
``collapse_risk`` and raise ``malignant_collapse`` only if a head's attention then collapses.
``--warmup 20`` is its healthy twin. The three lines that matter are marked 1, 2, 3.
"""

from __future__ import annotations

import argparse

import torch

from hooks import Monitor
from hooks.demo import GPT, GPTConfig, get_batch, load_text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/plain", help="TensorBoard run directory (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5, help="sample every N steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps; 0: none (default)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = load_text(max_chars=200_000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)  # (N,) character ids
    cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=2, n_head=2, n_embd=64, batch_size=8)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(args.warmup, 0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    with Monitor(model, logdir=args.logdir, every=args.every) as monitor:  # 1. attach
        model.train()
        for step in range(args.steps):
            x, y = get_batch(data, cfg, gen)  # (B, T) each
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            monitor.step(step, loss=loss)  # 2. after backward and clipping, before optimizer.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            if monitor.should_sample(step):
                sigma = max(v for t, v in monitor.last.items() if t.startswith("qk_sigma1/") and t.endswith("/max"))
                print(f"step {step:3d}  loss {loss.item():.3f}  sigma_1 max {sigma:.3f}  "
                      f"grad ratio qk/v L00 {monitor.last['grad_ratio_qk_v/L00']:.3f}")
    # 3. the with block closed it: the last update ratios written, every hook removed

    for alert in monitor.alert_sink.history:
        print(f"alert  step {alert.step:3d}  {alert.level:8s} {alert.kind:20s} {alert.where}")
    print(f"{len(monitor.alert_sink.history)} alerts; metrics in {monitor.logdir / 'metrics.jsonl'}")
    print(f"look at it: tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
