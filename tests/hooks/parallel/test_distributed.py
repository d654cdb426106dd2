"""DDP and FSDP2 on CPU (gloo, 2 and 4 processes via torchrun) give the single process's numbers.

tests/hooks/parallel/dist_worker.py trains the same tiny model on the same global batches in
three ways; rank 0's metrics.jsonl must equal the single process's within float
tolerance, tag for tag, except the loss (each rank logs the loss it passes: its
own part of the batch); the update ratios of W_O (``c_proj``, sharded unevenly like
``c_attn``) among them. The attention statistics are those of the first sequences of rank 0's
batch under DDP, and under FSDP2 alone, for layer i, of rank (i % world)'s, the layer's owner:
they are compared with a single process whose global batch starts with that rank's sequences.
The worker counts the collectives issued inside every
``monitor.step`` on every rank, with the bytes each wrote on that rank: none under DDP; under
FSDP2 alone, on a step that samples spectra or update ratios, one ``gather`` per layer of that
layer's shards to its owner rank (layer i to rank i % world: the only rank that receives them)
and one all-reduce of float64 scalars; on a step that samples only the loss and the gradient
norms, that all-reduce alone (per-head sums of squares of each rank's shards: no gradient
moves); on a step that samples attention, then one all-reduce of the owners' attention
statistics; where the update ratios are measured, one gather per layer of its dW to its owner and
one all-reduce of the ratios; where attention is sampled less often than the loss (the closer look is on), one
broadcast of the look's decision (2 int64) after each of those; nothing on other steps. It also records which
layers' attention statistics each rank computed: under FSDP2 alone, once the layouts are settled, the layers it owns.
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

from diag.catalog.tags import parse_tag

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parents[3]
EVERY, STEPS, LAYERS = 3, 7, 2  # sampled: 0, 3, 6; update ratios measured at 1, 4 and at close
GLOBAL = ("qk_", "grad_", "update_")  # the same on every rank: weights, reduced gradients, updates
OWNERS = ("attn_", "collapse_risk")  # under FSDP2 alone: layer i's from rank i % world's sequences


# gloo can abort a rank of a run that has written every output (rarely, on a loaded machine; the same test passes
# alone): std::terminate on a joinable thread at the process's exit, "terminate
# called without an active exception". Such a run is run once more; any other failure, or a second one, fails
TEARDOWN_ABORT = "terminate called without an active exception"


def _run(mode: str, out: Path, *extra: str, ranks: int = 2) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if mode == "single":
        cmd = [sys.executable, str(WORKER), mode, str(out), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(WORKER), mode, str(out), *extra]
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        written = all((out / f"losses_rank{r}.json").exists() for r in ((0,) if mode == "single" else range(ranks)))
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


@pytest.fixture(scope="module")
def single_rolled(tmp_path_factory) -> Path:
    """One process on the global batch that starts with rank 1's sequences (of 2 ranks)."""
    out = tmp_path_factory.mktemp("single_rolled")
    _run("single", out, "--roll", "2")
    return out


