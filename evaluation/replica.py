"""The detectors' definition of the attention states written a second time: a check of their implementation.

:mod:`diag.detectors.states` judges the attention states sample by sample, as a stream (a state machine per head
and layer that a resumed run restores); this module evaluates the same definition, with the same numbers
(``StatesConfig``), over a whole run at once, vectorised with numpy, so that a mistake in the streaming machine
(a dwell miscounted, a layer's end misplaced, a state lost at a resume) shows as a difference between the two
(:mod:`evaluation.agree`, ``tests/detectors/test_states.py``). It is not a ground truth: it shares the
definition and its numbers with the detectors, and two implementations of one definition agree whether the
definition is right or not. The ground truth of the attention states is :mod:`evaluation.groundtruth` (the
papers' definitions on the full attention maps). It reads a run's every-step observations and follows the
definition in four steps:

1. **Series** (:func:`series_of`): per layer, the attention samples in step order as arrays over (samples,
   heads): entropy ``e``, effective rank ``r``, the rows the rank saw, uniform attention's entropy ``u`` (none
   recorded: infinite, so no head is ever uniform) and the sink share ``s`` (none recorded: 0, no sink).
2. **Tests** (:func:`tests_of`): per sample and head, each state's entry and exit test, vectorised, with the
   sparse line ``E`` (``sparse_entropy``), the low-rank line ``R = 1 + low_rank_frac (rows - 1)``, the exit
   factor ``f`` and the sink line ``S`` (``sink_share``):

   * sink: in when ``e <= E`` and ``s >= S``; out when ``e > fE`` or ``s < S / f``;
   * malignant: in when ``e <= E`` and ``r <= R`` and not sink-in; out when ``e > fE`` or ``r > fR``;
   * benign: in when ``e <= E`` and ``r > R`` and not sink-in; out when ``e > fE``;
   * uniform: in when ``r <= R`` and ``e >= uniform_frac u``; out when ``r > fR`` or
     ``e < (1 - f (1 - uniform_frac)) u``.

   A sample whose ``e`` or ``r`` is not finite passes no test; a comparison with a sink share that is not
   finite does not hold.
3. **Dwell per head** (:func:`dwell`): a head enters a state once its entry test held at ``collapse_persist``
   samples spanning ``collapse_dwell`` steps (malignant and sink; benign and uniform at the first inside sample),
   samples passing neither test not breaking the run and one passing the exit test resetting it; ``since`` is
   the run's first sample, ``opened`` the sample that completes it. It leaves once the exit test held at
   ``EXIT_SAMPLES`` samples spanning ``exit_dwell`` steps (an inside sample resets that run); ``until`` is the
   exit run's first sample. A head with a malignant episode open or pending is not benign.
4. **Layers** (:func:`layer_spans`): a layer of ``H`` heads needs ``max(min(2, H), ceil(layer_share H))`` of
   them. It enters a state at the first sample where that many heads are in it and not on their way out (no exit
   run begun), ``since`` the needed-th smallest of their ``since``; it leaves at the first sample where fewer
   than that many are in it (those on their way out counted), ``until`` the ``until`` of the head whose exit
   took the count below the need.

An episode (head or layer) is a **baseline** episode when its ``since`` is the layer's first attention sample:
the model was in the state when monitoring began.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from diag.catalog.tags import head_label
from diag.detectors.config import StatesConfig
from evaluation.groundtruth import Episode

__all__ = ["EXIT_SAMPLES", "Series", "Track", "dwell", "episodes", "layer_needs", "layer_spans", "series_of",
           "tests_of"]

EXIT_SAMPLES = 2  # the detectors' exit dwell counts 2 samples (diag.detectors.states: Dwell(2, exit_dwell))


@dataclass
class Series:
    """One layer's attention samples in step order: ``steps`` (T,), the rest (T, H)."""

    steps: np.ndarray
    entropy: np.ndarray
    rank: np.ndarray
    rows: np.ndarray  # (T, 1)
    uniform: np.ndarray  # (T, H) or (T, 1)
    sink: np.ndarray  # (T, H) or (T, 1)

    @property
    def heads(self) -> int:
        return self.entropy.shape[1]


def _column(samples: list[dict], key: str, default: float) -> np.ndarray:
    """(T, width) of one statistic; ``default`` where a sample lacks it."""
    values = [np.atleast_1d(np.asarray(m[key], float)) if key in m else np.array([default]) for m in samples]
    width = max(len(v) for v in values)
    return np.stack([np.broadcast_to(v, (width,)) for v in values])


def series_of(observations: Iterable) -> dict[str, Series]:
    """Every layer's attention samples (observations holding ``attn_entropy``, ``attn_rank`` and ``attn_rows``
    for it), in the order given (step order)."""
    by_label: dict[str, tuple[list[int], list[dict]]] = {}
    for obs in observations:
        for label, m in obs.layers.items():
            if all(k in m for k in ("attn_entropy", "attn_rank", "attn_rows")):
                steps, samples = by_label.setdefault(label, ([], []))
                steps.append(obs.step)
                samples.append(m)
    out = {}
    for label, (steps, samples) in by_label.items():
        widths = {len(np.atleast_1d(m["attn_entropy"])) for m in samples}
        if len(widths) != 1:
            raise ValueError(f"layer {label}: its attention samples have {sorted(widths)} heads; a layer's samples "
                             "must all have the same heads (a recording of one model)")
        out[label] = Series(np.array(steps), _column(samples, "attn_entropy", math.nan),
                            _column(samples, "attn_rank", math.nan), _column(samples, "attn_rows", math.nan)[:, :1],
                            _column(samples, "attn_entropy_uniform", math.inf), _column(samples, "attn_sink", 0.0))
    return out


