"""What one sampled step of each signal family costs, from its FLOPs and bytes (docs/cost.md).

    .venv/bin/python benchmarks/cost_model.py              # this CPU (calibrated now) and an H200
    .venv/bin/python benchmarks/cost_model.py --no-calibrate
    .venv/bin/python benchmarks/cost_model.py --check         # FSDP2 bytes (2 and 4 gloo ranks) and FLOPs, measured

Per family and sampled step (L layers, width E, H query and G key/value heads of size
D, T tokens per sequence, n_s captured sequences, R = min(attn_rank_rows, T)):

* grads: row norms of the Q/K/V gradients, M_g = L E D (H + 2G) elements: memory-bound.
* spectra: float64 Grams of every Q and K head, 2 D^2 E (H + G) L flops, plus per head a
  Cholesky, L^T G_k L and a D x D eigvalsh (~ 15 D^3 flops at the small-eigensolver rate).
* updates: Q, K, V, O of every layer, M_u = L E D (2H + 2G) elements: a snapshot copy (under
  FSDP2 each rank keeps its own shards, M_u / ranks, and one layer whole at a time),
  the in-place subtraction (20 bytes per element) and block Krylov for sigma_1(W) and
  sigma_1(dW): blocks of 16 vectors, each 4 * 16 M_u flops at the skinny-product rate, plus a
  Rayleigh-Ritz eigvalsh of the growing 16j x 16j projection per matrix (4L matrices); warm
  ~2 + 4 blocks, cold ~9 + 9: the cold first sample is the growing Krylov dimension.
* attention: per captured sequence and layer, with F = min(T, entropy_rows) rows read in float64: their
  logits 2 H F T D, ~10 passes over their H F T probabilities; beyond entropy_rows the max logit over every row
  in float32 (causal: half the keys, H T^2 D flops and 3 passes over H T^2 / 2 float32) and the rank's R rows
  read again (2 H R T D, 10 passes over H R T); the rank's Gram 2 H R^2 T and H eigvalsh of R x R (~ 9 R^3, all
  layers' in one batched call).

Distributed (``ranks`` FSDP2 ranks, ``tp`` tensor-parallel ranks; the bytes a rank receives, over the
inter-node link for FSDP2 and over NVLink for tensor parallelism, plus a latency per collective):

* FSDP2 alone (hooks/parallel/owners.py): gradient norms from each rank's shards, per-head sums of squares in one
  float64 all-reduce; the spectra and update ratios of layer i on rank i % world from that layer's shards gathered
  to it alone (the busiest rank owns ceil(L / ranks) layers); attention: each rank reads the layers it owns, one
  all-reduce of 2 + 6H values per layer.
* tensor parallelism (x FSDP2): a rank holds H / tp query and G / tp key/value heads of every layer; the spectra
  and gradient norms of its block are shared out among the ``ranks`` FSDP2 ranks holding it (1 / (tp ranks) of
  the heads each), attention is its own block's (1 / tp); FSDP2's rows of the block's weights are all-gathered
  over its dim (1 / tp of the above); the gradient norms come from each rank's own rows (per-head sums of
  squares), no gradient is gathered; one all-gather of per-head float64 scalars per sampled step (per rank
  ~ L x (its heads x (4 + D) + (H + 2G) / tp + H / tp x 4) values); the update ratios run on the block
  (M_u / tp, the same work on each FSDP2 rank of the block) with all-reduces over the tensor-parallel group of
  each Krylov block (n x 16 float32 per matrix, n = E) and of each Gram / Frobenius sum.

The training step is 6 N tokens + 6 L B T^2 E flops (causal attention) at a stated
utilisation. The rates of this CPU are measured when the script starts (a float64 GEMM,
batched small eigensolvers, a skinny float32 product, a large copy); those of the H200 are
datasheet figures at stated efficiencies, not measurements (no accelerator was available).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from hooks.capture.capture import ENTROPY_ROWS
from hooks.monitor.cadence import DEFAULT_CADENCE

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int  # per sequence
    batch: int  # sequences per rank and optimizer step
    params: float
    ranks: int = 1  # FSDP2 (data-parallel) ranks
    tp: int = 1  # tensor-parallel ranks: each holds heads / tp of every layer; they train the same sequences


@dataclass(frozen=True)
class Rates:
    name: str
    f64_gemm: float  # flop/s
    f32_gemm: float  # flop/s of the skinny Krylov products
    eig: float  # flop/s-equivalent of batched small eigvalsh
    bandwidth: float  # bytes/s
    train: float  # flop/s of the training step (its utilisation folded in)
    gather: float = 0.0  # bytes/s received per rank in an FSDP2 all-gather (across nodes beyond 8 GPUs)
    nvlink: float = 0.0  # bytes/s of a collective inside a node (tensor parallelism)
    latency: float = 0.0  # seconds per collective


SHAPES = [
    Shape("4x256 GPT-2 (CPU)", 4, 256, 8, 8, 32, 128, 4, 4 * 12 * 256**2 + 2 * 8192 * 256),
    Shape("GPT-2-small (CPU)", 12, 768, 12, 12, 64, 128, 4, 85e6 + 8192 * 768),
    Shape("LLaMA 7B, 1 GPU", 32, 4096, 32, 8, 128, 4096, 1, 6.7e9),
    Shape("LLaMA 1B, FSDP2 x 8", 16, 2048, 32, 8, 64, 4096, 1, 1.24e9, ranks=8),
    Shape("LLaMA 1B, FSDP2 x 8, 8k", 16, 2048, 32, 8, 64, 8192, 1, 1.24e9, ranks=8),
    Shape("LLaMA 7B, FSDP2 x 8", 32, 4096, 32, 8, 128, 4096, 1, 6.7e9, ranks=8),
    Shape("LLaMA 7B, FSDP2 x 8, 8k", 32, 4096, 32, 8, 128, 8192, 1, 6.7e9, ranks=8),
    Shape("LLaMA 70B, FSDP2 x 64", 80, 8192, 64, 8, 128, 4096, 1, 70e9, ranks=64),
    # torchtitan's 70B layout: TP 8 inside a node, FSDP2 across 8 nodes; the same 64 sequences per step
    Shape("LLaMA 70B, TP 8 x FSDP2 8", 80, 8192, 64, 8, 128, 4096, 8, 70e9, ranks=8, tp=8),
    Shape("LLaMA 70B, TP 8 x FSDP2 8, 8k", 80, 8192, 64, 8, 128, 8192, 8, 70e9, ranks=8, tp=8),
]

# H200: FP64 tensor 67 TFLOP/s at 50%; FP32 67 TFLOP/s at 30% (skinny products); batched small
# eigensolvers ~1 TFLOP/s-equivalent (an assumption: cuSOLVER's batched Jacobi is far from peak);
# HBM 4.8 TB/s at 70%; training at 40% of 989 TFLOP/s bf16; all-gather 300 GB/s in a node
# (NVLink), 40 GB/s per GPU across nodes (400 Gb/s InfiniBand); 20 us per collective (an assumption:
# small NCCL collectives inside a node take 10-30 us, across nodes more).
H200 = Rates("H200 (datasheet)", 33e12, 20e12, 1e12, 3.4e12, 0.4 * 989e12, gather=300e9, nvlink=300e9,
             latency=20e-6)
H200_MULTINODE = Rates("H200 x 64 (datasheet)", 33e12, 20e12, 1e12, 3.4e12, 0.4 * 989e12, gather=40e9,
                       nvlink=300e9, latency=20e-6)


def _timed(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(train_step_s: dict[str, float]) -> Rates:
    """This CPU's rates, measured now (best of 3: the machine may be shared)."""
    a64 = torch.randn(512, 512, dtype=torch.float64)
    f64 = 2 * 512**3 / _timed(lambda: a64 @ a64)
    w, v = torch.randn(16, 768, 768), torch.randn(16, 768, BLOCK)
    f32 = 2 * 16 * 768 * 768 * BLOCK / _timed(lambda: w.mT @ (w @ v))
    g = torch.randn(24, 128, 128, dtype=torch.float64)
    g = g @ g.mT
    eig = 24 * 9 * 128**3 / _timed(lambda: torch.linalg.eigvalsh(g))
    big = torch.empty(32 * 2**20)
    bandwidth = 2 * big.numel() * 4 / _timed(lambda: big.clone())
    del train_step_s
    return Rates("this CPU (now)", f64, f32, eig, bandwidth, train=0.0)