def _owners(runs: dict[int, Path], world: int, size: int) -> dict[tuple[int, str], float | None]:
    """What FSDP2 alone on ``world`` ranks logs, from one-process runs keyed by ``--roll``: layer i's attention
    statistics (and its collapse_risk, which reads them) from the run whose first sequences are its owner's, rank
    i % world (roll (i % world) x size / world); every other value from the run on the global batch as it is."""
    ref = {roll: _metrics(out) for roll, out in runs.items()}
    out = {}
    for key in ref[0]:
        tag, roll = parse_tag(key[1]), 0
        if tag is not None and tag.layer and tag.metric.startswith(OWNERS):
            roll = int(tag.layer[1:]) % world * (size // world)
        out[key] = ref[roll][key]
    return out


def _attention_work(out: Path, ranks: int) -> list[dict[int, list[int]]]:
    """Per rank, per step: the layers whose attention statistics it computed in that step's forward."""
    return [{int(k): v for k, v in json.loads((out / f"attn_layers_rank{r}.json").read_text()).items()}
            for r in range(ranks)]


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-9)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_log_the_single_process_numbers(mode, single, tmp_path, request):
    _run(mode, tmp_path)
    got = _metrics(tmp_path)
    if mode == "ddp":  # rank 0's sequences are the single process's first ones
        ref = _metrics(single)
    else:  # layer 1's attention: rank 1's sequences
        ref, first = _owners({0: single, 2: request.getfixturevalue("single_rolled")}, 2, 4), _metrics(single)
        differ = [k for k in ref if k[1].startswith("attn_entropy/L01") and not _close(ref[k], first[k])]
        assert differ, "the two ranks' sequences give the same attention: the comparison would prove nothing"
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
    # Rank 1 computes but writes nothing; its weight-side metrics are rank 0's; its attention is its own under DDP,
    # under FSDP2 the owners' on every rank.
    last0 = json.loads((tmp_path / "last_rank0.json").read_text())
    last1 = json.loads((tmp_path / "last_rank1.json").read_text())
    # what the detectors judged (collapse_risk) is rank 0's, the writer's: the other ranks run no detector
    judged = {t for t in last0 if t.startswith("collapse_risk/")}
    assert judged and set(last0) - judged == set(last1)
    shared = [t for t in last0 if t.startswith(GLOBAL + (("attn_",) if mode == "fsdp" else ()))]
    assert shared and all(_close(last0[t], last1[t], 1e-9) for t in shared)
    attention = [t for t in last0 if t.startswith("attn_entropy")]
    assert attention and (mode == "fsdp" or any(not _close(last0[t], last1[t]) for t in attention))
    # The attention each rank computed: every layer at step 0 (the first captured forward settles the layouts);
    # then under DDP every layer, under FSDP2 the layer it owns
    expected = ([{0: [0, 1], 3: [0, 1], 6: [0, 1]}] * 2 if mode == "ddp"
                else [{0: [0, 1], 3: [0], 6: [0]}, {0: [0, 1], 3: [1], 6: [1]}])
    assert _attention_work(tmp_path, 2) == expected
    # beside the run's own files: TensorBoard sub-runs (L00/, alerts/<level>/) holding event files only
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir() if not p.name.startswith("events") and not p.is_dir()) == [
        "alerts.jsonl", "attnscope_layout.json", "metrics.jsonl"  # the layouts, for `python -m diag analyze`
    ]
    assert all(f.name.startswith("events") for d in logs.iterdir() if d.is_dir() for f in d.rglob("*") if f.is_file())
    _check_collectives(mode, tmp_path)
    # The update-ratio snapshot: the whole Q/K/V/O weights in one process and under DDP; under FSDP2
    # each rank's shards only (rank 0: 23 + 8 of the 45 + 15 rows of each layer's c_attn and c_proj).
    held = [json.loads((tmp_path / f"snapshot_bytes_rank{r}.json").read_text()) for r in (0, 1)]
    whole = json.loads((single / "snapshot_bytes_rank0.json").read_text())
    assert whole == LAYERS * (45 + 15) * 15 * 4
    assert held == ([whole, whole] if mode == "ddp" else [LAYERS * (23 + 8) * 15 * 4, LAYERS * (22 + 7) * 15 * 4])


def _packed(shapes: list[tuple[int, int]], world: int) -> int:
    """Elements of the buffer each rank sends to a layer's owner (``hooks.parallel.gather.gather_to``): a header (its
    coordinate and each shard's rows), then each shard padded to ceil(rows / world) rows."""
    return 1 + len(shapes) + sum(math.ceil(rows / world) * cols for rows, cols in shapes)