def tests_of(x: Series, d: StatesConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per state, (entry test, exit test) of every sample and head: boolean (T, H)."""
    e, r, u, s = x.entropy, x.rank, x.uniform, x.sink
    measured = np.isfinite(e) & np.isfinite(r)
    sparse, f = d.sparse_entropy, d.exit_factor
    r_line = 1.0 + d.low_rank_frac * np.maximum(x.rows - 1.0, 0.0)
    with np.errstate(invalid="ignore"):
        sink_in = measured & (e <= sparse) & (s >= d.sink_share)
        return {
            "sink": (sink_in, measured & ((e > f * sparse) | (s < d.sink_share / f))),
            "malignant": (measured & (e <= sparse) & (r <= r_line) & ~sink_in,
                          measured & ((e > f * sparse) | (r > f * r_line))),
            "benign": (measured & (e <= sparse) & (r > r_line) & ~sink_in, measured & (e > f * sparse)),
            "uniform": (measured & (r <= r_line) & (e >= d.uniform_frac * u),
                        measured & ((r > f * r_line) | (e < (1.0 - f * (1.0 - d.uniform_frac)) * u))),
        }


@dataclass
class Track:
    """One head in one state, after each of its samples, and its episodes as (since, opened, until)."""

    held: np.ndarray  # in an episode (established, not yet left)
    leaving: np.ndarray  # ... with its exit run begun
    pending: np.ndarray  # an entry run under way, not yet established
    since: np.ndarray  # the since of the episode held (-1: none)
    closed: np.ndarray  # the until of the episode that ended at this sample (-1: none)
    spans: list[tuple[int, int, int | None]] = field(default_factory=list)


def dwell(steps: np.ndarray, inside: np.ndarray, outside: np.ndarray, samples: int, span: int,
          exit_samples: int, exit_span: int) -> Track:
    """The dwell over one head's samples: enter after ``samples`` inside samples spanning ``span`` steps, leave
    after ``exit_samples`` outside samples spanning ``exit_span`` steps; a sample passing neither test changes
    nothing."""
    n = len(steps)
    track = Track(np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool), np.full(n, -1), np.full(n, -1))
    entry = exit_run = episode = None  # (first step, samples) of each run; (since, opened) of the episode
    for t, (step, i, o) in enumerate(zip(steps.tolist(), inside.tolist(), outside.tolist())):
        if episode is None:
            if o:
                entry = None
            elif i:
                first, count = entry or (step, 0)
                entry = (first, count + 1)
                if entry[1] >= samples and step - first >= span:
                    episode, entry = (first, step), None
        elif i:
            exit_run = None
        elif o:
            first, count = exit_run or (step, 0)
            exit_run = (first, count + 1)
            if exit_run[1] >= exit_samples and step - first >= exit_span:
                track.spans.append((*episode, first))
                track.closed[t] = first
                episode = exit_run = None
        track.pending[t] = entry is not None
        if episode is not None:
            track.held[t], track.leaving[t], track.since[t] = True, exit_run is not None, episode[0]
    if episode is not None:
        track.spans.append((*episode, None))
    return track


def layer_needs(heads: int, d: StatesConfig) -> int:
    """How many of a layer's heads must be in a state for the layer to be in it."""
    return max(min(2, heads), math.ceil(d.layer_share * heads - 1e-9))


def layer_spans(steps: np.ndarray, tracks: list[Track], need: int) -> list[tuple[int, int, int | None]]:
    """A layer's episodes of one state from its heads' tracks, as (since, opened, until)."""
    held = np.stack([tr.held for tr in tracks], 1)
    holding = held & ~np.stack([tr.leaving for tr in tracks], 1)
    since = np.stack([tr.since for tr in tracks], 1)
    closed = np.stack([tr.closed for tr in tracks], 1)
    spans, episode = [], None
    for t in range(len(steps)):
        if episode is None and holding[t].sum() >= need:
            episode = (int(np.sort(since[t, holding[t]])[need - 1]), int(steps[t]))
        elif episode is not None and held[t].sum() < need:
            before = int(held[t - 1].sum())
            ends = np.sort(closed[t][closed[t] >= 0])
            spans.append((*episode, int(ends[before - need])))
            episode = None
    if episode is not None:
        spans.append((*episode, None))
    return spans


def _layer_episodes(label: str, x: Series, d: StatesConfig) -> list[Episode]:
    tests = tests_of(x, d)
    first, n = int(x.steps[0]), x.heads
    out, malignant = [], []
    for state in ("malignant", "benign", "uniform", "sink"):  # malignant first: a head open or pending in it
        inside, outside = tests[state]  # is not benign
        if state == "benign":
            inside = inside & ~np.stack([tr.held | tr.pending for tr in malignant], 1)
        enter = (d.collapse_persist, d.collapse_dwell) if state in ("malignant", "sink") else (1, 0)
        tracks = [dwell(x.steps, inside[:, h], outside[:, h], *enter, EXIT_SAMPLES, d.exit_dwell)
                  for h in range(n)]
        malignant = tracks if state == "malignant" else malignant
        for h, tr in enumerate(tracks):
            out += [Episode(state, f"{label}/{head_label(h, n)}", s, o, u, s == first) for s, o, u in tr.spans]
        out += [Episode(state, label, s, o, u, s == first)
                for s, o, u in layer_spans(x.steps, tracks, layer_needs(n, d))]
    return out


def episodes(observations: Iterable, d: StatesConfig | None = None) -> list[Episode]:
    """Every state episode of a run, heads and layers, ordered by (opened, where, state)."""
    d = d or StatesConfig()
    out = [e for label, x in series_of(observations).items() for e in _layer_episodes(label, x, d)]
    return sorted(out, key=lambda e: (e.opened, e.where, e.state))
