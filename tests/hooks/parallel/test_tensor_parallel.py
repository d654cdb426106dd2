"""Tensor parallelism (alone, with sequence parallelism, beside FSDP2) and HSDP on CPU (gloo, torchrun) give one
process's numbers, with each rank computing only the heads it holds.

tests/hooks/parallel/tp_worker.py trains the same tiny LLaMA (4 query heads, 2 key/value heads: each of the 2
tensor-parallel ranks holds 2 query heads and 1 key/value head) on the same global batches; rank 0's
``metrics.jsonl`` must equal the one-process run's, tag for tag (global head numbers), every value to rtol 1e-5:
spectra, gradient norms, update ratios, attention statistics and, with ``SpectralStepLimit``, its scales. The
worker counts the collectives issued inside every ``monitor.step`` and the bytes each moved; the test derives
the expected ones from the model's shapes:

* tensor parallelism alone: one all-gather of per-head scalars per sampled step (no weight is gathered), and the
  update ratios' all-reduces over the tensor-parallel group (W^T W of each stack of matrices: n x n with n =
  d_model, and ||.||_F^2), two per stack when the snapshot is taken and two when the ratios are measured;
* beside FSDP2: first, per layer, one all-gather over the ``dp`` dim of this rank's block (FSDP2 shards its rows),
  then the same;
* HSDP: one all-gather per layer over the shard dim (the replicate dim holds copies), no scalar gather.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = WORKER.parents[3]
STEPS, EVERY, LAYERS = 7, 3, 2  # sampled: 0, 3, 6; update ratios measured at 1, 4 and at close (7)
E, H, G, D = 32, 4, 2, 8  # d_model, query heads, key/value heads, head size (both models)
SAMPLED, AFTER = {0, 3, 6}, {1, 4, 7}
F32, F64 = 4, 8
# beside FSDP2 and under HSDP: gradient norms every 3 steps, everything else every 6 (step 3: gradients only)
SLOW = ("--cadence", json.dumps({"grads": 3, "spectra": 6, "updates": 6, "attention": 6}))
# attention sampled less often than the loss, so the closer look is on: after every step the detectors judged (SLOW:
# 0, 3, 6, and 1, which measures step 0's update ratios) rank 0's decision is broadcast, 2 int64
AGREE = ("c10d.broadcast_", 2 * 8)


def _run(mode: str, out: Path, ranks: int, *extra: str) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if ranks == 1:
        cmd = [sys.executable, str(WORKER), mode, str(out), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(WORKER), mode, str(out), *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{mode} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}


def _metrics(out: Path) -> dict[tuple[int, str], float | None]:
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["tag"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (step, tag) was written twice: more than one rank writes"
    return {(r["step"], r["tag"]): r["value"] for r in rows}


def _same(ref: dict, got: dict, skip: tuple[str, ...] = (), rtol: float = 1e-5) -> None:
    assert set(got) == set(ref), (sorted(set(ref) - set(got))[:5], sorted(set(got) - set(ref))[:5])
    bad = [(k, ref[k], got[k]) for k in ref if k[1] not in skip
           and not math.isclose(ref[k], got[k], rel_tol=rtol, abs_tol=1e-9)]
    assert not bad, f"{len(bad)} of {len(ref)} values differ, e.g. {bad[:5]}"


def _families(ref: dict) -> set[str]:
    return {tag.split("/")[0] for _, tag in ref}


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, mode, extra in (("llama", "single-llama", ()), ("titan", "single-titan", ()),
                              ("llama-limit", "single-llama", ("--step-limit", "0.01")),
                              ("titan-limit", "single-titan", ("--step-limit", "0.01", *SLOW))):
        out[name] = tmp_path_factory.mktemp(name)
        _run(mode, out[name], 1, *extra)
    return out


def _scalar_gather_bytes(ranks: int, heads_q: list[int], grads: list[int], every_family: bool = True) -> int:
    """The all-gather of per-head scalars at a sampled step: per rank one float64 buffer of the widest rank's width:
    a header, then per layer a refused flag and, per family, a flag and its values (``grads`` values: the gradient
    norms of its query and key/value heads, or beside FSDP2 the sums of squares of its rows for every head of
    its block; 4 spectral scalars and D singular values per query head it computes; 5 attention statistics (entropy,
    rank, max logit, sink share and its position) and the uniform entropy per head of its block, and the valid rows)."""
    block = H // 2

    def width(q: int, g: int) -> int:
        rest = (1 + 4 * q + q * D) + (1 + 6 * block + 1) if every_family else 0
        return 1 + LAYERS * (1 + (1 + g) + rest)

    return ranks * max(width(q, g) for q, g in zip(heads_q, grads)) * F64


def _update_reduces(stacks: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Per stack of (matrices, n) the all-reduce of W^T W (float64 n x n each) and of ||W||_F^2 (float64 each)."""
    out = []
    for count, n in stacks:
        out += [("c10d.allreduce_", count * n * n * F64), ("c10d.allreduce_", count * F64)]
    return out