def _scalars(layers: int, heads: int, head_dim: int, kv_heads: int | None = None, grads: bool = True,
             spectra: bool = True) -> int:
    """Float64 values of a sample's all-reduce (hooks.parallel.owners.ScalarSum): a spectra-failed flag; per layer, a
    count of ranks with gradients and the per-head sums of squares of Q, K, V; the spectra (four values and head_dim
    singular values per query head)."""
    kv = kv_heads or heads
    per = (1 + heads + 2 * kv if grads else 0) + (heads * (4 + head_dim) if spectra else 0)
    return layers * per + (1 if spectra else 0)


def _attention(layers: int, heads: int) -> int:
    """Float64 values of an attention sample's all-reduce (hooks.parallel.owners.share_attention): per layer, a
    flag "measured by its owner", the valid rows and six values per head (entropy, rank, max logit, uniform entropy,
    sink share and position)."""
    return layers * (2 + 6 * heads)


NANO = [(45, 15), (15, 15)]  # c_attn and c_proj of the default nanoGPT (3 heads of 5)
GATHER, ALL_REDUCE = "c10d.gather_", "c10d.allreduce_"
# the closer look's decision (on where attention is sampled less often than the loss): rank 0's two int64, broadcast
# after every step the detectors judged
AGREE = ["c10d.broadcast_", 2, 16]


def _per_rank(out: Path, ranks: int) -> list[dict[int, list]]:
    """Every rank's collectives per step: [name, elements of the largest tensor, bytes it wrote on that rank]."""
    return [{int(k): v for k, v in json.loads((out / f"collectives_rank{r}.json").read_text()).items()}
            for r in range(ranks)]


def _check_owned(calls: list, rank: int, world: int, layers: int, packed: int) -> None:
    """One gather per layer, each ``packed`` elements per rank, received by the layer's owner (i % world) alone."""
    gathers = [c for c in calls if c[0] == GATHER]
    assert [c[1] for c in gathers] == [packed] * layers, calls
    assert [c[2] for c in gathers] == [world * packed * 4 if i % world == rank else 0 for i in range(layers)], calls


def _check_collectives(mode: str, out: Path) -> None:
    """DDP: none. FSDP2: at a sampled step (all families) one gather per layer of its Q/K/V/O shards to its owner,
    one all-reduce of 75 weight-side scalars, then one of 40 attention scalars; at the call after it (7 = close) one
    gather per layer of its dW and one all-reduce of 16 update ratios (2 layers x 4 matrices x 2 ratios); nothing
    else."""
    counted = {int(k): v for k, v in json.loads((out / "collectives.json").read_text()).items()}
    assert sorted(counted) == list(range(STEPS + 1))
    if mode == "ddp":
        assert all(names == [] for names in counted.values()), counted
        return
    ranks = _per_rank(out, 2)
    for rank, steps in enumerate(ranks):
        for step, calls in steps.items():
            if step not in {0, 1, 3, 4, 6, 7}:
                assert calls == [], (rank, step, calls)
                continue
            _check_owned(calls, rank, 2, LAYERS, _packed(NANO, 2))
            sizes = [_scalars(LAYERS, 3, 5), _attention(LAYERS, 3)] if step % EVERY == 0 else [LAYERS * 8]
            assert [c for c in calls if c[0] != GATHER] == [[ALL_REDUCE, n, 8 * n] for n in sizes], (rank, step, calls)


