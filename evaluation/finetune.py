"""Fine-tunes of models that start with attention sinks (``RunSpec(task="finetune")``), trained as users fine-tune.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs finetune --model llama --sinks built --seed 0 \\
        --lr 3e-4 --steps 300 --warmup 30 --schedule cosine --context 512 --corpus pydoc --every 0 --out RUNS_DIR

The model (:mod:`evaluation.sinks`): a byte-level Hugging Face GPT-2 or LLaMA (grouped-query attention, rotary
positions) whose sequences begin with BOS, with sinks built in (``sinks="built"``: :func:`evaluation.sinks.built`,
4 layers of 8 heads, width 128). Fine-tuned on English prose (``corpus="pydoc"``) at the spec's context
(512 unless it names another) and batch (4), AdamW (betas 0.9/0.95, weight decay 0.1), the spec's schedule,
gradient clipping at 1, the Monitor attached as a user attaches it (``every=0``: ``Monitor(model)``).
``run.json`` holds, beside the losses, each head's share of attention on position 0 (its sink) at the first
step and after the last, on one fixed batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from evaluation import sinks
from evaluation.lm import corpus
from evaluation.recording import recording
from evaluation.spec import RunSpec
from hooks import Monitor
from hooks.demo import adamw, train_steps

__all__ = ["train_spec"]

SHAPE = {"layers": 4, "heads": 8, "width": 128, "context": 512, "batch": 4}  # a spec's 0s


def model_of(spec: RunSpec) -> torch.nn.Module:
    """The model the fine-tune starts from: built-in sinks from the spec's seed."""
    size = {k: getattr(spec, k) or v for k, v in SHAPE.items()}
    return sinks.built(spec.model, spec.seed, size["layers"], size["heads"], size["width"], size["context"])


def train_spec(spec: RunSpec, out: Path) -> dict:
    """Fine-tune the run's model, recorded into ``out``; returns its every-step losses, the mean of its last 50
    and each head's share of attention on position 0 before and after (``sink_mass``: layers x heads)."""
    context, batch = spec.context or SHAPE["context"], spec.batch or SHAPE["batch"]
    model = model_of(spec)
    data = torch.frombuffer(bytearray(corpus(spec.corpus).encode()), dtype=torch.uint8).long()
    draw = sinks.bos_batches(data, context, batch, torch.Generator().manual_seed(spec.seed))
    probe = sinks.bos_batches(data, context, batch, torch.Generator().manual_seed(spec.seed + 1))()["input_ids"]
    start = sinks.mass_on_first(model, probe)
    optimizer = adamw(model, spec.lr)
    autocast = torch.bfloat16 if spec.autocast == "bf16" else None
    with recording(Monitor(model, every=spec.every or None), out / "observations.jsonl") as monitor:
        losses = train_steps(model, draw, lambda b: model(**b).loss, optimizer, spec.steps,
                             schedule=spec.lr_schedule, clip=1.0, autocast=autocast, monitor=monitor)
    end = sinks.mass_on_first(model, probe)
    return {"losses": losses, "final_loss": float(sum(losses[-50:]) / len(losses[-50:])) if losses else math.nan,
            "sink_mass": {"start": start.tolist(), "end": end.tolist()}}
