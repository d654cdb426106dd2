"""share_attention (hooks.parallel.owners) on 2 gloo processes: every rank gets every layer's attention statistics as
its owner (position % world) measured them; a non-owner's values are never used; a layer its owner did not measure
is absent on every rank (not zeros); maps stay on the owner."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diag.math.attention import AttentionStats
from hooks.parallel.owners import share_attention

H = 3


def _stats(seed: float) -> AttentionStats:
    """Statistics whose every value derives from ``seed`` (NaN in one head's rank, as a non-finite head gives)."""
    head = torch.arange(H, dtype=torch.float64)
    return AttentionStats(entropy=seed + head, rank=torch.tensor([seed, torch.nan, seed + 2], dtype=torch.float64),
                          max_logit=-seed - head, rows=torch.tensor([seed * 10], dtype=torch.float64),
                          uniform_entropy=seed + 0.5 + head, sink=seed / 100 + head, sink_pos=head + seed,
                          maps=torch.full((H, 2, 2), seed, dtype=torch.float32))


def _layer(index: int) -> SimpleNamespace:
    mesh = SimpleNamespace(size=lambda: 2)
    return SimpleNamespace(index=index, layout=SimpleNamespace(n_heads=H), params=lambda: {"w": torch.zeros(1)},
                           weights=lambda: {"w": SimpleNamespace(device_mesh=mesh)})


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    layers = [_layer(i) for i in (10, 11, 12)]  # positions 0, 1, 2: owners 0, 1, 0
    owned = {10, 12} if rank == 0 else {11}
    # rank 0 measured layer 10 but not its layer 12 (a capture problem); rank 1 its layer 11, and, as in a forward
    # whose layouts were not yet settled, layers 10 and 12 too: those values must not be used
    results = {10: _stats(1.0)} if rank == 0 else {11: _stats(2.0), 10: _stats(7.0), 12: _stats(8.0)}
    shared, absent = share_attention(layers, results, owned)
    got = {i: {name: getattr(s, name).tolist() for name in ("entropy", "rank", "max_logit", "rows",
                                                            "uniform_entropy", "sink", "sink_pos")}
           | {"maps": None if s.maps is None else s.maps.tolist()} for i, s in shared.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"got": got, "absent": absent}))
    dist.destroy_process_group()


def test_every_rank_gets_the_owners_values_and_unmeasured_layers_are_absent(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, run in enumerate(runs):
        assert run["absent"] == {"12": 0}
        assert sorted(run["got"]) == ["10", "11"]
        for index, seed in (("10", 1.0), ("11", 2.0)):
            values, ref = run["got"][index], _stats(seed)
            for name in ("entropy", "max_logit", "rows", "uniform_entropy", "sink", "sink_pos"):
                assert values[name] == getattr(ref, name).tolist(), (rank, index, name)
            assert values["rank"][0] == seed and values["rank"][2] == seed + 2 and math.isnan(values["rank"][1])
        # maps: the owner's own, None on the other rank
        assert (run["got"]["10"]["maps"] is not None) == (rank == 0)
        assert (run["got"]["11"]["maps"] is not None) == (rank == 1)