def attention_seconds(H: int, T: int, D: int, R: int, entropy_rows: int | None, rates: Rates) -> float:
    """One captured sequence of one layer (H heads of its block)."""
    F = T if entropy_rows is None else min(T, entropy_rows)
    float64 = 2 * H * F * T * D / rates.f64_gemm + 10 * 8 * H * F * T / rates.bandwidth
    if F < T:  # the max logit over every row in float32 (causal: the keys up to each block), the rank's rows again
        float64 += (H * T * T * D / rates.f32_gemm + 3 * 4 * H * T * T / 2 / rates.bandwidth
                    + 2 * H * R * T * D / rates.f64_gemm + 10 * 8 * H * R * T / rates.bandwidth)
    return float64 + 2 * H * R * R * T / rates.f64_gemm + 9 * H * R**3 / rates.eig


def family_costs(s: Shape, rates: Rates, seqs: int = 2, rank_rows: int = 256, cold: bool = False,
                 entropy_rows: int | None = ENTROPY_ROWS, attention_shared: bool = True) -> dict:
    """Per family and sampled step, on one rank: (seconds, peak extra bytes held, bytes received). The capture reads
    the first ``seqs`` sequences of a rank's batch: ``min(seqs, batch)``."""
    L, E, H, G, D, T = s.layers, s.width, s.heads, s.kv_heads, s.head_dim, s.tokens
    seqs = min(seqs, s.batch)
    R = min(rank_rows, T)
    t, d = s.tp, s.ranks
    m_g, m_u = L * E * D * (H + 2 * G), L * E * D * (2 * H + 2 * G)
    krylov = (9, 9) if cold else (2, 4)  # blocks for sigma_1(W) and sigma_1(dW)
    link = rates.gather or float("inf")
    attention = attention_seconds(H // t, T, D, R, entropy_rows, rates)  # one captured sequence of one layer
    if t == 1 and d > 1:  # FSDP2 alone: the owner path
        return _fsdp_alone(s, rates, seqs, attention if attention_shared else None, krylov, cold)
    share = 1 / (t * d) if t > 1 else 1.0  # heads whose spectra / gradient norms this rank computes
    n_mats = 4 * L
    ritz = sum(n_mats * 9 * (BLOCK * j) ** 3 for k in krylov for j in range(1, k + 1))  # Rayleigh-Ritz eigh
    m_block = m_u / t  # the update ratios' matrices this rank works on (its block; every FSDP2 rank of it)
    gathered = (d - 1) / d if d > 1 else 0.0  # of an FSDP2-gathered tensor, the part that comes from others
    # FSDP2 beside tensor parallelism gathers its dim of the block's weights; the gradient norms come from own rows
    weights_in = 4 * m_u / t * gathered
    out = {
        "grads": (m_g * 4 * share / rates.bandwidth, 0, 0.0),
        "spectra": (_spectra_seconds(s, rates) * share + weights_in / link + L * rates.latency * (d > 1),
                    (H + G) * D * D * 8 * L * share, weights_in),
        "updates": (20 * m_block / rates.bandwidth + sum(krylov) * 4 * BLOCK * m_block / rates.f32_gemm
                    + ritz / rates.eig + weights_in / link,
                    4 * m_u / (t * d) + (4 * m_u / (L * t) if d > 1 else 0),  # own shards + 1 layer's block
                    weights_in),
        "attention": (seqs * L * attention, H / t * R * T * 8 + seqs * L * H / t * R * R * 8 + 32 * 2**20, 0),
    }
    if t > 1:
        out["updates"] = _plus(out["updates"], _tp_reduces(s, rates, krylov))
        out["grads"] = _plus(out["grads"], _scalar_gather(s, rates))  # the gather of the step's per-head scalars
    return out


def _spectra_seconds(s: Shape, rates: Rates) -> float:
    """Spectra of every head of every layer on one rank: the float64 Grams, the conversions, the eigensolvers."""
    L, E, H, G, D = s.layers, s.width, s.heads, s.kv_heads, s.head_dim
    return (2 * D * D * E * (H + G) * L / rates.f64_gemm + 12 * L * E * D * (H + G) / rates.bandwidth
            + 15 * D**3 * H * L / rates.eig)


def _all_reduce(values: float, s: Shape, rates: Rates) -> tuple[float, float]:
    """(seconds, bytes of its buffer) of one float64 all-reduce over the FSDP2 ranks (a ring moves twice the
    buffer's (ranks - 1) / ranks)."""
    size = 8 * values
    return 2 * (s.ranks - 1) / s.ranks * size / (rates.gather or float("inf")) + rates.latency, size


def attention_fields(s: Shape) -> int:
    """Float64 values per layer of the attention all-reduce under FSDP2 alone (``hooks.parallel.owners``): entropy,
    rank, max logit, uniform entropy, sink share and its position per head; the rows and a measured flag."""
    return 6 * s.heads + 2


def _fsdp_alone(s: Shape, rates: Rates, seqs: int, attention: float | None, krylov: tuple[int, int],
                cold: bool) -> dict:
    """FSDP2 alone (hooks/parallel/owners.py): gradient norms from each rank's shards (per-head sums of squares in
    the sample's all-reduce), spectra and update ratios of layer i on rank i % world from that layer's shards
    gathered to it alone; attention: each rank reads the layers it owns (``attention`` None: every layer, as
    one process)."""
    L, E, H, G, D = s.layers, s.width, s.heads, s.kv_heads, s.head_dim
    d = s.ranks
    owned = -(-L // d)  # layers of the busiest owner
    link = rates.gather or float("inf")
    qkv, qkvo = 4 * E * D * (H + 2 * G), 4 * E * D * (2 * H + 2 * G)  # bytes of one layer's weights, float32
    frac = owned / L
    grad_t, grad_in = _all_reduce(L * (1 + H + 2 * G), s, rates)
    spec_t, spec_in = _all_reduce(L * H * (4 + D) + 1, s, rates)
    ratio_t, ratio_in = _all_reduce(L * 8, s, rates)
    gathered = (d - 1) / d
    m_owned = L * E * D * (2 * H + 2 * G) * frac
    ritz = sum(4 * owned * 9 * (BLOCK * j) ** 3 for k in krylov for j in range(1, k + 1))
    updates_in = 2 * qkvo * owned * gathered  # W at the snapshot, dW when measured
    out = {
        "grads": (4 * L * E * D * (H + 2 * G) / d / rates.bandwidth + grad_t, 0, grad_in),
        "spectra": (_spectra_seconds(s, rates) * frac + qkv * owned * gathered / link + owned * rates.latency
                    + spec_t, (H + G) * D * D * 8 * owned, qkv * owned * gathered + spec_in),
        "updates": (20 * m_owned / rates.bandwidth + sum(krylov) * 4 * BLOCK * m_owned / rates.f32_gemm
                    + ritz / rates.eig + updates_in / link + 2 * owned * rates.latency + ratio_t,
                    4 * L * E * D * (2 * H + 2 * G) / d + qkvo, updates_in + ratio_in),
    }
    R = min(256, s.tokens)
    held = H * R * s.tokens * 8 + 32 * 2**20
    if attention is None:
        out["attention"] = (seqs * L * attention_seconds(H, s.tokens, D, R, ENTROPY_ROWS, rates),
                            held + seqs * L * H * R * R * 8, 0.0)
    else:
        att_t, att_in = _all_reduce(L * attention_fields(s), s, rates)
        out["attention"] = (seqs * owned * attention + att_t, held + seqs * owned * H * R * R * 8, att_in)
    del cold
    return out


def _plus(a: tuple, b: tuple) -> tuple:
    return a[0] + b[0], a[1], a[2] + b[2]


def _scalar_gather(s: Shape, rates: Rates) -> tuple[float, int, float]:
    """One all-gather of every rank's per-head float64 scalars: its share of the heads (grad norms of Q, K, V;
    4 spectral scalars and D singular values) and its block's attention statistics, per layer."""
    world = s.tp * s.ranks
    heads = max(1, -(-s.heads // world))
    width = s.layers * (6 + (s.heads + 2 * s.kv_heads) // s.tp + (4 + s.head_dim) * heads + 4 * s.heads // s.tp + 1)
    received = 8 * width * (world - 1)
    return received / rates.gather + rates.latency, 0, received


def _tp_reduces(s: Shape, rates: Rates, krylov: tuple[int, int]) -> tuple[float, int, float]:
    """The update ratios' all-reduces over the tensor-parallel group: per matrix and Krylov block, n x 16 float32
    (n = E; twice the bytes for a ring all-reduce), one collective per stack and block (a stack of up to 32 MiB:
    one W_Q or W_O^T block at 70B, several W_K / W_V blocks), plus the Frobenius sums."""
    L, E, D = s.layers, s.width, s.head_dim
    sizes = [s.heads // s.tp * D * E * 4] * 2 + [s.kv_heads // s.tp * D * E * 4] * 2  # W_Q, W_O^T, W_K, W_V
    stacks = L * sum(1 / max(1, (32 * 2**20) // size) for size in sizes)
    blocks = sum(krylov)
    moved = 2 * (s.tp - 1) / s.tp * 4 * L * 4 * E * BLOCK * blocks
    return moved / rates.nvlink + stacks * (blocks + 2) * rates.latency, 0, moved


def written_bytes(s: Shape, sample: str, attention_shared: bool = True) -> int:
    """Bytes the collectives of one sample write on the busiest rank under FSDP2 alone (its own part included; an
    all-reduce counted once, as its buffer): what ``tests/hooks/parallel/test_distributed.py`` measures. ``sample``:
    ``grads`` (loss and gradient norms), ``spectra``, ``all`` (every family: the update snapshot's W_O too, and the
    attention all-reduce) or ``ratios`` (the update ratios' measurement). The layer's weights are sent to the owner
    as each rank's shard of a fused Q/K/V weight ((H + 2G) D rows) and of W_O (E rows), padded to
    ``ceil(rows / ranks)`` rows, behind a header of 1 + one value per weight (``hooks.parallel.gather.gather_to``)."""
    L, E, H, G, D, d = s.layers, s.width, s.heads, s.kv_heads, s.head_dim, s.ranks
    owned = -(-L // d)
    shapes = [((H + 2 * G) * D, E)] + ([(E, H * D)] if sample in ("all", "ratios") else [])
    packed = 1 + len(shapes) + sum(-(-rows // d) * cols for rows, cols in shapes)
    gathered = 0 if sample == "grads" else owned * d * packed * 4
    grads = L * (1 + H + 2 * G) if sample in ("grads", "all") else 0
    spectra = L * H * (4 + D) + 1 if sample in ("spectra", "all") else 0
    ratios = L * 8 if sample == "ratios" else 0
    attention = L * attention_fields(s) if sample == "all" and attention_shared else 0
    return gathered + 8 * (grads + spectra + ratios) + (8 * attention if attention else 0)


def check(layers_heads_width: list[tuple[int, int, int]], worlds: tuple[int, ...] = (2, 4)) -> list[tuple]:
    """The FSDP2 bytes per sample measured at small sizes (gloo ranks on this CPU, the test worker's nanoGPT)
    against :func:`written_bytes`: rows (shape, ranks, sample, measured, modelled)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    worker = root / "tests" / "hooks" / "parallel" / "dist_worker.py"
    cadence = '{"loss": 1, "grads": 2, "spectra": 3, "attention": 6, "updates": 6}'
    steps = {"grads": 2, "spectra": 3, "all": 0, "ratios": 1}
    rows = []
    for layers, heads, width in layers_heads_width:
        for world in worlds:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                       str(worker), "fsdp", out, "--batch", str(2 * world), "--layers", str(layers), "--heads",
                       str(heads), "--n-embd", str(width), "--every", "0", "--cadence", cadence]
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
                subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True, timeout=600)
                per_rank = [json.loads((Path(out) / f"collectives_rank{r}.json").read_text()) for r in range(world)]
            shape = Shape(f"nanoGPT {layers} x {heads} x {width}", layers, width, heads, heads, width // heads, 16,
                          2, 0.0, ranks=world)
            for sample, step in steps.items():
                measured = max(sum(c[2] for c in calls[str(step)]) for calls in per_rank)
                rows.append((shape.name, world, sample, measured, written_bytes(shape, sample)))
    return rows


def matmul_flops(s: Shape, family: str, seqs: int = 2, rank_rows: int = 256,
                 entropy_rows: int | None = ENTROPY_ROWS, krylov: tuple[int, int] = (2, 4)) -> float:
    """The matrix-product FLOPs of one sample of ``family`` in one process (what ``FlopCounterMode`` counts):
    spectra: the Grams of every Q and K head and the two D x D products of its core per query head; attention: per
    captured sequence and layer the logits of the rows read in float64, the rank's Gram, and beyond
    ``entropy_rows`` the float32 max-logit pass (causal: half the keys) and the rank's rows again; updates: the
    block Krylov products for sigma_1(W) and sigma_1(dW)."""
    L, E, H, G, D, T = s.layers, s.width, s.heads, s.kv_heads, s.head_dim, s.tokens
    R = min(rank_rows, T)
    F = T if entropy_rows is None else min(T, entropy_rows)
    if family == "spectra":
        return 2 * D * D * E * (H + G) * L + 4 * D**3 * H * L
    if family == "attention":
        per = 2 * H * F * T * D + 2 * H * R * R * T + ((H * T * T * D + 2 * H * R * T * D) if F < T else 0)
        return min(seqs, s.batch) * L * per
    if family == "updates":
        return sum(krylov) * 4 * BLOCK * L * E * D * (2 * H + 2 * G)
    raise ValueError(family)


def flop_check(layers: int = 4, heads: int = 8, width: int = 256, tokens: int = 128) -> list[tuple]:
    """Matrix-product FLOPs per sample of each family counted with ``FlopCounterMode`` on a GPT-2 in this process
    (the sampled step's forward, backward and ``monitor.step`` less the same forward and backward unwatched)
    against :func:`matmul_flops`: rows (family, measured, modelled)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import GPT2Config, GPT2LMHeadModel

    from diag.outputs.sinks import MemorySink
    from hooks import Monitor

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=512, n_positions=tokens)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    ids = torch.randint(0, 512, (4, tokens), generator=torch.Generator().manual_seed(0))
    shape = Shape("GPT-2", layers, width, heads, heads, width // heads, tokens, 4, 0.0)
    with FlopCounterMode(display=False) as plain:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    rows = []
    for family in ("spectra", "attention", "updates"):
        monitor = Monitor(model, every=1, signals=(family,), sinks=[MemorySink()], closer_look=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # updates to measure (no matrix product of its own)
        for step in range(4):  # the first samples confirm the layouts and warm the Krylov spaces
            model(input_ids=ids, labels=ids).loss.backward()
            monitor.step(step)
            opt.step()
            model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as watched:
            model(input_ids=ids, labels=ids).loss.backward()
            monitor.step(4)
            opt.step()
        monitor.close()
        model.zero_grad(set_to_none=True)
        rows.append((family, watched.get_total_flops() - plain.get_total_flops(), matmul_flops(shape, family)))
    return rows


def step_seconds(s: Shape, rates: Rates) -> float:
    tokens = s.tokens * s.batch  # per data-parallel rank; its tensor-parallel ranks share the work
    return (6 * s.params * tokens + 6 * s.layers * s.batch * s.tokens**2 * s.width) / rates.train / s.tp


def cadence(costs: dict[str, float], budget: float = 0.01) -> dict[str, int]:
    """Periods that keep the families together under ``budget`` of a step: the gradient norms and then
    the spectra every 10 steps while the two fit in 60% of the budget (as the default does), the other
    families on one common period of 100, 200, 500, 1000, ..."""
    periods = {"grads": 10 if costs["grads"] / 10 <= budget / 2 else 100}
    fast = costs["grads"] / periods["grads"]
    if fast + costs["spectra"] / 10 <= 0.6 * budget:
        periods["spectra"] = 10
        fast += costs["spectra"] / 10
    rest = budget - fast
    heavy = sum(v for k, v in costs.items() if k not in periods)
    candidates = (100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
    period = next((p for p in candidates if heavy / p <= rest), candidates[-1])
    periods.update({k: period for k in costs if k not in periods})
    return periods


PERIODS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def alone(fraction: float, budget: float = 0.01) -> int:
    """The shortest period (1, 2, 5, 10, 20, ...) at which one family alone stays under ``budget`` of training."""
    return next((p for p in PERIODS if fraction / p <= budget), PERIODS[-1])


def report(shapes: list[Shape], rates_for, safety: float) -> None:
    for s in shapes:
        rates, step = rates_for(s)
        warm = family_costs(s, rates)
        cold = family_costs(s, rates, cold=True)["updates"][0]
        fractions = {k: t / step for k, (t, _, _) in warm.items()}
        periods = cadence({k: f * safety for k, f in fractions.items()})
        total = sum(f / periods[k] for k, f in fractions.items())
        layout = f"TP {s.tp} x FSDP2 {s.ranks}" if s.tp > 1 else f"FSDP2 {s.ranks}" if s.ranks > 1 else "1 rank"
        print(f"\n{s.name}: step {step * 1e3:.0f} ms on {rates.name}; L {s.layers}, E {s.width}, "
              f"H {s.heads}/G {s.kv_heads}, D {s.head_dim}, {s.batch} x {s.tokens} tokens per data-parallel rank, "
              f"{layout}; per rank:")
        for k, (t, mem, moved) in warm.items():
            print(f"  {k:>9}: {t * 1e3:9.1f} ms = {fractions[k] * 100:7.2f}% of a step, holds {mem / 2**20:7.0f} MiB, "
                  f"receives {moved / 2**20:8.1f} MiB; every {periods[k]} -> {fractions[k] / periods[k] * 100:.3f}%; "
                  f"alone under 1% (x{safety:g}) from every {alone(fractions[k] * safety)}")
        default = {k: v for k, v in DEFAULT_CADENCE.items() if k != "loss"}
        at_default = sum(f / default[k] for k, f in fractions.items())
        print(f"  at the default cadence {default}: {at_default * 100:.2f}% modelled, "
              f"{at_default * safety * 100:.2f}% with x{safety:g}")
        print(f"  updates cold (first sample): {cold * 1e3:.1f} ms = {cold / step * 100:.2f}% of a step once")
        print(f"  at that cadence: {total * 100:.2f}% of training time as modelled, {total * safety * 100:.2f}% "
              f"with the safety factor {safety} (the cadence is chosen so that this stays under 1%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-calibrate", action="store_true", help="use the idle rates of 2026-11-29")
    parser.add_argument("--cpu-steps", type=float, nargs=2, default=[0.45, 2.05], metavar=("S_4x256", "S_SMALL"),
                        help="measured training step seconds of the two CPU shapes (benchmarks/overhead.py)")
    parser.add_argument("--safety", type=float, default=2.0,
                        help="modelled costs are multiplied by this when the cadence is chosen (measured on "
                             "GPT-2-small: the model is 1.2-1.7x under the measured heavy families)")
    parser.add_argument("--check", action="store_true",
                        help="measure the FSDP2 bytes per sample on 2 and 4 gloo ranks of this CPU (small nanoGPTs) "
                             "and print them beside the model's")
    args = parser.parse_args()
    if args.check:
        worst = 0.0
        print("FSDP2 alone, bytes written on the busiest rank per sample (own part included; all-reduce: its buffer):")
        for name, world, sample, measured, modelled in check([(4, 4, 32), (8, 8, 128)]):
            worst = max(worst, abs(modelled / measured - 1))
            print(f"  {name}, {world} ranks, {sample:>7}: measured {measured:>9,}, modelled {modelled:>9,} "
                  f"({modelled / measured:.3f})")
        print(f"largest relative difference: {worst * 100:.1f}%")
        print("matrix-product FLOPs per sample, one process (GPT-2 4 x 8 x 256, batch 4 x 128; FlopCounterMode):")
        for family, measured, modelled in flop_check():
            print(f"  {family:>9}: measured {measured / 1e6:9.1f} MFLOP, modelled {modelled / 1e6:9.1f} MFLOP "
                  f"({modelled / measured:.3f})")
        return
    torch.set_num_threads(1)
    if args.no_calibrate:
        cpu = Rates("this CPU (idle, 2026-11-29)", 78e9, 150e9, 40e9, 15e9, train=0.0)
    else:
        cpu = calibrate({})
    print(f"{cpu.name}: float64 GEMM {cpu.f64_gemm / 1e9:.0f} GFLOP/s, skinny float32 {cpu.f32_gemm / 1e9:.0f} "
          f"GFLOP/s, small eigvalsh {cpu.eig / 1e9:.0f} GFLOP/s-eq., copy {cpu.bandwidth / 1e9:.1f} GB/s")
    cpu_steps = dict(zip([SHAPES[0].name, SHAPES[1].name], args.cpu_steps))

    def rates_for(s: Shape) -> tuple[Rates, float]:
        if s.name in cpu_steps:
            return cpu, cpu_steps[s.name]
        rates = H200_MULTINODE if s.ranks * s.tp > 8 else H200
        return rates, step_seconds(s, rates)

    report(SHAPES, rates_for, args.safety)


if __name__ == "__main__":
    main()
