"""The Monitor on a timm VisionTransformer.

    python examples/06_timm_vit.py --logdir runs/vit       # about 10 s on a CPU; needs timm (and torchvision)
    tensorboard --logdir runs/vit

A small ViT from timm's ``vit_tiny_patch16_224`` recipe, built offline (no pretrained weights),
resized to 32x32 images of 8x8 patches (16 patches + the class token), d_model 64, 4 heads,
2 blocks. The task is synthetic and needs attention across patches: each image is noise with one
bright 8x8 square, and the label is the quadrant the square lies in. The Monitor finds timm's
fused ``qkv`` attention by itself (with ``fused_attn`` on, timm calls
``F.scaled_dot_product_attention``; the capture sees that call). Compare ``--warmup 20``.
"""

from __future__ import annotations

import argparse

import timm
import torch
import torch.nn.functional as F

from hooks import Monitor
from hooks.demo import Schedule, train_steps

IMG, PATCH, CLASSES = 32, 8, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/vit", help="TensorBoard run directory (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5, help="sample every N steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps; 0: none (default)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def quadrant_batch(gen: torch.Generator, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images (n, 3, 32, 32) with a bright square in one quadrant; the label is the quadrant."""
    x = 0.5 * torch.randn(n, 3, IMG, IMG, generator=gen)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    offset = torch.randint(0, IMG // 2 - PATCH + 1, (n, 2), generator=gen)
    for i in range(n):
        r = (int(y[i]) // 2) * IMG // 2 + int(offset[i, 0])
        c = (int(y[i]) % 2) * IMG // 2 + int(offset[i, 1])
        x[i, :, r : r + PATCH, c : c + PATCH] += 2.0
    return x, y


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=PATCH,
                              embed_dim=64, depth=2, num_heads=4, num_classes=CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    accuracy = {}

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)  # (B, CLASSES)
        accuracy["last"] = (logits.argmax(-1) == y).float().mean().item()
        return F.cross_entropy(logits, y)

    def progress(step: int, losses: list[float]) -> None:
        if monitor.should_sample(step):
            print(f"step {step:3d}  loss {losses[-1]:.3f}  accuracy {accuracy['last']:.2f}  "
                  f"attn entropy min L00 {monitor.last['attn_entropy/L00/min']:.3f}  "
                  f"sigma_1 max L00 {monitor.last['qk_sigma1/L00/max']:.3f}")

    with Monitor(model, logdir=args.logdir, every=args.every) as monitor:
        for layer in monitor.layers:
            lay = layer.layout
            print(f"{layer.label}  {layer.name}  adapter {lay.adapter}  {lay.n_heads} heads of {lay.head_dim}")
        # the demo's loop: backward, clipping, monitor.step, optimizer.step, the schedule (hooks/demo/loop.py)
        train_steps(model, lambda: quadrant_batch(gen), loss_of, optimizer, args.steps,
                    schedule=Schedule(warmup=max(args.warmup, 0)), clip=1.0, monitor=monitor, callbacks=(progress,))

    alerts = monitor.alert_sink.history
    print(f"{len(alerts)} alerts; metrics in {monitor.logdir / 'metrics.jsonl'}; "
          f"look at it: tensorboard --logdir {args.logdir}")
    for alert in alerts:
        print(f"alert  step {alert.step:3d}  {alert.level:8s} {alert.kind:20s} {alert.where}")


if __name__ == "__main__":
    main()
