"""Two gloo ranks train a tiny nanoGPT under DDP, each with a WandbSink of its own (as a user who builds the sink on
every rank), for tests/outputs/test_wandb_sink.py::test_only_rank_0_writes_under_ddp.

    torchrun --standalone --nproc_per_node 2 tests/outputs/wandb_ddp_worker.py OUT

Each rank's sink gets ``dir=OUT/rank<r>``; rank 0's Monitor writes ``OUT/logs``; every rank writes
``OUT/active_rank<r>.json`` (whether its sink is active). Not a test module: pytest does not collect it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diag.outputs.wandb_sink import WandbSink
from hooks import Monitor
from tests.support.zoo import SEQ, VOCAB, NanoGPT, _lm_loss


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = NanoGPT()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sink = WandbSink(project="attnscope-ddp", dir=out / f"rank{rank}")
    (out / f"active_rank{rank}.json").write_text(json.dumps(sink.active and sink.run is not None))
    monitor = Monitor(model, logdir=out / "logs", every=1, images=False, sinks=[sink])
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        loss = _lm_loss(ddp(ids), ids)
        loss.backward()
        monitor.step(step, loss=loss)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
