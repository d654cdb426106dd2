"""The Monitor in a Hugging Face ``Trainer``, beside the Trainer's own TensorBoard logging.

    python examples/04_hf_trainer.py --logdir runs/hf              # about 15 s on a CPU
    tensorboard --logdir runs/hf

A GPT-2 built from a config (2 layers of 2 heads, d_model 64; nothing downloaded) learns the
bytes of the Python standard library's source. The Trainer accumulates gradients over 2
micro-batches, clips them to norm 1 and reports to TensorBoard; ``MonitorCallback`` adds the
attention diagnostics as a second run, ``<logdir>/attnscope``, next to the Trainer's
``<logdir>/runs/...``. The Monitor numbers steps by the Trainer's ``global_step`` before the
update (0, 5, 10, ...), the Trainer logs the same step's loss at ``global_step`` + 1.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hooks.demo import load_text
from hooks.integrations.hf import MonitorCallback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/hf", help="the Trainer's output_dir (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5, help="sample every N optimizer steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate, constant (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def byte_dataset(n: int, length: int = 64) -> list[dict[str, torch.Tensor]]:
    """n windows of the standard library's source as bytes (vocabulary 256)."""
    data = torch.tensor(list(load_text(max_chars=200_000).encode("utf-8", "replace")), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(len(data) - length, (n,), generator=gen).tolist()
    return [{"input_ids": data[s : s + length], "labels": data[s : s + length]} for s in starts]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.logdir, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1,
        report_to="tensorboard", save_strategy="no", use_cpu=True, seed=args.seed, disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    callback = MonitorCallback(every=args.every)  # writes to <output_dir>/attnscope
    trainer = Trainer(model=model, args=training, train_dataset=byte_dataset(16 * args.steps),
                      callbacks=[callback])
    trainer.train()

    monitor = callback.monitor  # closed by on_train_end
    sigma = monitor.last.get("qk_sigma1/L00/max", float("nan"))
    print(f"attnscope: sigma_1 max of L00 at the last sampled step {sigma:.3f}, "
          f"{len(monitor.alert_sink.history)} alerts, metrics in {monitor.logdir / 'metrics.jsonl'}")
    for alert in monitor.alert_sink.history:
        print(f"alert  step {alert.step:3d}  {alert.level:8s} {alert.kind:20s} {alert.where}")
    print(f"look at both runs: tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
