"""The ground truth of the attention states: Qi et al.'s definitions, read from the full attention maps.

Qi et al. (ICLR 2025) call an attention map in **malignant** entropy collapse when it is *sparse yet low-rank*:
every query puts its mass on the same one or few keys, so that the map's mass stands in a few vertical lines
(their matrix C: every row on the first key). **Benign** collapse is sparse but full-rank (each query on a key of
its own, their matrix B: the identity); **uniform** attention is low rank without sparsity (their matrix A:
every query spreading its mass evenly). An **attention sink** (Xiao et al. 2023) is the sparse, low-rank map
whose mass stands on one key position that every sequence shares (the first token): its own state, as the
detectors have it.

This module reads those words off the maps that :mod:`evaluation.maps` measures at every step (how much of
each query's mass its top keys hold, how many key columns hold all queries' mass, how evenly each query spreads
its mass, what one shared key position holds), with its own parameters (:class:`Definition`), and imports
nothing of ``diag`` or ``hooks`` (``diag`` itself imports the detectors; ``tests/evaluation/test_groundtruth.py``
checks both). Per sample and head
(:func:`head_states`), one state at most:

* **sparse**: at least ``queries`` of the head's queries are *focused*: their ``top_keys`` keys hold at least
  ``top_mass`` of their mass;
* **few columns** (low rank): the key columns that together hold ``column_mass`` of all queries' mass number at
  most ``few_columns`` of the rows (averaged over the measured sequences);
* **sink**: sparse, and one key position holds at least ``sink_mass`` of all queries' mass in every sequence;
* **malignant**: sparse, few columns, no sink; **benign**: sparse, not few columns, no sink;
* **uniform**: not sparse, and at least ``queries`` of the queries spread their mass *evenly* (their entropy
  at least ``even`` of uniform attention's over the keys they see).

Over time (:func:`smooth`): a head is in a state at a step when the state's test holds at more than half of
its samples within ``window // 2`` steps of it (the truth may read the future; a detector may not). A head's
episode is a run of such steps: ``since`` (and ``opened``) its first step, ``until`` the first step after it
(None: open at the end of the run). A **layer** is in a state while more than half of its heads are; a
**baseline** episode begins at the layer's first sample.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from evaluation.maps import COLUMN_MASS, EVEN, TOP_KEYS, TOP_MASS, Maps

__all__ = ["Definition", "Episode", "STATES", "episodes", "head_name", "head_states", "runs", "smooth"]

STATES = ("malignant", "benign", "uniform", "sink")


@dataclass(frozen=True)
class Definition:
    """The definition's parameters, each in the papers' terms (the defaults say what the words mean)."""

    top_keys: int = 4  # "the same one or few keys": a query is focused when its top_keys keys ...
    top_mass: float = 0.9  # ... hold at least this share of its mass
    queries: float = 0.9  # "every query": a head passes a per-query test when this share of its queries do
    column_mass: float = 0.9  # the key columns that together hold this share of all queries' mass ...
    few_columns: float = 0.0625  # ... are few (low rank) when they number at most this share of the rows
    even: float = 0.9  # a query spreads evenly when its entropy is this share of uniform attention's or more
    sink_mass: float = 0.6  # a sink: one key position, the same in every sequence, holds this share of all mass
    window: int = 21  # steps: a head is in a state where its test holds at most of its samples this close

    def __post_init__(self) -> None:
        for name, levels in (("top_keys", TOP_KEYS), ("top_mass", TOP_MASS), ("column_mass", COLUMN_MASS),
                             ("even", EVEN)):
            if getattr(self, name) not in levels:
                raise ValueError(f"Definition.{name}={getattr(self, name)!r}: the maps are measured at "
                                 f"{levels} (evaluation.maps); pick one of them")
        for name in ("queries", "few_columns", "sink_mass"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"Definition.{name}={getattr(self, name)!r}: a share, in (0, 1]")
        if self.window < 1:
            raise ValueError(f"Definition.window={self.window!r}: a number of steps, at least 1")

    def replace(self, **changes: float) -> Definition:
        return Definition(**{f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class Episode:
    """One episode of one state on a head (``where = "L03/H05"``) or a layer (``"L03"``)."""

    state: str
    where: str
    since: int  # the first step of the episode
    opened: int  # the step at which it is established (the truth's: since)
    until: int | None  # the first step after it; None: still open at the end of the run
    baseline: bool  # since is the layer's first sample


def head_name(h: int, heads: int) -> str:
    """``"H05"``: head ``h`` of ``heads``, numbered as the Monitor's tags number it (at least two digits)."""
    return "H" + str(h).zfill(max(2, len(str(max(heads - 1, 0)))))


def head_states(maps: Maps, label: str, d: Definition) -> dict[str, np.ndarray]:
    """Per state, whether each sample and head passes its test: boolean (N, H). A sample that is not finite
    passes none."""
    focused = maps.focused[label][:, :, TOP_KEYS.index(d.top_keys), TOP_MASS.index(d.top_mass)]  # (N, H)
    columns = maps.columns[label][:, :, COLUMN_MASS.index(d.column_mass)]  # (N, H)
    even = maps.even[label][:, :, EVEN.index(d.even)]  # (N, H)
    shared = maps.shared[label]  # (N, H)
    with np.errstate(invalid="ignore"):
        sparse = focused >= d.queries
        few = columns <= d.few_columns * maps.rows[label]
        sink = sparse & (shared >= d.sink_mass)
        return {"malignant": sparse & few & ~sink, "benign": sparse & ~few & ~sink, "sink": sink,
                "uniform": ~sparse & (focused == focused) & (even >= d.queries)}


def smooth(steps: np.ndarray, inside: np.ndarray, window: int) -> np.ndarray:
    """Whether ``inside`` (N, ...) holds at more than half of the samples within ``window // 2`` steps of each."""
    lo = np.searchsorted(steps, steps - window // 2, side="left")
    hi = np.searchsorted(steps, steps + window // 2, side="right")
    total = np.concatenate([np.zeros((1, *inside.shape[1:])), np.cumsum(inside, 0)])
    count = total[hi] - total[lo]
    return 2 * count > (hi - lo).reshape(-1, *[1] * (inside.ndim - 1))


def runs(steps: np.ndarray, inside: np.ndarray) -> list[tuple[int, int | None]]:
    """The runs of consecutive samples where ``inside`` (N,) holds, as (first step, first step after or None)."""
    edges = np.diff(np.concatenate([[0], inside.astype(int), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(steps[a]), int(steps[b]) if b < len(steps) else None) for a, b in zip(starts, ends)]


def episodes(maps: Maps, d: Definition | None = None) -> list[Episode]:
    """Every state episode of a run, heads and layers, ordered by (opened, where, state)."""
    d = d or Definition()
    out = []
    for label in maps.layers:
        first = int(maps.steps[0])
        for state, inside in head_states(maps, label, d).items():
            held = smooth(maps.steps, inside, d.window)  # (N, H)
            n = held.shape[1]
            for h in range(n):
                out += [Episode(state, f"{label}/{head_name(h, n)}", a, a, b, a == first)
                        for a, b in runs(maps.steps, held[:, h])]
            layer = 2 * held.sum(1) > n
            out += [Episode(state, label, a, a, b, a == first) for a, b in runs(maps.steps, layer)]
    return sorted(out, key=lambda e: (e.opened, e.where, e.state))
