"""One training run of the evaluation, described by a :class:`RunSpec`, trained and recorded.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs lm --seed 0 --lr 5e-3 --steps 300 --out runs/eval
    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs lm --seed 0 --lr 5e-3 --steps 300 --qk-norm --out runs/eval

Tasks, each trained by the one training loop of ``hooks.demo`` (``train_steps``):

* ``lm`` (:mod:`evaluation.lm`): the demo's character-level GPT (``hooks.demo``: 4 layers of 2 heads, d_model
  128, context 128, batch 16, AdamW betas 0.9/0.95, weight decay 0.1) on the standard library's source
  (``--corpus stdlib``) or on the English text of Python's own documentation (``--corpus pydoc``), with a
  constant learning rate or a linear warmup then cosine decay, optionally with QK-norm (LayerNorm on q and k
  per head: the twin that cannot collapse) and at another width, depth, context and batch. The collapse
  reproduction, and at context 512 with 8 heads a healthy family.
* ``vit`` (:mod:`evaluation.eureka`): the Eureka task's ViT: softmax or NormSoftmax attention, any learning
  rate and warmup, optionally QK-norm; the Eureka reproduction, and at a high learning rate without warmup
  a ViT that may collapse.
* ``hf`` (:mod:`evaluation.healthy`): a Hugging Face model built from a config: GPT-2, LLaMA with grouped-query
  attention, BERT-style masked language models, a ViT classifier, at any size, context and batch, optionally
  under bf16 autocast; optionally NormSoftmax attention (the causal twin of a language-model plateau) or, for
  LLaMA, QK-norm (HF Qwen3: the twin that cannot collapse).
* ``finetune`` (:mod:`evaluation.finetune`): a byte-level GPT-2 or LLaMA that starts with attention sinks, built
  in (:mod:`evaluation.sinks`), fine-tuned on English prose.

Each run is recorded with the Monitor at ``every=1`` (``--every``; 0: the default cadence, the Monitor as a
user attaches it), its detectors wrapped by a :class:`evaluation.record.Recorder` that writes every observation
to ``observations.jsonl`` (:mod:`evaluation.recording`); ``run.json`` holds the spec, every step's loss and
learning rate, the task's own outcome (held-out accuracy for the Eureka task), the seconds the run took (wall
clock and CPU) and ``recorded``: the commit it was recorded at, the files of ``diag/``, ``hooks/`` and
``evaluation/`` that differed from it, and the recording's start and end (:mod:`evaluation.provenance`). The
detectors are replayed offline on these files (:mod:`evaluation.detectors`) for any threshold and any coarser
cadence.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from evaluation.provenance import now, recording_stamp
from evaluation.spec import TASKS, RunSpec

__all__ = ["Claimed", "claim", "record", "train"]


def train(spec: RunSpec, out: Path) -> dict:
    """Train ``spec`` with its task's module, recorded into ``out``; what its ``run.json`` holds beside the spec
    and the learning rates. The task's module is imported here: a Hugging Face run alone needs transformers."""
    if spec.task == "lm":
        from evaluation import lm as task
    elif spec.task == "vit" and spec.model == "hfvit":
        from evaluation import eureka_hf as task
    elif spec.task == "vit":
        from evaluation import eureka as task
    elif spec.task == "finetune":
        from evaluation import finetune as task
    else:
        from evaluation import healthy as task
    return task.train_spec(spec, out)


class Claimed(RuntimeError):
    """The run's folder is being recorded by another living process (two plans over one folder)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def claim(out: Path) -> None:
    """Claim ``out`` for this process: ``.claim`` holds the claimer's process id. A claim whose process is
    gone (a killed or crashed recording) is taken over; one whose process lives raises :class:`Claimed`, and
    so does one that names no process (being written this instant, or left by a process that died writing it),
    which names the file to remove when no plan is recording."""
    path = out / ".claim"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            text = path.read_text().strip() if path.exists() else ""
            if not text.isdigit():
                raise Claimed(f"{path} exists and names no process (a claim being written, or one left half-written): "
                              f"remove it if no plan is recording into {out.parent}") from None
            if _alive(int(text)):
                raise Claimed(f"{out.name} is being recorded by process {text} ({path})") from None
            path.unlink(missing_ok=True)  # its recorder is gone: take the run over
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return
    raise Claimed(f"{path} was claimed again while this process took over a stale claim")


def record(spec: RunSpec, root: Path) -> Path:
    """Train ``spec`` and record it into ``root / spec.name`` (``run.json`` last: a folder without it is
    incomplete and is recorded again). Raises :class:`Claimed` when another living process records it."""
    out = root / spec.name
    if (out / "run.json").exists():  # recorded meanwhile (another plan process)
        return out
    out.mkdir(parents=True, exist_ok=True)
    claim(out)
    torch.set_num_threads(spec.threads)
    recorded = {**recording_stamp(), "start": now()}  # the code it is recorded with (evaluation.freeze checks it)
    wall, cpu = time.perf_counter(), time.process_time()
    result = train(spec, out)
    seconds = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}  # what the run cost
    schedule = spec.lr_schedule
    lrs = [spec.lr * schedule(s) for s in range(spec.steps)]
    recorded["end"] = now()
    (out / "run.json").write_text(json.dumps({"config": asdict(spec), "lrs": lrs, "seconds": seconds, **result,
                                              "recorded": recorded}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--out", type=Path, required=True, help="the folder of runs; this one goes in a sub-folder")
    for f in fields(RunSpec):
        if f.name == "task":
            continue
        kind = type(f.default)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "twin":
            parser.add_argument("--qk-norm", dest="twin", action="store_const", const="qknorm", default="")
            parser.add_argument("--normsoftmax", dest="twin", action="store_const", const="normsoftmax")
        elif f.name in ("seed", "lr", "steps"):
            parser.add_argument(flag, type=float if f.name == "lr" else int, required=True)
        else:
            parser.add_argument(flag, type=kind, default=f.default)
    args = vars(parser.parse_args())
    root = args.pop("out")
    try:
        print(record(RunSpec(**args), root))
    except Claimed as error:
        raise SystemExit(f"not recorded: {error}") from None


if __name__ == "__main__":
    main()
