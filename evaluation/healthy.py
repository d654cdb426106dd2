"""Alerts on healthy runs of models we did not write: Hugging Face GPT-2, LLaMA (grouped-query) and GPT-NeoX.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.healthy                  # 3 models x 2 seeds
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.healthy --models llama --seeds 0 --steps 300
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.healthy --models gpt2 --seeds 21 --out RUNS_DIR

Each model is built from a config (4 layers of 4 heads, d_model 128; nothing downloaded; the
library's own attention, ``sdpa``) and trained as such models usually are: bytes of the Python
standard library's source, AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1), 100 warmup steps
then cosine decay, gradient clipping at 1. The Monitor is attached with no arguments but the sink
(``Monitor(model, sinks=...)``: zero configuration, the default cadence). No run here collapses or
stops learning, so every warning or critical alert is a false alarm (GPT-2's loss does stall for a while
after its warmup: docs/alerts.md#healthy-runs discusses the plateau warning it gets); info notes are listed too.
The table printed at the end is the one in docs/alerts.md#healthy-runs. With ``--out`` each run's
observations (what the Monitor passed its detectors, at the default cadence) and losses are written to
``RUNS_DIR/healthy-<model>-s<seed>`` in ``evaluation/record.py``'s format, so that
``evaluation/detectors.py RUNS_DIR`` replays the detectors on them (seeds below 20 tune).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
import transformers

from diag.outputs.sinks import MemorySink
from evaluation.record import Recorder
from hooks import Monitor
from hooks.demo import load_text

transformers.logging.set_verbosity_error()
SHAPE = {"layers": 4, "heads": 4, "width": 128, "context": 128}


def build(name: str) -> torch.nn.Module:
    layers, heads, width, context = (SHAPE[k] for k in ("layers", "heads", "width", "context"))
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=context, n_embd=width, n_layer=layers,
                                      n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=4 * width,
                                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                       max_position_embeddings=context)
        return transformers.LlamaForCausalLM(cfg)
    if name == "neox":
        cfg = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=width, intermediate_size=4 * width,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         max_position_embeddings=context, hidden_dropout=0.0, attention_dropout=0.0)
        return transformers.GPTNeoXForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}: expected gpt2, llama or neox")


def train(name: str, seed: int, steps: int, data: torch.Tensor, batch: int = 8, out: Path | None = None) -> dict:
    torch.manual_seed(seed)
    model = build(name)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 100

    def factor(s: int) -> float:  # linear warmup, then cosine decay to 0
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(seed)
    sink = MemorySink()
    context = SHAPE["context"]
    losses = []
    start = time.perf_counter()
    folder = None if out is None else out / f"healthy-{name}-s{seed}"
    with Monitor(model, sinks=[sink]) as monitor:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            monitor.detectors = Recorder(monitor.detectors, folder / "observations.jsonl")
        for step in range(steps):
            at = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
            ids = torch.stack([data[i : i + context] for i in at.tolist()])
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            monitor.step(step, loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(float(loss.detach()))
    if folder is not None:
        config = {"task": "healthy", "model": name, "seed": seed, "steps": steps, "batch": batch, **SHAPE}
        (folder / "run.json").write_text(json.dumps({"config": config, "losses": losses}))
    alerts = [a for a in monitor.alert_sink.history if a.status == "firing"]
    for a in alerts:  # the loss around each alert: what followed it
        around = [sum(losses[s : s + 20]) / len(losses[s : s + 20]) for s in range(max(0, a.since - 100), steps, 100)]
        print(f"  {name} seed {seed}: {a.level} {a.kind} {a.where} at step {a.step} (since {a.since}); mean loss of "
              f"20 steps every 100 from step {max(0, a.since - 100)}: {' '.join(f'{x:.3f}' for x in around)}")
    return {"model": name, "seed": seed, "steps": steps, "seconds": time.perf_counter() - start,
            "loss_first": sum(losses[:20]) / 20, "loss_last": sum(losses[-20:]) / 20,
            "alerts": Counter((a.level, a.kind) for a in alerts),
            "tags": len({t for r in sink.records for t in r.scalars})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama", "neox"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", type=Path, help="record each run's observations and losses here (for replay)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(load_text(max_chars=2_000_000).encode()), dtype=torch.uint8).long()
    rows = []
    for name in args.models:
        for seed in args.seeds:
            row = train(name, seed, args.steps, data, out=args.out)
            rows.append(row)
            print(f"{name} seed {seed}: loss {row['loss_first']:.3f} -> {row['loss_last']:.3f} in "
                  f"{row['seconds']:.0f} s, {row['tags']} tags; alerts {dict(row['alerts']) or 'none'}", flush=True)
    print("\n| model | seed | steps | loss (first 20 -> last 20 steps) | warning or critical alerts | info notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        bad = {k: n for (level, k), n in r["alerts"].items() if level != "info"}
        info = {k: n for (level, k), n in r["alerts"].items() if level == "info"}
        fmt = lambda d: ", ".join(f"{k} x{n}" for k, n in sorted(d.items())) or "none"  # noqa: E731
        print(f"| {r['model']} | {r['seed']} | {r['steps']} | {r['loss_first']:.2f} -> {r['loss_last']:.2f} | "
              f"{fmt(bad)} | {fmt(info)} |")


if __name__ == "__main__":
    main()
