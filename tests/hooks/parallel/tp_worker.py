"""One training run under tensor parallelism (and FSDP2, HSDP) with the Monitor, for test_tensor_parallel.py.

    python tests/hooks/parallel/tp_worker.py single-llama OUT          # one process: the reference of tp
    python tests/hooks/parallel/tp_worker.py single-titan OUT          # one process: the reference of the rest
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/tp_worker.py tp OUT
    torchrun --standalone --nproc_per_node 2 tests/hooks/parallel/tp_worker.py tp-sp OUT
    torchrun --standalone --nproc_per_node 4 tests/hooks/parallel/tp_worker.py tp-fsdp OUT
    torchrun --standalone --nproc_per_node 4 tests/hooks/parallel/tp_worker.py hsdp OUT

* ``tp``: a Hugging Face LLaMA (GQA 4/2, SDPA) with ``parallelize_module``: ColwiseParallel on q/k/v and the
  MLP's gate/up, RowwiseParallel on o and down, on a (2,) mesh;
* ``tp-sp``: torchtitan's LLaMA shape with torchtitan's plan (sequence-parallel norms, the embedding rowwise
  to sequence shards, W_O and w2 back to sequence shards: :mod:`tests.support.titan`), on a (2,) mesh;
* ``tp-fsdp``: the same plan on the ``tp`` dim of a (2, 2) ``("dp", "tp")`` mesh, then ``fully_shard`` of every
  block and the root on ``dp`` (torchtitan's ``parallelize_llama``);
* ``hsdp``: ``fully_shard`` on a (2, 2) ``("replicate", "shard")`` mesh, no tensor parallelism;
* ``--swap-heads RANK``: on that rank, layer 0's kernel computes its query heads in swapped order, so that rank
  alone refuses the layer's layout.

Both models have 4 query and 2 key/value heads: each tensor-parallel rank holds 2 query heads and 1 key/value
head. Every step draws a global batch of 4 sequences from a generator seeded by the step; the data-parallel
ranks (dp, HSDP) split it, the tensor-parallel ranks of one data-parallel rank share it. The loss is the mean
over the rank's tokens, so the averaged gradients equal one process's on the whole batch. ``attn_seqs=1``:
rank 0's first sequence is the batch's first, so the attention statistics compare too.

Writes: ``OUT/logs`` (rank 0's Monitor logdir), per rank ``OUT/rank{r}.json``: its losses, ``monitor.last``, the
histograms of its records (``qk_spectrum``: every head's singular values),
the collectives issued inside each ``monitor.step`` (c10d name and bytes of the largest tensor it moved), the
heads whose spectra it computed per sampled step (global numbers, per layer), the snapshot bytes it held
for the update ratios of step 0, the layers its Monitor refuses (index: why), and its final weights' checksum
under ``SpectralStepLimit`` (``--step-limit``).
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

GLOBAL_BATCH, SEQ, VOCAB = 4, 12, 50
WORDS = ("gather", "reduce", "broadcast", "scatter", "alltoall", "all_to_all", "barrier", "send", "recv")
MODES = {"single-llama": 1, "single-titan": 1, "tp": 1, "tp-sp": 1, "tp-fsdp": 2, "hsdp": 4}  # data-parallel ranks


class Collectives(TorchDispatchMode):
    """c10d collectives dispatched while active: (name, bytes of the largest tensor it read or wrote)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.split(".")[0] in ("c10d", "_c10d_functional") and any(w in name for w in WORDS):
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.seen.append((name, max((t.numel() * t.element_size() for t in tensors), default=0)))
        return func(*args, **(kwargs or {}))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, initializer_range=0.2)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def titan() -> torch.nn.Module:
    from tests.support.titan import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64)
    with torch.no_grad():  # larger weights than the default init: spectra and attention well away from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def build(mode: str) -> tuple[torch.nn.Module, object]:
    """The model, parallelized for ``mode``, and the device mesh (None in one process)."""
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "single-llama":
        return llama(), None
    if mode == "single-titan":
        return titan(), None
    if mode == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh, model = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), llama()
        for layer in model.model.layers:
            parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                       "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
            parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                 "down_proj": RowwiseParallel()})
        return model, mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.titan import apply_tp

    model = titan()
    if mode == "tp-sp":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        apply_tp(model, mesh)
        return model, mesh
    if mode == "tp-fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"])
        dp = mesh["dp"]
    else:  # hsdp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp = mesh
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, mesh


def data_rank(mode: str, mesh) -> int:
    """Which part of the global batch this rank trains on: its data-parallel coordinate."""
    if mesh is None or mode in ("tp", "tp-sp"):
        return 0
    if mode == "tp-fsdp":
        return mesh.get_local_rank("dp")
    return dist.get_rank()


def batch(step: int, part: int, parts: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    per = GLOBAL_BATCH // parts
    return ids[part * per : (part + 1) * per]


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids) if not hasattr(model, "config") else model(input_ids=ids).logits
    return out


