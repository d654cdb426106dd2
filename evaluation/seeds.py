"""Which runs design the alerts, which tune their thresholds, which report them: fixed before any is recorded.

A run belongs to exactly one set and counts once, whatever the cadences it is replayed at.

* **design**: the runs looked at to choose the features of ``collapse_risk``, to fit its coefficients
  (:mod:`evaluation.risk`) and to design the plateau's tests;
* **tuning**: the runs on which the thresholds are chosen (the plateau's lines, the isotonic map of
  ``collapse_risk``), with the features and coefficients frozen;
* **report** to **report11**: each recorded after the detectors and thresholds it reports were frozen, and
  looked at once, whole: the docs' tables come from these alone. A report set that has been looked at is
  consulted from then on, as the tuning runs are, when a detector or a threshold is chosen again, and that
  choice is reported on a set with fresh seeds. They include settings no design or tuning run has: another
  width and depth of the GPT, another corpus (English prose), the ViT of the Eureka task at collapse learning
  rates, and rounding replicas (the same seed with two torch threads: another reduction order) at the boundary
  learning rate.

Healthy families (Hugging Face GPT-2, LLaMA with grouped-query attention, a BERT-style masked language model,
a ViT classifier) run under a constant learning rate and under warmup + cosine decay; the plateau's thresholds
are chosen on the design set's runs of them (the tuning set has none), and the choice is shown leaving each
family out (:func:`evaluation.tune.tune_one`).

The test bed closer to users' runs (:mod:`evaluation.testbed`: contexts of 512 and 1,024, 8 heads, grouped-query
attention with rotary positions, bf16 autocast, fine-tunes of models that start with attention sinks) has its
own sets: **design-users** (seeds 20-22), the runs its kinds were developed on, and the held-out **users** (seeds
300-302), **users2** (seeds 310-312) and **users3** (seeds 320-322), each frozen (:mod:`evaluation.freeze`)
before any of its runs was recorded.
"""

from __future__ import annotations

from evaluation import testbed
from evaluation.spec import RunSpec

__all__ = ["SETS", "runs_of", "set_of"]

DESIGN_SEEDS = range(0, 6)
TUNING_SEEDS = range(10, 16)
LM_LRS = (2e-3, 3e-3, 5e-3, 7e-3, 1e-2)  # no warmup; 5e-3 is the boundary: about half the runs collapse
BOUNDARY_LR = 5e-3
LM_STEPS = 300
EUREKA_STEPS = 2000
HF_STEPS = 1000
HF_FAMILIES = ("gpt2", "llama", "bert", "vit")  # the healthy families of the design set and report sets 1-5
# ModernBERT as the healthy masked language model (report6 to report11): BERT itself, at this size, on bytes, stays
# at the corpus's context-free loss for about 2,000 steps (report5's runs and a 4,000-step run:
# docs/alerts.md#masked-language-models-a-plateau-at-the-context-free-loss), so it is no healthy run; ModernBERT,
# with rotary positions, leaves that loss within 150 steps
HF_FAMILIES6 = ("gpt2", "llama", "modernbert", "vit")
HF_LMS = ("gpt2", "llama", "bert", "modernbert")  # the language models: a plateau's causal test is a NormSoftmax twin


def _lm(seed: int, lr: float, **kw) -> RunSpec:
    return RunSpec("lm", seed, lr, LM_STEPS, **kw)


def _eureka(seed: int, **kw) -> RunSpec:
    return RunSpec("vit", seed, 1e-3, EUREKA_STEPS, **kw)


def _hf(model: str, seed: int, schedule: str, **kw) -> list[RunSpec]:
    warmup = 100 if schedule == "cosine" else 0
    # every family every 10 steps, from which the default cadence (10, 20, 50, 100) and the closer look the
    # detectors ask for are replayed; the design set's at the Monitor's default cadence (every=0), replayed as
    # recorded
    every = 0 if seed in DESIGN_SEEDS else 10
    return [RunSpec("hf", seed, 1e-3, HF_STEPS, warmup=warmup, schedule=schedule, model=model, every=every, **kw)]


