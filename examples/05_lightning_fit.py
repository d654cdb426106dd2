"""The Monitor in a Lightning ``Trainer.fit``, beside Lightning's own TensorBoard logger.

    python examples/05_lightning_fit.py --logdir runs/lightning     # about 15 s on a CPU
    tensorboard --logdir runs/lightning/lightning_logs

The demo's small character-level GPT (2 layers of 2 heads, d_model 64) on the Python standard
library's source, in a LightningModule, with gradient accumulation over 2 batches and gradient
clipping. ``MonitorCallback`` writes into the logger's version folder
(``lightning_logs/version_N/attnscope``), so one TensorBoard shows Lightning's ``train_loss``
and the attention diagnostics. Its detector state is saved in every Lightning checkpoint; here
the last one is written to ``<logdir>/last.ckpt``. ``--precision bf16-mixed`` runs under
autocast (on a GPU, ``16-mixed``: Lightning unscales the gradients before the Monitor reads them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch

from hooks.demo import GPT, GPTConfig, get_batch, load_text
from hooks.integrations.lightning import MonitorCallback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/lightning", help="Trainer(default_root_dir) (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5, help="sample every N optimizer steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class CharGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float) -> None:
        super().__init__()
        self.model, self.lr = GPT(cfg), lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T) each
        loss = self.model(x, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


def char_loader(cfg: GPTConfig, batches: int, seed: int) -> torch.utils.data.DataLoader:
    text = load_text(max_chars=200_000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    cfg.vocab_size = len(chars)
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)  # (N,)
    gen = torch.Generator().manual_seed(seed)
    xs, ys = zip(*(get_batch(data, cfg, gen) for _ in range(batches)))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, batch_size=8)
    loader = char_loader(cfg, batches=2 * args.steps, seed=args.seed)
    module = CharGPT(cfg, args.lr)
    callback = MonitorCallback(every=args.every)  # writes to <trainer.log_dir>/attnscope
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, precision=args.precision, accumulate_grad_batches=2,
        gradient_clip_val=1.0, default_root_dir=args.logdir, log_every_n_steps=1, callbacks=[callback],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(Path(args.logdir) / "last.ckpt")  # holds callbacks["MonitorCallback"]: the detectors

    monitor = callback.monitor  # closed by on_train_end
    print(f"attnscope: {len(monitor.alert_sink.history)} alerts, metrics in {monitor.logdir / 'metrics.jsonl'}")
    for alert in monitor.alert_sink.history:
        print(f"alert  step {alert.step:3d}  {alert.level:8s} {alert.kind:20s} {alert.where}")
    print(f"look at both: tensorboard --logdir {Path(args.logdir) / 'lightning_logs'}")


if __name__ == "__main__":
    main()
