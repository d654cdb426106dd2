"""One training run of a tiny nanoGPT with the Monitor, for tests/hooks/parallel/test_distributed.py.

    python tests/hooks/parallel/dist_worker.py single OUT                              # one process, the whole batch
    python tests/hooks/parallel/dist_worker.py single OUT --roll 2                     # sequence 2 first
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/dist_worker.py ddp OUT
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/dist_worker.py fsdp OUT
    torchrun --standalone --nproc_per_node 4 tests/hooks/parallel/dist_worker.py fsdp OUT --batch 8 --layers 4

Every step draws a global batch of 4 sequences (``--batch``) from a generator seeded by the step;
rank r of a 2-process job trains on sequences 2r and 2r+1 (of a w-process job, on its batch / w
consecutive sequences). The loss is the mean over
the rank's tokens, so DDP's and FSDP2's averaged gradients equal the single process's
gradient of the mean loss over the whole batch. Rank 0's sequences are the single
process's first two, and the Monitor analyses ``attn_seqs=2`` sequences, so the
attention statistics are comparable too. Under FSDP2 layer i's attention is that of rank
i % world's sequences: ``--roll K`` has the single process train on the global batch rolled so
that its sequence K comes first (rank r's first sequences: K = r x batch / world); the loss,
a mean over every sequence, and so the weights, stay those of the unrolled batch.

Writes (rank 0): the Monitor's logdir ``OUT/logs`` (``metrics.jsonl``), ``OUT/collectives.json``
(collectives issued inside each ``monitor.step`` call, counted with a dispatch mode) and
``OUT/collective_sizes.json`` (the elements of the largest tensor each of them moved);
every rank writes ``OUT/collectives_rank{r}.json`` (its collectives per step, each as [name, elements of the
largest tensor, bytes of the tensors it wrote on this rank: what the rank received, its own part included]),
``OUT/last_rank{r}.json`` (its ``monitor.last``), ``OUT/losses_rank{r}.json`` (its losses),
``OUT/halted_rank{r}.json`` (the step TrainingHalted stopped it, or null) and ``OUT/snapshot_bytes_rank{r}.json``
(the bytes the update-ratio snapshot of step 0 holds until step 1) and ``OUT/attn_layers_rank{r}.json``
(per step, the indices of the layers whose attention statistics the rank computed in that step's forward).
Not a test module (no ``test_`` prefix): pytest does not collect it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hooks.capture.capture as capture_module
from diag.detectors import TrainingHalted
from hooks import Monitor
from hooks.monitor.weightside import ShardSnapshot
from tests.support.zoo import NanoGPT

SEQ, VOCAB = 12, 50
COLLECTIVE_WORDS = ("gather", "reduce", "broadcast", "scatter", "alltoall", "all_to_all", "barrier", "send", "recv")


def build(layers: int = 2, heads: int = 3, n_embd: int = 15, kind: str = "nanogpt",
          kv_heads: int = 2) -> torch.nn.Module:
    """By default n_embd=15 (3 heads of 5): the fused c_attn weight has 45 rows and W_O (c_proj) 15, so FSDP2's
    shards are uneven (23 + 22, 8 + 7). ``gpt2``: Hugging Face GPT-2, whose Conv1D c_attn is stored (E, 3E), so
    FSDP2 shards its input rows and each head is a block of columns on every rank; ``llama``: Hugging Face LLaMA
    with separate q/k/v projections and ``kv_heads`` key/value heads."""
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=n_embd, n_layer=layers, n_head=heads,
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=n_embd, intermediate_size=2 * n_embd, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16,
                          initializer_range=0.2)
        return LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    return NanoGPT(vocab=VOCAB, block=16, n_layer=layers, n_head=heads, n_embd=n_embd, dropout=0.0)


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks (each one FSDP2 unit)."""
    for path in ("h", "transformer.h", "model.layers"):
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    raise AttributeError("no blocks found")


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return getattr(out, "logits", out)


def batch(step: int, rank: int, world: int, size: int = 4, roll: int = 0) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    ids = torch.roll(ids, -roll, 0)  # sequence ``roll`` first
    per = size // world
    return ids[rank * per : (rank + 1) * per]