def _common(seeds: range, hf_seed: int | None, eureka_seeds: range, normsoftmax_seeds: range) -> list[RunSpec]:
    out = [_lm(s, lr) for s in seeds for lr in LM_LRS]
    out += [_lm(s, BOUNDARY_LR, warmup=100) for s in seeds[:2]]  # the healthy twin of the demo
    out += [_lm(s, BOUNDARY_LR, twin="qknorm") for s in seeds[:2]]
    out += [_eureka(s) for s in eureka_seeds]
    out += [_eureka(s, twin="normsoftmax") for s in normsoftmax_seeds]
    if hf_seed is not None:
        for model in HF_FAMILIES:
            for schedule in ("constant", "cosine"):
                out += _hf(model, hf_seed, schedule)
                if model in HF_LMS:
                    out += _hf(model, hf_seed, schedule, twin="normsoftmax")
    return out


def _report(seeds: range, away: int = 5, twins: int = 2, other: int = 2, vit: int = 2, boundary_twins: int = 0,
            eureka: int = 10, normsoftmax: int = 2, hf_seeds: int = 2, hf_twins: bool = True,
            families: tuple[str, ...] = HF_FAMILIES6) -> list[RunSpec]:
    """A report set: every seed at the boundary with a rounding replica; ``away`` seeds on both sides of it,
    ``twins`` with their QK-norm twins, ``other`` at another width and depth and another corpus, ``vit`` of the
    collapse ViT (``boundary_twins`` more QK-norm twins at the boundary); ``eureka`` Eureka seeds,
    ``normsoftmax`` NormSoftmax twins of them, the healthy families (``hf_seeds`` seeds) and, with ``hf_twins``,
    their twins (of ``families``)."""
    out = [_lm(s, BOUNDARY_LR) for s in seeds]  # the runs at the boundary ...
    out += [_lm(s, BOUNDARY_LR, threads=2) for s in seeds]  # ... each with a rounding replica
    out += [_lm(s, lr) for s in seeds[:away] for lr in LM_LRS if lr != BOUNDARY_LR]  # both sides of the boundary
    out += [_lm(s, lr, twin="qknorm") for s in seeds[:twins] for lr in LM_LRS]  # the damage test's twins
    out += [_lm(s, BOUNDARY_LR, twin="qknorm") for s in seeds[twins:twins + boundary_twins]]
    out += [_lm(s, BOUNDARY_LR, warmup=100) for s in seeds[:2]]
    # settings never used in design or tuning
    out += [_lm(s, lr, layers=6, heads=4, width=128) for s in seeds[:other] for lr in (5e-3, 1e-2)]
    out += [_lm(s, lr, corpus="pydoc") for s in seeds[:other] for lr in (5e-3, 1e-2)]
    out += [RunSpec("vit", s, lr, 400) for s in seeds[:vit] for lr in (3e-3, 1e-2, 3e-2)]
    out += [_eureka(s) for s in seeds[:eureka]]
    out += [_eureka(s, twin="normsoftmax") for s in seeds[:normsoftmax]]
    for model in families:
        for seed in seeds[:hf_seeds]:
            for schedule in ("constant", "cosine"):
                out += _hf(model, seed, schedule)
    # the NormSoftmax twins of the language models: the causal test of a plateau alert (recorded last)
    out += [t for model in families if model in HF_LMS for seed in seeds[:hf_seeds]
            for schedule in ("constant", "cosine") for t in _hf(model, seed, schedule, twin="normsoftmax") if hf_twins]
    return out


