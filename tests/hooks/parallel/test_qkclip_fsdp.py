"""QKClip under FSDP2 alone (torchrun, 2 gloo ranks) gives the single process's weights and interventions.

tests/hooks/parallel/qkclip_worker.py trains a tiny LLaMA (9 query heads on 3 key/value heads, grouped-query)
and a tiny nanoGPT (fused c_attn) with W_Q and W_K grown so that about half the heads exceed tau at each step, on
the same global batches, in one process and under ``fully_shard`` on 2 ranks (each on half of every batch; FSDP2's
row shards split a head, and a key head, between the ranks). After 3 steps the parameters rank 0 gathers equal
the single process's, every rank clipped the same heads by the same factors as the single process, and each
``optimizer.step()`` (the clip included) issued exactly one collective: the all-reduce (MAX) of the maxima.
Under DDP the same all-reduce keeps the replicas' clips, and weights, alike. Under HSDP (a 2-D mesh) QKClip is
refused at construction, naming the layer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("qkclip_worker.py")
ROOT = WORKER.parents[3]
RANKS, STEPS = 2, 3
# gloo can abort a rank at the exit of a run that wrote every output (tests/hooks/parallel/test_distributed.py);
# such a run is run once more
TEARDOWN_ABORT = "terminate called without an active exception"


def _run(mode: str, out: Path, model: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launch = [] if mode == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                          str(RANKS)]
    cmd = [sys.executable, *launch, str(WORKER), mode, str(out), "--model", model, "--steps", str(STEPS)]
    ranks = 1 if mode == "single" else RANKS
    written_name = "refused_rank{}.txt" if mode == "hsdp" else "collectives_rank{}.json"
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        written = all((out / written_name.format(r)).exists() for r in range(ranks))
        if done.returncode == 0 or attempt == 2 or TEARDOWN_ABORT not in done.stderr or not written:
            break
        shutil.rmtree(out)
        out.mkdir()
    assert done.returncode == 0, f"{mode} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _interventions(out: Path, rank: int) -> list[list]:
    return json.loads((out / f"interventions_rank{rank}.json").read_text())


@pytest.mark.parametrize("model", ["llama", "nanogpt"])
def test_fsdp_clip_gives_the_single_process_weights_with_one_all_reduce_per_step(model, tmp_path):
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    single.mkdir()
    fsdp.mkdir()
    _run("single", single, model)
    _run("fsdp", fsdp, model)
    ref = _interventions(single, 0)
    heads = {(step, layer, head) for step, layer, head, _ in ref}
    assert {step for step, _, _ in heads} == set(range(STEPS)), "every step clips some head"
    for rank in range(RANKS):
        got = _interventions(fsdp, rank)
        assert [i[:3] for i in got] == [i[:3] for i in ref], f"rank {rank} clipped other heads"
        assert [i[3] for i in got] == pytest.approx([i[3] for i in ref], rel=1e-5)
        collectives = json.loads((fsdp / f"collectives_rank{rank}.json").read_text())
        assert collectives == [["c10d.allreduce_"]] * STEPS, f"rank {rank}: {collectives}"
    want, got = torch.load(single / "params_rank0.pt"), torch.load(fsdp / "params_rank0.pt")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_ddp_replicas_clip_alike_and_give_the_single_process_weights(tmp_path):
    """Under DDP each replica reads the maxima of its own part of the batch; the all-reduce (MAX) makes every
    replica clip the same heads by the same factors, so the replicas stay equal, and equal to one process."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    single.mkdir()
    ddp.mkdir()
    _run("single", single, "llama")
    _run("ddp", ddp, "llama")
    ref = _interventions(single, 0)
    assert ref, "no head was clipped"
    want = torch.load(single / "params_rank0.pt")
    for rank in range(RANKS):
        got = _interventions(ddp, rank)
        assert [i[:3] for i in got] == [i[:3] for i in ref], f"rank {rank} clipped other heads"
        collectives = json.loads((ddp / f"collectives_rank{rank}.json").read_text())
        assert collectives == [["c10d.allreduce_"]] * STEPS, f"rank {rank}: {collectives}"
        params = torch.load(ddp / f"params_rank{rank}.pt")
        for name in want:
            torch.testing.assert_close(params[name], want[name], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


def test_hsdp_is_refused_by_layer_name(tmp_path):
    _run("hsdp", tmp_path, "nanogpt")
    for rank in range(RANKS):
        refused = (tmp_path / f"refused_rank{rank}.txt").read_text()
        assert "'h.0.attn'" in refused and "HSDP" in refused and "not FSDP2 alone" in refused, refused
