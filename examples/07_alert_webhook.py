"""Alerts that reach a person: the Monitor's ``on_alert`` posting to a Slack-compatible webhook.

    SLACK_WEBHOOK_URL=https://hooks.slack.com/services/... python examples/07_alert_webhook.py
    python examples/07_alert_webhook.py --url http://127.0.0.1:8000/hook     # any server that takes a JSON POST

Trains the demo's GPT with no warmup at a high learning rate (the collapse setting of ``python -m diag demo``)
and posts ``{"text": ...}`` once when an episode of a warning or critical alert starts and once when it ends
(:class:`diag.outputs.webhook.AlertWebhook`: a background thread, a timeout, a failed post logged once, never an
exception in the training loop). Without a URL it prints what it would post.
"""

from __future__ import annotations

import argparse
import os

import torch

from diag.outputs.webhook import AlertWebhook, slack_text
from hooks import Monitor
from hooks.demo import GPT, GPTConfig, encode, get_batch, load_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("SLACK_WEBHOOK_URL"), help="the incoming-webhook URL "
                        "(default: $SLACK_WEBHOOK_URL; none: print the messages)")
    parser.add_argument("--logdir", default="runs/webhook", help="the Monitor's run folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--min-level", default="warning", choices=["info", "warning", "critical"],
                        help="the lowest level posted (default: %(default)s)")
    args = parser.parse_args()

    if args.url:
        on_alert = AlertWebhook(args.url, run=args.logdir, min_level=args.min_level)
    else:
        on_alert = lambda a: print(slack_text(a, args.logdir))  # noqa: E731
    cfg = GPTConfig()
    data, cfg.vocab_size = encode(load_text(500_000))
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    with Monitor(model, logdir=args.logdir, every=10, overwrite=True, on_alert=on_alert) as monitor:
        for step in range(args.steps):
            loss = model(*get_batch(data, cfg, gen))
            loss.backward()
            monitor.step(step, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if isinstance(on_alert, AlertWebhook):
        on_alert.close()  # the posts still queued go out before the process ends
        print(f"{on_alert.posted} message(s) posted to the webhook")
    print(f"tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