def count_heads(monitor, seen: dict) -> None:
    """Record which heads' spectra this rank computes (global numbers, per layer), by wrapping layer_spectra."""
    import hooks.monitor.weightside as weightside

    inner = weightside.layer_spectra

    def counting(qk, sec_top):
        seen.setdefault("calls", []).append([int(wq.shape[0]) for wq, _ in qk])
        return inner(qk, sec_top)

    weightside.layer_spectra = counting
    seen["work"] = {}
    for layer in monitor.layers:
        if layer.block is None:
            seen["work"][layer.label] = list(range(layer.layout.n_heads))
        else:
            work = monitor.sampler._heads.work(layer)
            seen["work"][layer.label] = [layer.block.first_head + h for h in work.q]


def swap_query_heads(q_proj: torch.nn.Module) -> None:
    """This rank's attention kernel computes its two query heads in swapped order: its q disagrees with the layout
    of its block (what a module that reorders heads between projection and kernel does)."""

    def swap(module, args, out):  # (B, T, 2 * D): this rank's two heads
        return out.unflatten(-1, (2, -1)).flip(-2).flatten(-2)

    q_proj.register_forward_hook(swap)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=tuple(MODES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--every", type=int, default=3, help="0: the Monitor's default per-family cadence")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--cadence", type=json.loads, default=None, help='e.g. {"spectra": 6}')
    parser.add_argument("--alerts", type=json.loads, default=None, help='AlertConfig fields')
    parser.add_argument("--step-limit", type=float, default=None, help="wrap SGD in SpectralStepLimit(tau=...)")
    parser.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                        help="QKClip(tau=TAU) after every optimizer step; W_Q and W_K times --grow first")
    parser.add_argument("--grow", type=float, default=1.0, help="with --qk-clip: W_Q and W_K times this")
    parser.add_argument("--swap-heads", type=int, default=None, metavar="RANK",
                        help="on this rank, layer 0's kernel gets its two query heads swapped (tp mode)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    single = args.mode.startswith("single")
    if not single:
        dist.init_process_group("gloo")
    from diag.detectors import AlertConfig
    from diag.outputs.sinks import MemorySink
    from hooks import Monitor
    from hooks.monitor.weightside import ShardSnapshot
    from hooks.steplimit import SpectralStepLimit

    model, mesh = build(args.mode)
    rank = dist.get_rank() if not single else 0
    if args.swap_heads == rank:
        swap_query_heads(model.model.layers[0].self_attn.q_proj)
    part, parts = data_rank(args.mode, mesh), MODES[args.mode] if not single else 1
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    memory = MemorySink()  # every rank's records, with the per-head spectra (histograms: not in metrics.jsonl)
    monitor = Monitor(model, logdir=args.out / "logs", every=args.every or None, cadence=args.cadence, attn_seqs=1,
                      images=False, sinks=[memory], alerts=AlertConfig(**args.alerts) if args.alerts else None)
    if args.step_limit is not None:
        opt = SpectralStepLimit(opt, tau=args.step_limit, model=model, monitor=monitor)
    clip = None
    if args.qk_clip is not None:
        from hooks import QKClip

        with torch.no_grad():  # elementwise: the same on a DTensor's shards as on the whole weight
            for name, p in model.named_parameters():
                if any(f"{part}." in name for part in ("q_proj", "k_proj", "wq", "wk")):
                    p.mul_(args.grow)
        clip = QKClip(model, args.qk_clip, optimizer=opt, monitor=monitor)
        record_clip: dict = {}
    record: dict = {"losses": [], "collectives": {}, "spectra": {}}
    count_heads(monitor, record["spectra"])
    for step in range(args.steps):
        ids = batch(step, part, parts)
        logits = logits_of(model, ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        with Collectives() as counter:
            monitor.step(step, loss=loss)
        record["collectives"][step] = counter.seen
        if step == 0 and monitor._weights.pending is not None:
            held = [t for snap in monitor._weights.pending.snapshots
                    for t in (snap.local.values() if isinstance(snap, ShardSnapshot) else [c.before for c in snap])]
            record["snapshot_bytes"] = sum(t.numel() * t.element_size() for t in held)
        record["losses"].append(float(loss.detach()))
        if clip is not None:
            with Collectives() as counter:
                opt.step()
            record_clip[step] = counter.seen
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    with Collectives() as counter:
        monitor.close()
    record["collectives"][args.steps] = counter.seen
    record["last"] = monitor.last
    record["refused"] = {str(index): why for index, why in monitor.refused.items()}
    record["histograms"] = {f"{r.step}/{tag}": [float(v) for v in values] for r in memory.records
                            for tag, values in r.histograms.items()}
    record["confirmed"] = {str(layer.index): layer.record.checked for layer in monitor.layouts.layers
                           if layer.record.state in ("confirmed", "adopted")}  # what the layout check compared
    record["blocks"] = {layer.label: None if layer.block is None else [layer.block.index, layer.block.size,
                                                                       layer.block.layout.describe()]
                        for layer in monitor.layers}
    if clip is not None:
        record["interventions"] = [[i.step, i.layer, i.head, i.factor] for i in clip.interventions]
        record["clip_collectives"] = record_clip
        record["clip_last"] = clip.last
    record["weights"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().tolist()
                         for n, p in model.named_parameters() if "attn" in n or "attention" in n}
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if not single:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