def _check_heads(ranks: dict[int, dict], per_rank: int, samples: int = len(SAMPLED)) -> None:
    """Every head's spectra computed by exactly one rank, ``per_rank`` of them on each, in every layer."""
    for label in ("L00", "L01"):
        work = [ranks[r]["spectra"]["work"][label] for r in ranks]
        assert sorted(h for w in work for h in w) == list(range(H)), work
        assert all(len(w) == per_rank for w in work), work
    for r in ranks:  # what layer_spectra was given: per_rank heads of each layer at each sampled step
        calls = [n for call in ranks[r]["spectra"]["calls"] for n in call]
        assert calls == [per_rank] * LAYERS * samples, ranks[r]["spectra"]["calls"]
        assert ranks[r]["confirmed"] == {"0": "q,k", "1": "q,k"}  # each rank's q and k checked against its heads


def test_tensor_parallel_hugging_face_llama_is_monitored_exactly(singles, tmp_path):
    """Hugging Face LLaMA (GQA 4/2, SDPA), ColwiseParallel on q/k/v and gate/up, RowwiseParallel on o and down, on 2
    ranks: each rank's kernel computes 2 of the 4 heads, which the layout of its block says (not n_heads=4)."""
    ranks = _run("tp", tmp_path, 2)
    ref, got = _metrics(singles["llama"]), _metrics(tmp_path)
    assert {"qk_sigma1", "grad_norm_k", "grad_ratio_qk_v", "update_ratio_q", "update_ratio_o",
            "update_fro_v", "attn_entropy", "attn_rank", "attn_max_logit", "attn_entropy_uniform",
            "loss"} <= _families(ref)
    assert {(0, f"qk_sigma1/L01/H{h:02d}") for h in range(H)} <= set(got)  # global head numbers
    _same(ref, got)  # the loss too: both ranks train on the whole batch
    _same_histograms(singles["llama"], ranks)
    assert ranks[0]["blocks"]["L00"][:2] == [0, 2] and ranks[1]["blocks"]["L00"][:2] == [1, 2]
    assert "n_heads=2" in ranks[0]["blocks"]["L00"][2] and "n_kv_heads=1" in ranks[0]["blocks"]["L00"][2]
    _check_heads(ranks, H // 2)
    # every layer in one stack per shape: {W_Q, W_O^T} (H/2*D x E) and {W_K, W_V} (G/2*D x E), n = E both
    reduces = _update_reduces([(2 * LAYERS, E), (2 * LAYERS, E)])
    gather = ("c10d._allgather_base_", _scalar_gather_bytes(2, [2, 2], [2 + 2, 2 + 2]))
    for r in ranks:
        seen = {int(s): [tuple(c) for c in v] for s, v in ranks[r]["collectives"].items()}
        for step in range(STEPS + 1):
            want = reduces + [gather] if step in SAMPLED else reduces if step in AFTER else []
            assert seen[step] == want, (r, step, seen[step])
    # the update-ratio snapshot: each rank its own block (half of the whole Q/K/V/O)
    assert [ranks[r]["snapshot_bytes"] for r in ranks] == [LAYERS * (H + G + G + H) * D * E * F32 // 2] * 2


def test_torchtitan_plan_with_sequence_parallel_norms(singles, tmp_path):
    """torchtitan's llama3 plan: sequence-parallel norms, the attention's input gathered from sequence shards by
    PrepareModuleInput (a DTensor), W_O back to sequence shards; the same numbers as one process."""
    ranks = _run("tp-sp", tmp_path, 2)
    _same(_metrics(singles["titan"]), _metrics(tmp_path))
    _check_heads(ranks, H // 2)


def test_tensor_parallel_beside_fsdp2(singles, tmp_path):
    """TP=2 x FSDP2=2 on a ("dp", "tp") mesh, torchtitan's order (the plan, then fully_shard on dp), with
    SpectralStepLimit: each block's 2 query heads' spectra are shared out between its 2 dp ranks (one head each: no
    rank computes another's); FSDP2's rows of the block's weights gathered over dp, one layer at a time; gradient
    norms from each rank's own rows (per-head sums of squares in the scalar gather): no gradient is gathered, and
    a step that samples only gradients (step 3) issues the scalar gather alone."""
    ranks = _run("tp-fsdp", tmp_path, 4, "--step-limit", "0.01", *SLOW)
    ref, got = _metrics(singles["titan-limit"]), _metrics(tmp_path)
    assert {"step_limit_scale", "qk_sigma1", "update_ratio_o", "attn_entropy"} <= _families(ref)
    _same(ref, got, skip=("loss",))  # the loss: rank 0's half of the batch
    _same_histograms(singles["titan-limit"], ranks)
    _check_heads(ranks, 1, samples=2)  # spectra at steps 0 and 6
    block = {"wq": (H // 2 * D, E), "wk": (G // 2 * D, E), "wv": (G // 2 * D, E), "wo": (E, H // 2 * D)}
    # one layer's block of weights (or dW) over the 2 dp ranks: header + each tensor padded to ceil(rows / 2) rows
    dp_gather = ("c10d._allgather_base_", 2 * F32 * (1 + 4 + sum(-(-r // 2) * c for r, c in block.values())))
    layer = [dp_gather] + _update_reduces([(2, E), (2, E)])  # one layer per group: {W_Q, W_O^T}, {W_K, W_V}
    every = ("c10d._allgather_base_", _scalar_gather_bytes(4, [1] * 4, [2 + 2] * 4))
    grads_only = ("c10d._allgather_base_", _scalar_gather_bytes(4, [1] * 4, [2 + 2] * 4, every_family=False))
    want = {0: layer * LAYERS + [every, AGREE], 1: layer * LAYERS + [AGREE], 3: [grads_only, AGREE],
            6: layer * LAYERS + [every, AGREE], 7: layer * LAYERS}
    for r in ranks:
        seen = {int(s): [tuple(c) for c in v] for s, v in ranks[r]["collectives"].items()}
        for step in range(STEPS + 1):
            assert seen[step] == want.get(step, []), (r, step, seen[step])
    single_bytes = LAYERS * (H + G + G + H) * D * E * F32
    assert [ranks[r]["snapshot_bytes"] for r in ranks] == [single_bytes // 4] * 4  # own shards: 1/(dp * tp)
    _same_weights(singles["titan-limit"], ranks[0])


def test_hsdp(singles, tmp_path):
    """HSDP on a ("replicate", "shard") mesh with SpectralStepLimit: one all-gather per layer over the shard dim
    (not one full_tensor() per tensor), the same numbers as one process."""
    ranks = _run("hsdp", tmp_path, 4, "--step-limit", "0.01", *SLOW)
    _same(_metrics(singles["titan-limit"]), _metrics(tmp_path), skip=("loss",))
    for r in ranks:
        seen = {int(s): [tuple(c) for c in v] for s, v in ranks[r]["collectives"].items()}
        for step in range(STEPS + 1):
            agreed = [AGREE] if step in {0, 1, 3, 6} else []
            assert seen[step][len(seen[step]) - len(agreed):] == agreed, (r, step, seen[step])
            gathers = seen[step][:len(seen[step]) - len(agreed)]
            assert len(gathers) == (LAYERS if step in {0, 1, 3, 6, 7} else 0), (r, step, seen[step])
            assert all(name == "c10d._allgather_base_" for name, _ in gathers)
        assert seen[0][0][1] > seen[1][0][1] > seen[3][0][1]  # weights and gradients > dW > gradients
    assert [ranks[r]["snapshot_bytes"] for r in ranks] == [LAYERS * (H + G + G + H) * D * E * F32 // 2] * 4
    _same_weights(singles["titan-limit"], ranks[0])


def test_step_limit_under_tensor_parallelism_is_the_one_process_limit(singles, tmp_path):
    """SpectralStepLimit bounds sigma_1(dW) / sigma_1(W) of each whole matrix, as in one process: every rank's power
    iteration sums its block's products over the ranks sharing the rows (W_Q, W_K, W_V, gate, up: ColwiseParallel)
    or the columns (W_O, down: RowwiseParallel), from the same start vectors, and applies the same scale to its
    block. The logged scales and ratios and the trained weights equal one process's."""
    ranks = _run("tp", tmp_path, 2, "--step-limit", "0.01")
    ref, got = _metrics(singles["llama-limit"]), _metrics(tmp_path)
    limited = [k for k in ref if k[1].startswith("step_limit_scale/") and ref[k] < 1]
    row_split, col_split = {"L00/q", "L00/k", "L00/mlp.up_proj"}, {"L00/self_attn.o_proj", "L00/mlp.down_proj"}
    assert {t.split("/", 1)[1] for _, t in limited} >= row_split | col_split | {"lm_head"}  # lm_head: not split
    # six steps of float32 training, each limited by a power iteration summed over the ranks in another order:
    # on a 2-core machine the gradient norms at step 6 differ from one process's by up to 1.3e-5 relative
    _same(ref, got, rtol=5e-5)
    _same_weights(singles["llama-limit"], ranks[0])


# the closer look on: the loss, gradients and spectra every 2 steps, attention every 6; lines so loose that every head
# is inside the malignant state from its first sample, so the detectors ask for attention at every step while the
# state is settled (2 samples over 4 steps)
LOOK = ("--every", "0", "--steps", "9",
        "--cadence", json.dumps({"loss": 2, "grads": 2, "spectra": 2, "attention": 6, "updates": 6}),
        "--alerts", json.dumps({"sparse_entropy": 10.0, "low_rank_frac": 1.0, "collapse_persist": 2,
                                "collapse_dwell": 4}))


def _alerts(out: Path) -> list[tuple[int, str, str, str]]:
    rows = [json.loads(line) for line in (out / "logs" / "alerts.jsonl").read_text().splitlines()]
    return [(a["step"], a["kind"], a["level"], a["where"]) for a in rows]


def test_tensor_parallel_closer_look_samples_the_one_process_steps(tmp_path):
    """Rank 0's detectors decide the closer look and one broadcast after every judged step gives the decision to
    rank 1, so both ranks sample attention at the same steps, and every such sample gathers every rank's heads (a
    rank that sampled alone would wait for ever). Attention at every step from 0 until the layers' malignant state
    is established (step 4: steps 1 and 3 sample attention alone, between two loss samples), then at 6: as one
    process, with the same tags at the same steps, every value to rtol 1e-5 and the same alerts; the broadcast
    (16 bytes) inside every call that judged a step, none in the others."""
    single, tp = tmp_path / "single", tmp_path / "tp"
    single.mkdir()
    tp.mkdir()
    _run("single-llama", single, 1, *LOOK)
    ranks = _run("tp", tp, 2, *LOOK)
    ref, got = _metrics(single), _metrics(tp)
    _same(ref, got)
    assert {s for s, tag in got if tag.startswith("attn_entropy/")} == {0, 1, 2, 3, 4, 6}
    assert {s for s, tag in got if tag.startswith("qk_sigma1/")} == {0, 2, 4, 6, 8}
    alerts = _alerts(tp)
    assert alerts == _alerts(single) and (4, "malignant_collapse", "L00") in {(s, k, w) for s, k, _, w in alerts}
    judged = {0: 1, 1: 2, 2: 1, 3: 1, 4: 1, 6: 1, 7: 1, 8: 1}  # 1: step 0's update ratios, then its sample; 7: 6's
    for r in ranks:
        seen = {int(s): [tuple(c) for c in v] for s, v in ranks[r]["collectives"].items()}
        assert {s: v.count(AGREE) for s, v in seen.items() if AGREE in v} == judged, (r, seen)
        assert all(not v for s, v in seen.items() if s not in judged), (r, seen)


def _same_histograms(single: Path, ranks: dict[int, dict]) -> None:
    """Every rank's records hold the one process's per-head arrays (the histograms: every head's singular values,
    qk_spectrum, H x D per layer and step, and each per-head metric across heads): gathered on every rank from
    the ranks that computed them."""
    ref = json.loads((single / "rank0.json").read_text())["histograms"]
    spectra = {int(k.split("/")[0]) for k in ref if "qk_spectrum" in k}
    assert {k for k in ref if "qk_spectrum" in k} == {f"{s}/qk_spectrum/L0{i}" for s in spectra for i in (0, 1)}
    assert spectra in ({0, 3, 6}, {0, 6})
    assert all(len(v) == H * D for k, v in ref.items() if "qk_spectrum" in k)
    for r in ranks:
        got = ranks[r]["histograms"]
        assert set(got) == set(ref)
        for key, values in ref.items():
            assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(values, got[key])), (r, key)


def _same_weights(single: Path, rank0: dict) -> None:
    ref = json.loads((single / "rank0.json").read_text())["weights"]
    assert set(ref) == set(rank0["weights"])
    for name, values in ref.items():
        flat_ref, flat_got = _flat(values), _flat(rank0["weights"][name])
        scale = max(abs(v) for v in flat_ref)
        assert max(abs(a - b) for a, b in zip(flat_ref, flat_got)) <= 1e-5 * scale, name


def _flat(x) -> list[float]:
    return [v for item in x for v in (_flat(item) if isinstance(item, list) else [item])]


def test_a_layer_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    """Rank 1's kernel computes its two query heads of L00 in swapped order, so rank 1 refuses L00's layout; rank 0's
    own heads agree with it. The head gather tells rank 0, whose book refuses L00 too: rank 0 (the only writer) logs
    nothing of L00 from then on, update ratios included, and L01 as usual."""
    ranks = _run("tp", tmp_path, 2, "--swap-heads", "1")
    tags = {tag for _, tag in _metrics(tmp_path)}
    assert not [tag for tag in tags if "/L00" in tag], sorted(tag for tag in tags if "/L00" in tag)
    assert {"qk_sigma1/L01/H00", "update_ratio_q/L01", "attn_entropy/L01/H03"} <= tags
    assert list(ranks[1]["refused"]) == ["0"] and "n_heads=2" in ranks[1]["refused"]["0"]  # its own heads' layout
    assert list(ranks[0]["refused"]) == ["0"] and "another tensor-parallel rank" in ranks[0]["refused"]["0"]