SETS: dict[str, list[RunSpec]] = {
    "design": _common(DESIGN_SEEDS, 0, range(0, 6), range(0, 3)),
    "tuning": _common(TUNING_SEEDS, None, range(10, 16), range(10, 13)),
    # QK-norm twins at the boundary too
    "report": _report(range(100, 120), twins=3, other=3, vit=4, boundary_twins=2, eureka=8, normsoftmax=3,
                      families=HF_FAMILIES),
    # every part of the first, smaller: about 80 minutes on 2 cores
    "report2": _report(range(120, 130), away=4, eureka=8, normsoftmax=3, families=HF_FAMILIES),
    # the collapse parts, the healthy families once under both schedules (no warning or critical alert may reach
    # them), 4 Eureka seeds, no NormSoftmax twins: about an hour on 2 cores
    "report3": _report(range(130, 140), away=4, eureka=4, normsoftmax=0, hf_seeds=1, hf_twins=False,
                       families=HF_FAMILIES),
    # 2 seeds of each healthy family with the language models' NormSoftmax twins (the causal verdict on any
    # plateau alert), and NormSoftmax twins of 2 of the 4 Eureka seeds
    "report4": _report(range(140, 150), away=4, eureka=4, families=HF_FAMILIES),
    # a fifth seed on both sides of the boundary: about 20 collapses away from it, so one miss is 95%
    "report5": _report(range(150, 160), eureka=4, families=HF_FAMILIES),
    # ModernBERT as the healthy masked language model (HF_FAMILIES6)
    "report6": _report(range(160, 170), eureka=4),
    # 8 Eureka seeds: a moment more than 2 intervals off is then 2.5% of the set's moments, not 5%
    "report7": _report(range(170, 180), eureka=8),
    # 10 Eureka seeds
    **{f"report{n}": _report(range(100 + 10 * n, 110 + 10 * n)) for n in range(8, 12)},
    # the test bed's kinds, a few of each: 2 seeds of the fine-tunes, 1 of the healthy families, the nanoGPT sweep
    # at every rate and the LLaMA sweep at its three, each with its twin, 2 Eureka seeds on each implementation
    "design-users": testbed.testbed(finetune_seeds=range(20, 22), sinks=testbed.SINKS, healthy_seeds=range(20, 21),
                                    lm_seeds=range(20, 21), lm_lrs=LM_LRS, llama_seeds=range(21, 22),
                                    llama_lrs=testbed.LLAMA_LRS, eureka_seeds=range(20, 22)),
    # held out, sized to be recorded in under two hours on 2 cores: the sink fine-tunes (2 families x 3 seeds), the
    # 16 healthy runs (4 families x 2 schedules x 2 seeds), the nanoGPT sweep with twins on both sides of its
    # boundary (1 seed) and at it (2), the LLaMA sweep at its two highest rates with twins, 2 Eureka seeds on each
    # implementation and a NormSoftmax twin of one on each
    "users": testbed.testbed(finetune_seeds=range(300, 303), sinks=testbed.SINKS, healthy_seeds=range(300, 302),
                             lm_seeds=range(300, 301), lm_lrs=(2e-3, 7e-3, 1e-2), llama_seeds=range(300, 301),
                             llama_lrs=testbed.LLAMA_LRS[1:], eureka_seeds=range(300, 302))
    + testbed.lm_sweep(range(300, 302), (BOUNDARY_LR,)) + testbed.normsoftmax(range(300, 301)),
    # held out after users (a sink is one shared position holding half the mass, whatever the rank of the rest):
    # sink fine-tunes (2 families x 3 seeds), the nanoGPT sweep on both sides of its boundary with twins (2 seeds),
    # one Eureka seed on each implementation
    "users2": testbed.finetunes(range(310, 313), testbed.SINKS) + testbed.lm_sweep(range(310, 312), (7e-3, 1e-2))
    + testbed.eureka(range(310, 311)),
    # held out after users2 (a sink opens after the malignant's dwell): sink fine-tunes (2 families x 3 seeds), the
    # nanoGPT sweep on both sides of its boundary with twins (3 seeds), the LLaMA sweep at its two highest rates with
    # twins, one Eureka seed on each implementation, the 8 healthy runs of one seed
    "users3": testbed.finetunes(range(320, 323), testbed.SINKS) + testbed.lm_sweep(range(320, 323), (7e-3, 1e-2))
    + testbed.llama_sweep(range(320, 321), testbed.LLAMA_LRS[1:]) + testbed.eureka(range(320, 321))
    + testbed.healthy(range(320, 321)),
    # held out after users3 (collapse_damage critical only on a loss that rose or stopped well above its trend, the
    # stall a warning; no collapse_warning; the plateau's stuck layer within 1 nat of uniform entropy, and no plateau
    # under a learning rate decayed away): sink fine-tunes (2 families x 1 seed), the nanoGPT sweep on both sides of
    # its boundary with twins at 1,500 steps (3 seeds), the LLaMA sweep at its two highest rates with twins, the 8
    # healthy runs of one seed, the README demo's healthy twin at 1,500 steps with its NormSoftmax twin, one Eureka
    # seed on each implementation with its NormSoftmax twin. The healthy runs at context 512 and 1,024 have no
    # NormSoftmax twin here: unfused, its attention costs 17x SDPA's per layer on this CPU (1.19 s against 0.07 s
    # forward and backward at 4 x 8 heads x 512^2), some 40 CPU-minutes a twin
    "users4": testbed.finetunes(range(330, 331), testbed.SINKS)
    + testbed.lm_sweep(range(330, 333), (7e-3, 1e-2), steps=testbed.LONG_STEPS)
    + testbed.llama_sweep(range(330, 331), testbed.LLAMA_LRS[1:]) + testbed.eureka(range(330, 331))
    + testbed.normsoftmax(range(330, 331)) + testbed.healthy(range(330, 331)) + testbed.demo_twin(range(330, 331)),
    # held out after users4, the detectors unchanged, for what users4 could not measure: collapse runs that the twin
    # test calls undamaged. At 1,500 steps every collapsing run of users4 was damaged; at 300 steps about two in five
    # of the earlier sets' collapse runs were not. The nanoGPT sweep with twins at 1,500 steps (1e-2: 3 seeds; the
    # boundary rate 5e-3: 1 seed) and at 300 steps at the boundary and both rates above it (3 seeds)
    "users5": testbed.lm_sweep(range(340, 343), (1e-2,), steps=testbed.LONG_STEPS)
    + testbed.lm_sweep(range(343, 344), (BOUNDARY_LR,), steps=testbed.LONG_STEPS)
    + testbed.lm_sweep(range(344, 347), (BOUNDARY_LR, 7e-3, 1e-2)),
    # held out after users4, the detectors unchanged, for the causal test of every plateau alert on a healthy run:
    # the 8 healthy runs of one seed (4 families x 2 schedules, contexts 512 and 1,024), each with its NormSoftmax
    # twin (its attention at SDPA's cost plus the keys' moments: 2-2.5x a step of the run, not the unfused 17x)
    "users6": testbed.healthy(range(350, 351)) + testbed.healthy_twins(range(350, 351)),
    # held out after users5, the detectors unchanged: the boundary rate at 300 steps with twins, where two of
    # users5's three seeds collapsed without damage (8 seeds)
    "users7": testbed.lm_sweep(range(360, 368), (BOUNDARY_LR,)),
    # held out after users7, the detectors and the twin test unchanged: the boundary rate at 300 steps with twins,
    # 24 seeds; over users5 and users7 about 2 seeds in 11 there collapsed without damage
    "users8": testbed.lm_sweep(range(370, 394), (BOUNDARY_LR,)),
}


def runs_of(name: str) -> list[RunSpec]:
    return SETS[name]


def set_of(spec: RunSpec) -> str:
    """The set a run belongs to (by its seed), or raises: a run outside the plan counts nowhere."""
    for name, specs in SETS.items():
        if spec in specs:
            return name
    raise KeyError(f"{spec.name} is in no set of evaluation/seeds.py")
