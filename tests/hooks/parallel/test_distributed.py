"""DDP and FSDP2 on CPU (gloo, 2 processes via torchrun) give the single process's numbers.

tests/hooks/parallel/dist_worker.py trains the same tiny nanoGPT on the same global batches in
three ways; rank 0's metrics.jsonl must equal the single process's within float
tolerance, tag for tag, except the loss (each rank logs the loss it passes: its
own half of the batch); the update ratios of W_O (``c_proj``, sharded unevenly like
``c_attn``) among them. The worker counts the collectives issued inside every
``monitor.step``: none under DDP; under FSDP2 one all-gather per layer on a sampled
step (that layer's Q/K/V and O weights and Q/K/V gradients packed: never more than one
layer's gathered weights at a time) and one per layer where the update ratios are measured
(that layer's dW, taken shard by shard from a snapshot of this rank's shards only), none on
other steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parents[3]
EVERY, STEPS, LAYERS = 3, 7, 2  # sampled: 0, 3, 6; update ratios measured at 1, 4 and at close
GLOBAL = ("qk_", "grad_", "update_")  # the same on every rank: weights, reduced gradients, updates


# gloo can abort a rank of a run that has written every output (rarely, on a loaded machine; the same test passes
# alone): std::terminate on a joinable thread at the process's exit, "terminate
# called without an active exception". Such a run is run once more; any other failure, or a second one, fails
TEARDOWN_ABORT = "terminate called without an active exception"


def _run(mode: str, out: Path, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if mode == "single":
        cmd = [sys.executable, str(WORKER), mode, str(out), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), mode, str(out), *extra]
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        written = all((out / f"losses_rank{r}.json").exists() for r in ((0,) if mode == "single" else (0, 1)))
        if done.returncode == 0 or attempt == 2 or TEARDOWN_ABORT not in done.stderr or not written:
            break
        shutil.rmtree(out)  # the same run again, in an empty folder
        out.mkdir()
    assert done.returncode == 0, f"{mode} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _metrics(out: Path) -> dict[tuple[int, str], float | None]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    keys = [(r["step"], r["tag"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (step, tag) was written twice: more than one rank writes"
    return {(r["step"], r["tag"]): r["value"] for r in rows}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    _run("single", out)
    return out


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-9)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_log_the_single_process_numbers(mode, single, tmp_path):
    _run(mode, tmp_path)
    ref, got = _metrics(single), _metrics(tmp_path)
    assert set(got) == set(ref)
    families = {tag.split("/")[0] for _, tag in ref}
    assert {"qk_sigma1", "grad_norm_q", "update_ratio_q", "update_ratio_o", "update_fro_o", "attn_entropy",
            "loss"} <= families
    assert {(s, f"update_ratio_o/L0{i}") for s in (0, 3, 6) for i in (0, 1)} <= set(ref)
    assert {step for step, _ in ref} == {0, 3, 6}
    bad = [(k, ref[k], got[k]) for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    # The loss is what rank 0 passed: the mean over its own sequences, not the global batch.
    # The single process's loss is the mean of the two ranks' (equal token counts).
    losses = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in (0, 1)]
    for step in (0, 3, 6):
        assert got[(step, "loss")] == pytest.approx(losses[0][step], rel=1e-6)
        assert ref[(step, "loss")] == pytest.approx((losses[0][step] + losses[1][step]) / 2, rel=1e-5)
        assert losses[0][step] != pytest.approx(losses[1][step], rel=1e-6)
    # Rank 1 computes but writes nothing; its weight-side metrics are rank 0's, its attention its own.
    last0 = json.loads((tmp_path / "last_rank0.json").read_text())
    last1 = json.loads((tmp_path / "last_rank1.json").read_text())
    # what the detectors judged (collapse_risk) is rank 0's, the writer's: the other ranks run no detector
    judged = {t for t in last0 if t.startswith("collapse_risk/")}
    assert judged and set(last0) - judged == set(last1)
    shared = [t for t in last0 if t.startswith(GLOBAL)]
    assert shared and all(_close(last0[t], last1[t], 1e-9) for t in shared)
    assert any(not _close(last0[t], last1[t]) for t in last0 if t.startswith("attn_entropy"))
    # beside the run's own files: TensorBoard sub-runs (L00/, alerts/<level>/) holding event files only
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir() if not p.name.startswith("events") and not p.is_dir()) == [
        "attnscope_layout.json", "metrics.jsonl"  # the layouts, for `python -m diag analyze`
    ]
    assert all(f.name.startswith("events") for d in logs.iterdir() if d.is_dir() for f in d.rglob("*") if f.is_file())
    _check_collectives(mode, tmp_path)
    # The update-ratio snapshot: the whole Q/K/V/O weights in one process and under DDP; under FSDP2
    # each rank's shards only (rank 0: 23 + 8 of the 45 + 15 rows of each layer's c_attn and c_proj).
    held = [json.loads((tmp_path / f"snapshot_bytes_rank{r}.json").read_text()) for r in (0, 1)]
    whole = json.loads((single / "snapshot_bytes_rank0.json").read_text())
    assert whole == LAYERS * (45 + 15) * 15 * 4
    assert held == ([whole, whole] if mode == "ddp" else [LAYERS * (23 + 8) * 15 * 4, LAYERS * (22 + 7) * 15 * 4])


def _check_collectives(mode: str, out: Path) -> None:
    """DDP: none. FSDP2: one all-gather per layer (2) at a sampled step and at the call after it (7 = close),
    each the same size: one layer's weights (and grads) or its dW, never every layer's at once."""
    counted = {int(k): v for k, v in json.loads((out / "collectives.json").read_text()).items()}
    sizes = {int(k): v for k, v in json.loads((out / "collective_sizes.json").read_text()).items()}
    assert sorted(counted) == list(range(STEPS + 1))
    gathered = {0, 1, 3, 4, 6, 7} if mode == "fsdp" else set()
    for step, names in counted.items():
        assert len(names) == (LAYERS if step in gathered else 0), (mode, step, names)
        assert all("allgather" in n or "all_gather" in n for n in names), names
        assert len(set(sizes[step])) <= 1, (step, sizes[step])  # per layer: equal layers, equal gathers
    if mode == "fsdp":  # a sampled step gathers weights and grads, the call after it dW only (the size of the weights)
        assert sizes[0][0] > sizes[1][0] > 0


def test_fsdp_default_cadence_gathers_what_each_step_samples(tmp_path_factory):
    """Default cadence (spectra every 100) over 12 steps: step 0 samples everything (two layers: one gather
    each, weights and grads), step 1 measures its update ratios (one layer's dW per gather), step 10 samples loss and
    gradient norms only (grads alone: smaller gathers); the values equal one process's."""
    single, fsdp = tmp_path_factory.mktemp("single_default"), tmp_path_factory.mktemp("fsdp_default")
    extra = ("--every", "0", "--steps", "12", "--cadence", '{"spectra": 100}')
    _run("single", single, *extra)
    _run("fsdp", fsdp, *extra)
    ref, got = _metrics(single), _metrics(fsdp)
    assert set(got) == set(ref)
    assert {step for step, tag in ref if tag.startswith("grad_norm_q")} == {0, 10}
    assert {step for step, tag in ref if tag.startswith(("qk_", "update_", "attn_"))} == {0}
    bad = [k for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    counted = {int(k): v for k, v in json.loads((fsdp / "collectives.json").read_text()).items()}
    sizes = {int(k): v for k, v in json.loads((fsdp / "collective_sizes.json").read_text()).items()}
    assert {s for s, names in counted.items() if names} == {0, 1, 10}
    assert all(len(counted[s]) == LAYERS for s in (0, 1, 10))
    assert sizes[0][0] > sizes[1][0] > sizes[10][0] > 0  # weights+grads > dW (Q/K/V/O) > Q/K/V grads


def test_fsdp_deferred_update_ratios_gather_nothing_on_the_step_after(tmp_path_factory):
    """Past a run's first steps the update ratios of a sampled step are finished on the next sampled step:
    under FSDP2 the step after takes dW shard by shard (no collective) and step 10 gathers each layer's
    dW beside its gradients; the ratios, logged at step 0, equal one process's."""
    single, fsdp = tmp_path_factory.mktemp("single_deferred"), tmp_path_factory.mktemp("fsdp_deferred")
    extra = ("--every", "0", "--steps", "12", "--cadence", '{"spectra": 100}', "--at-once", "0")
    _run("single", single, *extra)
    _run("fsdp", fsdp, *extra)
    ref, got = _metrics(single), _metrics(fsdp)
    assert set(got) == set(ref)
    assert {step for step, tag in ref if tag.startswith("update_ratio_o")} == {0}
    bad = [k for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    counted = {int(k): v for k, v in json.loads((fsdp / "collectives.json").read_text()).items()}
    sizes = {int(k): v for k, v in json.loads((fsdp / "collective_sizes.json").read_text()).items()}
    assert {s for s, names in counted.items() if names} == {0, 10}
    assert len(counted[0]) == LAYERS and len(counted[10]) == 2 * LAYERS  # step 10: gradients, then dW
    assert len(set(sizes[10])) == 2 and max(sizes[10]) < sizes[0][0]  # two kinds, each less than step 0's


def test_stop_on_critical_agrees_across_ranks(tmp_path):
    """Rank 0's observation is judged on every rank: a NaN loss on rank 1 alone (step 3) halts no rank
    (else rank 0 would wait in DDP's all-reduce for ever); one on rank 0 (step 6) halts both there."""
    _run("ddp", tmp_path, "--nan-loss", "1:3", "--nan-loss", "0:6")
    halted = [json.loads((tmp_path / f"halted_rank{r}.json").read_text()) for r in (0, 1)]
    assert halted == [6, 6]
    # The agreement costs one broadcast_object_list (two c10d broadcasts) per sampled step, nothing else.
    counted = {int(k): v for k, v in json.loads((tmp_path / "collectives.json").read_text()).items()}
    assert sorted(counted) == [0, 1, 2, 3, 4, 5, 6, STEPS]
    for step, names in counted.items():
        assert names == (["c10d.broadcast_"] * 2 if step % EVERY == 0 and step < STEPS else []), (step, names)
