"""A collapsing run of the demo's GPT with the Monitor at its default cadence, for test_closer_look.py.

    python tests/hooks/parallel/collapse_worker.py single OUT                            # one process
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/collapse_worker.py ddp OUT
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/collapse_worker.py fsdp OUT --twice
    python tests/hooks/parallel/collapse_worker.py single OUT --twice                    # its reference

The GPT of ``hooks.demo`` (2 layers of 2 heads, d_model 64, context 64), in float64, trained on the standard
library's source with AdamW at a learning rate of 5e-2 and no warmup: a layer's heads collapse into sparse, low-rank
attention within 30 steps (``malignant_collapse``), and the detectors ask for closer looks on the way. Every step
draws a global batch of 8 sequences from a generator seeded by the step; rank r of 2 trains on sequences 4r to
4r + 3. ``--twice``: the global batch is 4 sequences drawn, twice over (both ranks train on the same 4), so that
under FSDP2 alone, where layer i's attention is its owner's (rank i % 2's first sequences), every layer's attention
is that of the one process's first sequences. The loop passes the Monitor the loss of the global batch (the mean of
the ranks' losses, all-reduced by the loop), so rank 0's detectors read what one process's read, to float rounding.

Writes ``OUT/logs`` (rank 0's logdir: ``metrics.jsonl``, ``alerts.jsonl``) and per rank ``OUT/rank{r}.json``: the
steps it sampled, those whose attention it sampled, per step the closer look's extent after ``monitor.step``
(``near_until``, ``risk_until``), the collectives issued inside every ``monitor.step`` ([name, elements]) and the
losses it passed. Not a test module (no ``test_`` prefix): pytest does not collect it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from diag.outputs.sinks import MemorySink
from hooks import Monitor
from hooks.demo import GPT, GPTConfig, adamw, encode, load_text

WORDS = ("gather", "reduce", "broadcast", "scatter", "alltoall", "all_to_all", "barrier", "send", "recv")
GLOBAL_BATCH = 8


class Collectives(TorchDispatchMode):
    """c10d collectives dispatched while active: [name, elements of the largest tensor]."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.split(".")[0] in ("c10d", "_c10d_functional") and any(w in name for w in WORDS):
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.seen.append([name, max((t.numel() for t in tensors), default=0)])
        return func(*args, **(kwargs or {}))


def build(mode: str, vocab: int) -> tuple[torch.nn.Module, GPTConfig]:
    cfg = GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, n_embd=64, block_size=64)
    torch.manual_seed(1)
    model = GPT(cfg).double()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    return model, cfg


def batch(data: torch.Tensor, ctx: int, step: int, rank: int, world: int,
          twice: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's global batch: (x, y), (B, T) each."""
    drawn = GLOBAL_BATCH // 2 if twice else GLOBAL_BATCH
    ix = torch.randint(len(data) - ctx - 1, (drawn,), generator=torch.Generator().manual_seed(1000 + step))
    ix = torch.cat([ix, ix]) if twice else ix
    per = GLOBAL_BATCH // world
    mine = ix[rank * per:(rank + 1) * per].tolist()
    x = torch.stack([data[i:i + ctx] for i in mine])  # (B, T)
    y = torch.stack([data[i + 1:i + 1 + ctx] for i in mine])  # (B, T)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("single", "ddp", "fsdp"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--twice", action="store_true", help="the global batch: 4 sequences, twice over")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode != "single":
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.mode != "single" else (0, 1)
    data, vocab = encode(load_text(200_000))
    model, cfg = build(args.mode, vocab)
    opt = adamw(model, args.lr)
    memory = MemorySink()  # every rank's records: the steps it sampled
    monitor = Monitor(model, logdir=args.out / "logs", sinks=[memory], attn_seqs=2, images=False)
    record: dict = {"looks": {}, "collectives": {}, "losses": []}
    for step in range(args.steps):
        x, y = batch(data, cfg.block_size, step, rank, world, args.twice)
        loss = model(x, y)
        loss.backward()
        given = loss.detach().clone()
        if world > 1:  # the global batch's loss: the mean of the ranks' (equal token counts)
            dist.all_reduce(given)
            given /= world
        with Collectives() as counter:
            monitor.step(step, loss=given)
        record["collectives"][step] = counter.seen
        record["looks"][step] = [monitor.closer.near_until, monitor.closer.risk_until]
        record["losses"].append(float(given))
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    record["sampled"] = sorted({r.step for r in memory.records})
    record["attention"] = sorted({r.step for r in memory.records if any(t.startswith("attn_entropy/")
                                                                        for t in r.scalars)})
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if args.mode != "single":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
