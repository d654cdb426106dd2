"""The runs closer to the ones people train: long contexts, many heads, grouped-query attention with rotary
positions, bf16 autocast, warmup + cosine, fine-tunes of models that start with attention sinks.

Every language model has 4 layers of 8 heads (d_head 16), width 128. Five kinds of run:

* **sink fine-tunes** (``RunSpec(task="finetune")``, :mod:`evaluation.finetune`): a byte-level GPT-2 and a LLaMA
  (grouped-query attention, rotary positions) that start with attention sinks, built in
  (:func:`evaluation.sinks.built`; sinks grown by training from scratch did not emerge at these sizes within
  3,000 steps),
  fine-tuned healthily on English prose: AdamW 3e-4, 30 warmup steps then cosine decay, clipping at 1, 300
  steps, the GPT-2 at context 1,024 (batch 2), the LLaMA at 512 (batch 4);
* **healthy runs from scratch** at context 512 or more: the demo's nanoGPT, Hugging Face GPT-2 (context 1,024,
  batch 2), LLaMA (grouped-query attention, rotary positions; under bf16 autocast on the CPU) and ModernBERT (a
  masked language model), each at a constant 1e-3 and under 50 warmup steps then cosine decay, 500 steps;
* **the nanoGPT collapse sweep** at context 128 (:mod:`evaluation.lm`: 4 layers of 2 heads, batch 16, 300
  steps, no warmup) at learning rates away from the boundary and at it, each with its QK-norm twin;
* **the LLaMA sweep** at context 512 (batch 4, 200 steps, no warmup) at high learning rates, each with its
  QK-norm twin (HF Qwen3: LLaMA with an RMSNorm on q and k per head);
* **the Eureka task** on two implementations (:func:`eureka`).

The fine-tunes and the healthy runs are recorded with the Monitor as users attach it (``Monitor(model)``: its
default cadence, ``every=0``), the sweeps at every step (the ground truth's attention and the replays at
coarser cadences).
"""

from __future__ import annotations

from dataclasses import replace

from evaluation.spec import RunSpec

__all__ = ["LLAMA_LRS", "LONG_STEPS", "SINKS", "demo_twin", "healthy_twins", "normsoftmax", "testbed"]

SHAPE = {"layers": 4, "heads": 8, "width": 128}
FINETUNE = {"lr": 3e-4, "steps": 300, "warmup": 30, "schedule": "cosine", "corpus": "pydoc", "every": 0}
SINKS = ("built",)  # the kinds of sink the fine-tunes start from
FINETUNE_CONTEXT = {"gpt2": (1024, 2), "llama": (512, 4)}  # (context, batch): 2,048 tokens a step
HEALTHY_STEPS, HEALTHY_WARMUP, HEALTHY_LR = 500, 50, 1e-3
HEALTHY = {  # family -> what its runs are given beside the shape
    "nanogpt": {"task": "lm", "context": 512, "batch": 4, "purpose": "healthy"},
    "gpt2": {"task": "hf", "model": "gpt2", "context": 1024, "batch": 2},
    "llama": {"task": "hf", "model": "llama", "context": 512, "batch": 4, "autocast": "bf16"},
    "modernbert": {"task": "hf", "model": "modernbert", "context": 512, "batch": 4},
}
LM_STEPS = 300
# the collapse sweep of the sets that judge collapse_damage on runs as long as people's first look at a run: long
# enough after a collapse at steps 40-300 that a loss slowing down by itself and one stopped by the collapse part
LONG_STEPS = 1500
LLAMA_STEPS = 200
# the README demo's healthy twin run longer (`python -m diag demo --warmup 100 --steps 1500`): the demo's learning
# rate, 100 warmup steps, every signal every 10 steps as the demo samples them
DEMO_LR, DEMO_WARMUP, DEMO_STEPS, DEMO_EVERY = 5e-3, 100, 1500, 10
# at 4 x 8 x 128 and context 512 no rate from 3e-3 to 1e-1 damaged the LLaMA against its twin within 200 steps
# (final losses within 2% of the twin's): the sweep checks that a high rate is not called a collapse
LLAMA_LRS = (3e-3, 1e-2, 3e-2)
EUREKA_LR, EUREKA_STEPS = 1e-3, 2000
HFVIT_LR, HFVIT_STEPS = 1.2e-3, 2500