def test_fsdp_default_cadence_gathers_what_each_step_samples(tmp_path_factory):
    """Default cadence (spectra every 100) over 12 steps: step 0 samples everything (two layers: one gather each of
    its weights to its owner, then the scalars, then the attention's), step 1 measures its update ratios (each
    layer's dW to its owner), step 10 samples loss and gradient norms only (one all-reduce of per-head scalars,
    nothing gathered); each of them ends with the closer look's broadcast (attention every 50 steps: the look is
    on); the values equal one process's (layer 1's attention: on rank 1's sequences)."""
    single, fsdp = tmp_path_factory.mktemp("single_default"), tmp_path_factory.mktemp("fsdp_default")
    rolled = tmp_path_factory.mktemp("single_default_rolled")
    extra = ("--every", "0", "--steps", "12", "--cadence", '{"spectra": 100}')
    _run("single", single, *extra)
    _run("single", rolled, *extra, "--roll", "2")
    _run("fsdp", fsdp, *extra)
    ref, got = _owners({0: single, 2: rolled}, 2, 4), _metrics(fsdp)
    assert set(got) == set(ref)
    assert {step for step, tag in ref if tag.startswith("grad_norm_q")} == {0, 10}
    assert {step for step, tag in ref if tag.startswith(("qk_", "update_", "attn_"))} == {0}
    bad = [k for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    for rank, steps in enumerate(_per_rank(fsdp, 2)):
        assert {s for s, calls in steps.items() if calls} == {0, 1, 10}
        assert all(steps[s][-1] == AGREE and AGREE not in steps[s][:-1] for s in (0, 1, 10))
        for step in (0, 1):  # the weights (step 0) and dW (step 1) of each layer to its owner, then the scalars
            _check_owned(steps[step], rank, 2, LAYERS, _packed(NANO, 2))
        assert steps[0][-3:-1] == [[ALL_REDUCE, n, 8 * n] for n in (_scalars(LAYERS, 3, 5), _attention(LAYERS, 3))]
        assert steps[1][-2] == [ALL_REDUCE, LAYERS * 8, 8 * LAYERS * 8]
        # loss and gradient norms only: per-head sums of squares of this rank's shards, 2 x (1 + 3 x 3) float64
        assert steps[10] == [[ALL_REDUCE, _scalars(LAYERS, 3, 5, spectra=False), 8 * LAYERS * 10], AGREE]


def test_fsdp_deferred_update_ratios_gather_nothing_on_the_step_after(tmp_path_factory):
    """Past a run's first steps the update ratios of a sampled step are finished on the next sampled step:
    under FSDP2 the step after takes dW shard by shard (no collective) and step 10 gathers each layer's
    dW to its owner beside the gradient norms' scalars, each judgement (the ratios', the sample's) followed by the
    closer look's broadcast; the ratios, logged at step 0, equal one process's."""
    single, fsdp = tmp_path_factory.mktemp("single_deferred"), tmp_path_factory.mktemp("fsdp_deferred")
    rolled = tmp_path_factory.mktemp("single_deferred_rolled")
    extra = ("--every", "0", "--steps", "12", "--cadence", '{"spectra": 100}', "--at-once", "0")
    _run("single", single, *extra)
    _run("single", rolled, *extra, "--roll", "2")
    _run("fsdp", fsdp, *extra)
    ref, got = _owners({0: single, 2: rolled}, 2, 4), _metrics(fsdp)
    assert set(got) == set(ref)
    assert {step for step, tag in ref if tag.startswith("update_ratio_o")} == {0}
    bad = [k for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    for rank, steps in enumerate(_per_rank(fsdp, 2)):
        assert {s for s, calls in steps.items() if calls} == {0, 10}
        _check_owned(steps[0], rank, 2, LAYERS, _packed(NANO, 2))
        # step 10: each layer's dW to its owner and the ratios' all-reduce, and the gradient norms' all-reduce
        _check_owned(steps[10], rank, 2, LAYERS, _packed(NANO, 2))
        assert sorted(c[1] for c in steps[10] if c[0] == ALL_REDUCE) == [LAYERS * 8, _scalars(LAYERS, 3, 5,
                                                                                               spectra=False)]
        assert steps[10].count(AGREE) == 2 and steps[10][-1] == AGREE
        assert len(steps[10]) == LAYERS + 4


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


# 4 layers of 4 heads of 8 (c_attn 96 x 32, c_proj 32 x 32), 8 sequences a step (2 per rank on 4 ranks); every step
# logs the loss, gradient norms every 2 steps, spectra every 3, attention and update ratios every 6: step 2 samples
# gradients alone, step 3 spectra alone, steps 0 and 6 everything (update ratios measured at 1 and 7)
WIDE = ("--batch", "8", "--layers", "4", "--heads", "4", "--n-embd", "32", "--every", "0",
        "--cadence", '{"loss": 1, "grads": 2, "spectra": 3, "attention": 6, "updates": 6}')
WIDE_SHAPES = [(96, 32), (32, 32)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[int, Path]:
    """The WIDE run in one process and under FSDP2 on 2 and 4 ranks."""
    runs = {}
    for ranks in (1, 2, 4):
        out = tmp_path_factory.mktemp(f"wide{ranks}")
        _run("single" if ranks == 1 else "fsdp", out, *WIDE, ranks=ranks)
        runs[ranks] = out
    return runs


@pytest.fixture(scope="module")
def wide_rolled(wide, tmp_path_factory) -> dict[int, Path]:
    """The WIDE run in one process on the global batch rolled by 0, 2, 4 and 6 sequences: its first sequences are
    those of rank 0, 1, 2, 3 of 4 (and 0, -, 1, - of 2)."""
    runs = {0: wide[1]}
    for roll in (2, 4, 6):
        out = tmp_path_factory.mktemp(f"wide_roll{roll}")
        _run("single", out, *WIDE, "--roll", str(roll))
        runs[roll] = out
    return runs


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_ranks_log_the_single_process_numbers_wide(wide, wide_rolled, ranks):
    """FSDP2 on 2 and 4 ranks: every logged value (per head and per layer) is the one-process value, layer i's
    attention that of one process on rank (i % world)'s sequences; every rank's ``monitor.last`` holds the same
    weight-side and attention values; at the steady-state attention sample (step 6) each rank computed the
    attention of the layers it owns, and nothing else."""
    ref, got = _owners(wide_rolled, ranks, 8), _metrics(wide[ranks])
    assert set(got) == set(ref)
    assert {step for step, tag in ref if tag.startswith("grad_norm_q")} == {0, 2, 4, 6}
    assert {step for step, tag in ref if tag.startswith("qk_sigma1")} == {0, 3, 6}
    assert {step for step, tag in ref if tag.startswith("update_ratio_o")} == {0, 6}
    bad = [(k, ref[k], got[k]) for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    last = [json.loads((wide[ranks] / f"last_rank{r}.json").read_text()) for r in range(ranks)]
    shared = [t for t in last[0] if t.startswith(GLOBAL + ("attn_",))]
    assert {t.split("/")[0] for t in shared} >= {"qk_sigma1", "attn_entropy", "attn_sink_pos"}
    assert all(_close(last[0][t], other[t], 1e-9) for other in last[1:] for t in shared)
    work = _attention_work(wide[ranks], ranks)
    assert work == [{0: [0, 1, 2, 3], 6: [i for i in range(4) if i % ranks == r]} for r in range(ranks)]


def _received(out: Path, ranks: int, step: int) -> list[int]:
    """Per rank, the bytes the sample's collectives at ``step`` wrote on it (the closer look's broadcast left out)."""
    return [sum(c[2] for c in steps[step] if c != AGREE) for steps in _per_rank(out, ranks)]


def test_fsdp_bytes_per_rank_fall_with_the_ranks(wide):
    """Bytes each rank receives per sample: a gradient sample moves one all-reduce of per-head float64 scalars,
    the same size at any world; a spectra or update sample receives, per rank, the layers it owns (4 layers: 2 on 2
    ranks, 1 on 4) and the scalars, so it falls about as 1/world; an attention sample adds one all-reduce of the
    owners' attention statistics (4 x (2 + 6 x 4) float64); the call that measures the update ratios likewise. Every
    call that judged a step (each step samples the loss) ends with the closer look's broadcast of 16 bytes (step 1
    twice: step 0's update ratios, then its own sample); none at close."""
    scalars = {"grads": _scalars(4, 4, 8, spectra=False), "spectra": _scalars(4, 4, 8, grads=False),
               "all": _scalars(4, 4, 8), "attention": _attention(4, 4)}
    qkv, qkvo = WIDE_SHAPES[:1], WIDE_SHAPES
    table = {}
    for world in (2, 4):
        per_rank = _per_rank(wide[world], world)
        for rank, calls in enumerate(per_rank):
            agreed = {s: c.count(AGREE) for s, c in calls.items()}
            assert agreed == {0: 1, 1: 2, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 0}, (rank, calls)
            assert all(c[-1] == AGREE for s, c in calls.items() if s < 7)
            steps = {s: [c for c in cs if c != AGREE] for s, cs in calls.items()}
            assert steps[2] == [[ALL_REDUCE, scalars["grads"], 8 * scalars["grads"]]]  # gradients: scalars only
            _check_owned(steps[3], rank, world, 4, _packed(qkv, world))  # spectra: Q/K/V to the owner
            assert steps[3][-1] == [ALL_REDUCE, scalars["spectra"], 8 * scalars["spectra"]]
            for step in (0, 1):  # everything (W_O too, for the update ratios); the ratios' dW
                _check_owned(steps[step], rank, world, 4, _packed(qkvo, world))
            assert steps[0][-2:] == [[ALL_REDUCE, scalars[k], 8 * scalars[k]] for k in ("all", "attention")]
            assert steps[1][-1] == [ALL_REDUCE, 4 * 8, 8 * 4 * 8]
            assert [steps[s] for s in (4, 5)] == [[[ALL_REDUCE, scalars["grads"], 8 * scalars["grads"]]], []]
        table[world] = {what: max(_received(wide[world], world, step))
                        for what, step in (("grads", 2), ("spectra", 3), ("all", 0), ("ratios", 1))}
    print(f"\nbytes received per rank (max over ranks): {table}")
    for what in ("spectra", "all", "ratios"):
        assert table[4][what] <= 0.6 * table[2][what], (what, table)
    assert table[4]["grads"] == table[2]["grads"] == 8 * scalars["grads"]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fsdp_hugging_face_layouts_log_the_single_process_numbers(model, tmp_path_factory):
    """GPT-2's Conv1D c_attn, stored (E, 3E): FSDP2 shards its input rows, so each head is a block of columns split
    over both ranks; LLaMA: separate q/k/v projections with 2 key/value heads. The gradient norms from per-head sums
    of squares of each rank's shards, the spectra and update ratios from each layer's owner, equal one process's;
    no gradient is gathered (each gather carries the layer's weights only); layer 1's attention is that of rank 1's
    sequences."""
    extra = ("--model", model, "--heads", "4", "--n-embd", "32")
    single, fsdp = tmp_path_factory.mktemp(f"single_{model}"), tmp_path_factory.mktemp(f"fsdp_{model}")
    rolled = tmp_path_factory.mktemp(f"single_{model}_rolled")
    _run("single", single, *extra)
    _run("single", rolled, *extra, "--roll", "2")
    _run("fsdp", fsdp, *extra)
    ref, got = _owners({0: single, 2: rolled}, 2, 4), _metrics(fsdp)
    assert set(got) == set(ref)
    assert {"qk_sigma1", "grad_norm_q", "grad_norm_k", "update_ratio_o"} <= {tag.split("/")[0] for _, tag in ref}
    bad = [(k, ref[k], got[k]) for k in ref if k[1] != "loss" and not _close(ref[k], got[k])]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"
    shapes = [(32, 96), (32, 32)] if model == "gpt2" else [(32, 32), (16, 32), (16, 32), (32, 32)]
    for rank, steps in enumerate(_per_rank(fsdp, 2)):
        _check_owned(steps[0], rank, 2, LAYERS, _packed(shapes, 2))
