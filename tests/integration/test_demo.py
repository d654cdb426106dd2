"""The demo (``python -m diag demo``) runs end to end and writes every signal family."""

from __future__ import annotations

import json

import torch

from diag.cli.main import build_parser
from hooks.demo import run_demo


def test_demo_writes_all_signals(tmp_path, capsys):
    logdir = tmp_path / "demo"
    args = build_parser().parse_args(
        ["demo", "--logdir", str(logdir), "--steps", "40", "--every", "10", "--quiet"]
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    try:
        run_demo(args)
    finally:
        torch.set_num_threads(threads)

    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    families = {r["tag"].split("/")[0] for r in records}
    for family in ("qk_sigma1", "attn_entropy", "grad_norm_q", "update_ratio_q", "loss"):
        assert family in families, f"{family} missing from metrics.jsonl: {sorted(families)}"
    assert {r["step"] for r in records if r["tag"] == "loss"} == {0, 10, 20, 30}
    assert list(logdir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert f"tensorboard --logdir {logdir}" in capsys.readouterr().out
    alerts = [json.loads(line) for line in (logdir / "alerts.jsonl").read_text().splitlines()]
    # Changed with issue #17: this asserted collapse_warning, which fired at the first sample of every no-warmup
    # run (the bug); within 40 steps the honest alert is the note on the large first updates
    assert "large_early_updates" in {a["kind"] for a in alerts}, "the demo exists to show an alert"