class CountCollectives(TorchDispatchMode):
    """Counts c10d collectives (``dist.*`` and functional collectives alike) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.sizes: list[int] = []  # elements of the largest tensor each collective wrote or read
        self.received: list[int] = []  # bytes of the tensors each collective wrote on this rank (its first argument)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.split(".")[0] in ("c10d", "_c10d_functional") and any(w in name for w in COLLECTIVE_WORDS):
            self.names.append(name)
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.sizes.append(max((t.numel() for t in tensors), default=0))
            self.received.append(sum(t.numel() * t.element_size() for t in _flat(args[0] if args else [])))
        return func(*args, **(kwargs or {}))


def _flat(a: object) -> list[torch.Tensor]:
    """The tensors in ``a``, nested lists included (a gather's outputs: one list per input)."""
    if isinstance(a, torch.Tensor):
        return [a]
    return [t for x in a for t in _flat(x)] if isinstance(a, (list, tuple)) else []


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("single", "ddp", "fsdp"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--every", type=int, default=3, help="0: the Monitor's default per-family cadence")
    parser.add_argument("--cadence", type=json.loads, default=None, help='e.g. {"spectra": 100}')
    parser.add_argument("--at-once", type=int, default=None,
                        help="update ratios of steps before this are measured at the call after (default: 50)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, over all ranks")
    parser.add_argument("--roll", type=int, default=0, help="single: the global batch starts at this sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=15)
    parser.add_argument("--model", choices=("nanogpt", "gpt2", "llama"), default="nanogpt")
    parser.add_argument("--nan-loss", action="append", default=[], metavar="RANK:STEP",
                        help="this rank reports a NaN loss at this step (stop_on_critical is then on)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode != "single":
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.mode != "single" else (0, 1)
    model = wrap(build(args.layers, args.heads, args.n_embd, args.model), args.mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    nan_at = {tuple(int(x) for x in spec.split(":")) for spec in args.nan_loss}
    monitor = Monitor(model, logdir=args.out / "logs", every=args.every or None, attn_seqs=2, images=False,
                      cadence=args.cadence,
                      stop_on_critical=bool(nan_at))
    if args.at_once is not None:
        monitor._updates_at_once = args.at_once
    computed: dict[int, list[int]] = {}  # step -> layers whose attention statistics this rank computed
    forward = [0]  # the step whose forward runs
    stats_from_logits = capture_module.stats_from_logits

    def counted(*a, **k):
        computed.setdefault(forward[0], []).append(monitor.capture._mode.layer.index)  # the layer whose forward runs
        return stats_from_logits(*a, **k)

    capture_module.stats_from_logits = counted
    collectives: dict[int, list[str]] = {}
    sizes: dict[int, list[int]] = {}
    mine: dict[int, list] = {}  # this rank's: [name, size, bytes received] per collective
    losses = []
    halted = None
    for step in range(args.steps):
        forward[0] = step
        ids = batch(step, rank, world, args.batch, args.roll)
        logits = logits_of(model, ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        reported = float("nan") if (rank, step) in nan_at else loss
        with CountCollectives() as counter:
            try:
                monitor.step(step, loss=reported)
            except TrainingHalted:
                halted = step
        collectives[step], sizes[step] = counter.names, counter.sizes
        mine[step] = [list(c) for c in zip(counter.names, counter.sizes, counter.received)]
        if step == 0 and monitor._weights.pending is not None:
            held = [t for snap in monitor._weights.pending.snapshots
                    for t in (snap.local.values() if isinstance(snap, ShardSnapshot) else [c.before for c in snap])]
            snapshot_bytes = sum(t.numel() * t.element_size() for t in held)
            (args.out / f"snapshot_bytes_rank{rank}.json").write_text(json.dumps(snapshot_bytes))
        if halted is not None:
            break
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    with CountCollectives() as counter:
        monitor.close()
    collectives[args.steps] = counter.names  # close() measures the last sampled step's update
    sizes[args.steps] = counter.sizes
    mine[args.steps] = [list(c) for c in zip(counter.names, counter.sizes, counter.received)]
    (args.out / f"collectives_rank{rank}.json").write_text(json.dumps(mine))
    (args.out / f"last_rank{rank}.json").write_text(json.dumps(monitor.last))
    (args.out / f"halted_rank{rank}.json").write_text(json.dumps(halted))
    (args.out / f"attn_layers_rank{rank}.json").write_text(json.dumps(computed))
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    if rank == 0:
        (args.out / "collectives.json").write_text(json.dumps(collectives))
        (args.out / "collective_sizes.json").write_text(json.dumps(sizes))
    if args.mode != "single":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
