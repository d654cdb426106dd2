"""A few training steps of a tiny model with QKClip, for tests/hooks/parallel/test_qkclip_parallel.py.

    python tests/hooks/parallel/qkclip_worker.py single OUT
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/qkclip_worker.py fsdp OUT
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/qkclip_worker.py stage OUT  # the refusal

The model is dist_worker's (``--model llama``: Hugging Face LLaMA, 9 query heads of 2 on 3 key/value heads, so
FSDP2's row shards of W_Q and W_K split a head between the two ranks; ``nanogpt``: the fused c_attn of 45 rows,
sharded 23 + 22), built the same on every rank, with W_Q and W_K times ``--grow`` so that the largest logits
exceed ``--tau`` (5). Every step trains on dist_worker's global batch (rank r of w: its batch / w sequences), with SGD
and QKClip after each ``optimizer.step()``.

``stage``: each rank shards the model with ``fully_shard`` on a mesh of itself alone (as a pipeline stage's mesh
does not span the job), where QKClip is refused; every rank writes the ConfigError's message to
``OUT/refused_rank{r}.txt`` and stops.

``ddp``: the model under DistributedDataParallel, each replica clipping its whole weights.

Every rank writes ``OUT/params_rank{r}.pt`` (every parameter, whole: ``full_tensor()`` under FSDP2; names without
DDP's ``module.``), ``OUT/interventions_rank{r}.json`` (each as [step, layer, head, factor]) and
``OUT/collectives_rank{r}.json`` (per step, the collectives issued inside ``optimizer.step()``, which runs the clip).
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

from diag.errors import ConfigError
from hooks import QKClip
from hooks.parallel.dtensors import is_dtensor
from tests.hooks.parallel.dist_worker import VOCAB, CountCollectives, batch, blocks, build, logits_of, wrap

# The weights grown (nanoGPT: Q, K and V fused) and by how much: about half the heads above tau=5 at each step
GROW = {"llama": (("q_proj", "k_proj"), 1.5), "nanogpt": (("c_attn",), 3.0)}


def refuse_stage(model: torch.nn.Module, out: Path, rank: int, tau: float) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [rank])  # this rank alone
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        QKClip(model, tau)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    (out / f"refused_rank{rank}.txt").write_text(refused)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("single", "fsdp", "ddp", "stage"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=("nanogpt", "llama"), default="llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tau", type=float, default=5.0)
    parser.add_argument("--grow", type=float, default=None, help="default: the model's in GROW")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode != "single":
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.mode != "single" else (0, 1)
    heads, n_embd = (9, 18) if args.model == "llama" else (3, 15)
    model = build(2, heads, n_embd, args.model, kv_heads=3)
    parts, grow = GROW[args.model]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f"{part}." in name for part in parts):
                p.mul_(args.grow or grow)
    if args.mode == "stage":
        refuse_stage(model, args.out, rank, args.tau)
        return
    model = wrap(model, args.mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    clip = QKClip(model, args.tau, optimizer=opt)
    collectives = []
    for step in range(args.steps):
        ids = batch(step, rank, world)
        logits = logits_of(model, ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        with CountCollectives() as counter:
            opt.step()
        collectives.append(counter.names)
        opt.zero_grad(set_to_none=True)
    params = {n.removeprefix("module."): (p.full_tensor() if is_dtensor(p) else p).detach().clone()
              for n, p in model.named_parameters()}
    done = [[i.step, i.layer, i.head, i.factor] for i in clip.interventions]
    (args.out / f"interventions_rank{rank}.json").write_text(json.dumps(done))
    (args.out / f"collectives_rank{rank}.json").write_text(json.dumps(collectives))
    torch.save(params, args.out / f"params_rank{rank}.pt")
    if args.mode != "single":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
