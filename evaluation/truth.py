"""Ground truth, never from the detectors' state: what each recorded run did.

* **Attention states** (:func:`states`): the detectors' definition of the four states (``StatesConfig``),
  evaluated over the attention logged at every step by :mod:`evaluation.replica` (a second implementation of
  that definition): every episode per head and per layer. An *established collapse* is a layer's malignant
  episode (its ``opened`` step, the layer's *onset*); a run *collapses* when one of its layers does.
  :func:`onsets` gives each layer's (or head's) onsets, against which the replay matches that layer's (head's)
  own records. This is the reference for *when* the replayed detectors, sampling every few steps, find what
  their definition finds at every step; whether the definition finds what the papers call a malignant
  collapse is judged against the full attention maps (:mod:`evaluation.groundtruth`, :mod:`evaluation.agree`).
* **Damage** (:func:`damage`): the twin test. A run is *damaged by its attention* when its final loss (the mean
  of its last 50 steps) is above its QK-norm twin's (same seed, learning rate and schedule) by more than
  ``DAMAGE_MARGIN`` of the twin's; the damage begins where the two losses separate for good (the first step
  from which the run's 20-step mean stays above the twin's by that margin).
* **Accuracy jump** (Eureka task, :func:`accuracy_jump`): the first held-out evaluation above halfway from the
  no-indicator accuracy to the run's final accuracy; none if the final accuracy is not 0.2 above it. A run whose
  accuracy still rose over its last 100 steps (:func:`settled`) was cut off during its jump: its "final"
  accuracy is not final, so its jump's date is provisional (the evaluation reports the moment's timing on
  such runs apart). The jump takes time: :func:`accuracy_rise` is its span, from the first evaluation a quarter
  of the way up to the first three quarters of the way up (the moment's timing is also judged against it).
* **Plateau by the causal test** (:func:`plateau_by_twin`): a language model's run *has an attention plateau*
  when its NormSoftmax twin leaves the loss level the run is stuck at much faster (by ``TWIN_LEAD`` of the run's
  length or more) than the run does. When neither leaves it within the budget (:func:`stuck_with_twin`) the run
  is stuck and the test has no verdict on the cause; the evaluation says so beside the verdict.
* **Stuck at the context-free loss** (:func:`at_context_free`): a language model whose loss sits at the loss of
  the best predictor that reads no context (the entropy of its corpus's bytes, :func:`context_free_loss`; within
  ``CONTEXT_FREE_MARGIN``, over the ``CONTEXT_FREE_SPAN`` steps before the alert) has learned nothing from its
  context: a stuck run, not a slowly improving one, and no healthy run. Measured from the corpus and the run's
  every-step losses, independently of the detectors (BERT itself sits there at this size).
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diag.detectors.config import StatesConfig
from evaluation.groundtruth import Episode
from evaluation.record import load_observations
from evaluation.replica import episodes
from evaluation.spec import RunSpec

__all__ = ["Run", "load_run", "load_runs", "states", "onsets", "malignant_episodes", "collapse_onset", "damage",
           "accuracy_jump",
           "accuracy_rise", "settled", "stuck_with_twin", "context_free_loss", "at_context_free"]

DAMAGE_MARGIN = 0.05  # final loss 5% over the twin's: clearly worse (run-to-run spread of twins is ~1%)
SEPARATION_SPAN = 20
TWIN_LEAD = 0.25
CONTEXT_FREE_MARGIN = 0.05  # a plateau within 5% of the context-free loss sits at it ...
CONTEXT_FREE_SPAN = 100  # ... judged on the mean loss of this many steps (half a plateau window)


@dataclass
class Run:
    spec: RunSpec
    path: Path
    info: dict
    _obs: list | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def obs(self) -> list:
        if self._obs is None:
            self._obs = load_observations(self.path / "observations.jsonl")
        return self._obs

    @property
    def losses(self) -> list[float]:
        return self.info["losses"]


def load_run(path: Path) -> Run:
    info = json.loads((path / "run.json").read_text())
    return Run(RunSpec.from_dict(info["config"]), path, info)


def load_runs(root: Path, specs: list[RunSpec] | None = None) -> list[Run]:
    """The complete runs under ``root`` (those of ``specs`` only, when given), in the order of ``specs``."""
    if specs is None:
        paths = sorted(p for p in root.iterdir() if (p / "run.json").exists())
        return [load_run(p) for p in paths]
    return [load_run(root / s.name) for s in specs if (root / s.name / "run.json").exists()]


def states(run: Run, definition: StatesConfig | None = None) -> list[Episode]:
    """Every attention-state episode of the run from its every-step attention, by the detectors' definition
    (cached per configuration)."""
    definition = definition or StatesConfig()
    cache = run.__dict__.setdefault("_states", {})
    if definition not in cache:
        cache[definition] = episodes(run.obs, definition)
    return cache[definition]


Episodes = dict[str, list[tuple[int, int | None]]]  # head or layer -> [(opened, until or None)]


def malignant_episodes(run: Run) -> tuple[Episodes, Episodes]:
    """(per head, per layer) the steps each malignant episode of the run opened and ended (None: still open)."""
    heads: Episodes = defaultdict(list)
    layers: Episodes = defaultdict(list)
    for e in states(run):
        if e.state == "malignant":
            (heads if "/" in e.where else layers)[e.where].append((e.opened, e.until))
    return heads, layers


def onsets(run: Run, scope: str = "layer") -> dict[str, list[Episode]]:
    """Each layer's (``scope="head"``: each head's) malignant episodes in the order they opened."""
    out: dict[str, list[Episode]] = defaultdict(list)
    for e in states(run):
        if e.state == "malignant" and ("/" in e.where) == (scope == "head"):
            out[e.where].append(e)
    return dict(out)


def collapse_onset(run: Run, scope: str = "layer") -> int | None:
    """The first step at which a layer (or, ``scope="head"``, a head) of the run is established malignant."""
    return min((e[0].opened for e in onsets(run, scope).values()), default=None)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.inf


def damage(run: Run, twin: Run | None) -> tuple[bool | None, int | None]:
    """(damaged, the step the damage began) against the QK-norm twin; (None, None) without a twin."""
    if twin is None:
        return None, None
    a, b = run.losses, twin.losses
    final, final_twin = _mean(a[-50:]), _mean(b[-50:])
    if not final > (1.0 + DAMAGE_MARGIN) * final_twin:
        return False, None
    span = SEPARATION_SPAN
    over = [_mean(a[t : t + span]) > (1.0 + DAMAGE_MARGIN) * _mean(b[t : t + span])
            for t in range(0, min(len(a), len(b)) - span + 1)]
    begin = next((t for t in range(len(over)) if all(over[t:])), None)
    return True, begin


RISE_LO, RISE_HI = 0.25, 0.75  # the accuracy jump's span: from a quarter to three quarters of the way up
SETTLED_SPAN = 100  # steps
SETTLED_RISE = 0.05  # accuracy: the margin that says "still on the plateau" (evaluation.detectors.PLATEAU_MARGIN)


def settled(info: dict) -> bool:
    """Whether the held-out accuracy had settled by the end of the run: its last 3 evaluations' mean is at most
    ``SETTLED_RISE`` above the mean of the 3 evaluations ``SETTLED_SPAN`` steps earlier. A run cut off during
    its jump has no final accuracy yet: halfway to its last accuracy is not halfway up its jump (the jump is
    dated early against where the finished jump's halfway point would be)."""
    evals = info["evals"]
    if len(evals) < 6:
        return True
    end = evals[-1][0]
    before = [acc for s, _, acc in evals if s <= end - SETTLED_SPAN][-3:]
    last = [acc for _, _, acc in evals[-3:]]
    return not before or sum(last) / 3 - sum(before) / len(before) <= SETTLED_RISE


def accuracy_jump(info: dict) -> int | None:
    evals, blind = info["evals"], info["blind"]
    final = sum(acc for _, _, acc in evals[-3:]) / 3
    if final < blind + 0.2:
        return None
    return next((s for s, _, acc in evals if acc > (blind + final) / 2), None)


def accuracy_rise(info: dict, lo: float = RISE_LO, hi: float = RISE_HI) -> tuple[int, int] | None:
    """The accuracy jump as the span it takes: the first held-out evaluations above ``lo`` and above ``hi`` of the
    way from the no-indicator accuracy to the final accuracy (None without a jump, :func:`accuracy_jump`). On the
    consulted Eureka runs this rise from a quarter to three quarters of the way takes 3-15 evaluation intervals
    (median 9): the jump is a span, and its halfway point one convention for dating it."""
    if accuracy_jump(info) is None:
        return None
    evals, blind = info["evals"], info["blind"]
    final = sum(acc for _, _, acc in evals[-3:]) / 3
    start = next(s for s, _, acc in evals if acc > blind + lo * (final - blind))
    end = next(s for s, _, acc in evals if acc > blind + hi * (final - blind))
    return start, end


def leaves(losses: list[float], level: float, span: int = 20) -> int | None:
    """The first step from which the ``span``-step mean loss stays under ``level`` for the rest of the run."""
    means = [_mean(losses[t : t + span]) for t in range(0, len(losses) - span + 1)]
    return next((t for t in range(len(means)) if all(m < level for m in means[t:])), None)


def stuck_with_twin(run: Run, twin: Run | None, level: float) -> bool:
    """Neither the run nor its NormSoftmax twin leaves ``level`` for good within the budget: the run is stuck (not
    a healthy run) and the twin test has no verdict on the cause (:func:`plateau_by_twin` says False: the twin
    is not faster, because neither gets out)."""
    return twin is not None and leaves(run.losses, level) is None and leaves(twin.losses, level) is None


def plateau_by_twin(run: Run, twin: Run | None, level: float) -> bool | None:
    """Whether the NormSoftmax twin leaves ``level`` (a loss the run sat at) much sooner than the run does."""
    if twin is None:
        return None
    mine, theirs = leaves(run.losses, level), leaves(twin.losses, level)
    if theirs is None:
        return False
    mine = len(run.losses) if mine is None else mine
    return mine - theirs >= TWIN_LEAD * len(run.losses)


@functools.cache
def context_free_loss() -> float:
    """The loss, in nats, of the best predictor of a byte that reads no context, on the corpus of the Hugging Face
    language models (:mod:`evaluation.healthy`: the bytes of ``hooks.demo.load_text()``): the entropy of the
    corpus's byte frequencies (3.14 nats). A causal model predicting the next byte and a masked one predicting a
    masked byte both reach it with no attention to other positions."""
    from hooks.demo import load_text

    counts = np.bincount(np.frombuffer(load_text().encode(), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def at_context_free(run: Run, step: int, span: int = CONTEXT_FREE_SPAN) -> bool | None:
    """Whether a Hugging Face language model's loss sat at the context-free loss (its mean over the ``span`` steps
    before ``step``, from the run's every-step losses, at least ``1 - CONTEXT_FREE_MARGIN`` of it); None for a
    run of another task (the ViT's classes) or with no loss before ``step``."""
    if run.spec.task != "hf" or run.spec.model == "vit" or step <= 0:
        return None
    return _mean(run.losses[max(0, step - span) : step]) >= (1.0 - CONTEXT_FREE_MARGIN) * context_free_loss()