def finetunes(seeds: range, sinks: tuple[str, ...]) -> list[RunSpec]:
    """Each family, each kind of sink (``"built"``), each seed."""
    out = []
    for sink in sinks:
        for model, (context, batch) in FINETUNE_CONTEXT.items():
            out += [RunSpec("finetune", s, model=model, sinks=sink, context=context, batch=batch, **FINETUNE)
                    for s in seeds]
    return out


def healthy(seeds: range) -> list[RunSpec]:
    """Each family, at a constant learning rate and under warmup + cosine decay, each seed."""
    out = []
    for kw in HEALTHY.values():
        kw = dict(kw)
        task = kw.pop("task")
        for s in seeds:
            out.append(RunSpec(task, s, HEALTHY_LR, HEALTHY_STEPS, every=0, **SHAPE, **kw))
            out.append(RunSpec(task, s, HEALTHY_LR, HEALTHY_STEPS, warmup=HEALTHY_WARMUP, schedule="cosine",
                               every=0, **SHAPE, **kw))
    return out


def lm_sweep(seeds: range, lrs: tuple[float, ...], steps: int = LM_STEPS) -> list[RunSpec]:
    """The nanoGPT at context 128 at each rate and seed, each with its QK-norm twin."""
    return [RunSpec("lm", s, lr, steps, twin=twin) for s in seeds for lr in lrs for twin in ("", "qknorm")]


def healthy_twins(seeds: range) -> list[RunSpec]:
    """The NormSoftmax twins of :func:`healthy`'s language models (every family is one): the causal test of a
    plateau alert on any of them (docs/evaluation.md#the-ground-truth)."""
    return [replace(s, twin="normsoftmax") for s in healthy(seeds)]


def demo_twin(seeds: range) -> list[RunSpec]:
    """The README demo's healthy twin at 1,500 steps (healthy: warmup at the demo's rate) and its NormSoftmax
    twin, each seed."""
    runs = [RunSpec("lm", s, DEMO_LR, DEMO_STEPS, warmup=DEMO_WARMUP, every=DEMO_EVERY, purpose="healthy")
            for s in seeds]
    return runs + [replace(r, twin="normsoftmax") for r in runs]


def llama_sweep(seeds: range, lrs: tuple[float, ...]) -> list[RunSpec]:
    """The LLaMA at context 512 at each rate and seed, each with its QK-norm twin."""
    return [RunSpec("hf", s, lr, LLAMA_STEPS, twin=twin, model="llama", context=512, batch=4, purpose="collapse",
                    **SHAPE) for s in seeds for lr in lrs for twin in ("", "qknorm")]


def eureka(seeds: range) -> list[RunSpec]:
    """The Eureka task on both implementations, each seed: :mod:`evaluation.eureka`'s ViT (three candidate cells,
    every step) and Hugging Face's ViT (:mod:`evaluation.eureka_hf`: two candidate cells, a plateau lower against
    the first loss, every 2nd step)."""
    return ([RunSpec("vit", s, EUREKA_LR, EUREKA_STEPS) for s in seeds]
            + [RunSpec("vit", s, HFVIT_LR, HFVIT_STEPS, model="hfvit", every=2) for s in seeds])


def normsoftmax(seeds: range) -> list[RunSpec]:
    """The NormSoftmax twins of :func:`eureka`'s runs of ``seeds``: the same task whose plateau NormSoftmax
    shortens, and which the alert must still flag."""
    return [replace(s, twin="normsoftmax") for s in eureka(seeds)]


def testbed(finetune_seeds: range, sinks: tuple[str, ...], healthy_seeds: range, lm_seeds: range,
            lm_lrs: tuple[float, ...], llama_seeds: range, llama_lrs: tuple[float, ...],
            eureka_seeds: range) -> list[RunSpec]:
    """A set of the test bed's runs: the sink fine-tunes, the healthy runs, the two collapse sweeps, the Eureka
    runs."""
    return (finetunes(finetune_seeds, sinks) + healthy(healthy_seeds) + lm_sweep(lm_seeds, lm_lrs)
            + llama_sweep(llama_seeds, llama_lrs) + eureka(eureka_seeds))
