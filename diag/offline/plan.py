"""The plan of a series: its checkpoints in step order, each with the attention layers it is analysed with.

Only headers are read here (shapes, configs, stored steps, a model folder's ``config.json``); the
weights are read later, one layer at a time (:mod:`diag.offline.units`). The plan is what every
process of a ``--jobs`` run shares: it is made once, in the calling process.

Steps (:func:`diag.offline.checkpoint.step_of`): stored with the checkpoint, else a name that reads as a
step; a series none of whose checkpoints has one is ordered by position, and the analysis says so; in
a series where the others have steps, a checkpoint without one fails (its place is unknown), as does a
second checkpoint of the same step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from diag.errors import DiagError, SpecError
from diag.layouts.statedict import Heads, StateDictLayer
from diag.offline.checkpoint import STEP_KEYS, STEP_NAMES, Checkpoint, find_checkpoints, open_checkpoint, step_of
from diag.offline.layers import ModelLayoutFn, choose_layers
from diag.offline.layoutfile import LayoutFile

__all__ = ["Plan", "Planned", "LayoutChoice", "make_plan"]


@dataclass(frozen=True)
class LayoutChoice:
    """How every checkpoint's layouts are chosen (see :mod:`diag.offline.layers`)."""

    layout: LayoutFile | None = None
    heads: int | None = None
    kv_heads: int | None = None
    model_layout: ModelLayoutFn | None = None
    kv_map: str | None = None  # --kv-map: "grouped", "tiled" or a list "0,1,0,1"
    user_model: ModelLayoutFn | None = None  # --model module:callable

    def layers(self, ckpt: Checkpoint) -> tuple[list[StateDictLayer], Heads]:
        return choose_layers(ckpt, self.layout, self.heads, self.kv_heads, self.model_layout, self.kv_map,
                             self.user_model)


@dataclass(frozen=True)
class Planned:
    """One checkpoint of the series: where its step came from, and its layers (None where it failed)."""

    path: Path
    step: int
    step_from: str  # "metadata", "name" or "position"
    layers: tuple[StateDictLayer, ...] | None = None
    heads: Heads | None = None
    error: str | None = None  # why it cannot be analysed (its layouts, or shapes unlike the series')


@dataclass
class Plan:
    entries: list[Planned] = field(default_factory=list)  # step order, failed ones in their place
    failures: list[tuple[str, str]] = field(default_factory=list)  # paths that could not be placed at all


def _step_failure(path: Path) -> str:
    return (f"{path}: no step stored with it ({', '.join(STEP_KEYS)}) and none in its name ({STEP_NAMES}), "
            "while the other checkpoints of the series have steps, so its place among them is unknown: "
            "rename it with its step, or analyse it on its own")


def _open_all(paths: list[Path], choice: LayoutChoice) -> tuple[list[tuple[Path, int | None, str, tuple]],
                                                                 list[tuple[str, str]]]:
    """(path, step, where the step came from, (layers, heads) or (None, the error)) per checkpoint that opens."""
    opened, failures = [], []
    for path in paths:
        try:
            ckpt = open_checkpoint(path)
            step, step_from = step_of(path, ckpt)
        except DiagError as err:
            failures.append((str(path), str(err)))
            continue
        except (RuntimeError, OSError, ValueError) as err:
            failures.append((str(path), f"{path}: cannot be opened ({err}); the file is corrupt: re-copy it"))
            continue
        opened.append((path, step, step_from, _layers(path, ckpt, choice)))
    return opened, failures


def _layers(path: Path, ckpt: Checkpoint, choice: LayoutChoice) -> tuple:
    try:
        return choice.layers(ckpt)
    except SpecError as err:
        return (None, f"{path}: {str(err).removeprefix(f'{path}: ')}")
    except DiagError as err:
        return (None, str(err) if str(path) in str(err) else f"{path}: {err}")
    except (RuntimeError, OSError, ValueError) as err:
        return (None, f"{path}: failed while reading its attention layouts ({err}); the file is corrupt or its "
                "shapes do not fit the layout")


def _ordered(opened: list[tuple[Path, int | None, str, tuple]]) -> tuple[list[tuple], list[tuple[str, str]]]:
    """Sorted by step (positions where no checkpoint has one); steps missing or repeated fail."""
    failures = []
    if all(step is None for _, step, _, _ in opened):
        opened = [(path, i, "position", found) for i, (path, _, _, found) in enumerate(opened)]
    placed = []
    for i, (path, step, step_from, found) in enumerate(opened):
        if step is None:
            failures.append((str(path), _step_failure(path)))
        else:
            placed.append((step, i, path, step_from, found))
    placed.sort(key=lambda t: (t[0], t[1]))
    kept: list[tuple] = []
    for step, _, path, step_from, found in placed:
        if kept and kept[-1][1] == step:
            failures.append((str(path), f"{path}: step {step} again (also {kept[-1][0]}); a series needs one "
                             "checkpoint per step: pass one of them"))
        else:
            kept.append((path, step, step_from, found))
    return kept, failures


def _same_layers(path: Path, layers: list[StateDictLayer], first: Planned) -> str | None:
    if [(la.name, la.layout) for la in layers] == [(la.name, la.layout) for la in first.layers or ()]:
        return None
    return (f"{path}: mismatched shapes: its attention layers ({len(layers)}) differ in names or shapes "
            f"from those of {first.path} ({len(first.layers or ())}); analyse checkpoints of one model per run")


def make_plan(paths: Iterable[str | Path], choice: LayoutChoice) -> Plan:
    """Find the checkpoints, read their steps and choose their layers (headers only)."""
    plan = Plan()
    found, failed = find_checkpoints(str(p) for p in paths)
    plan.failures += [(arg, str(err)) for arg, err in failed]
    opened, failures = _open_all(found, choice)
    plan.failures += failures
    kept, failures = _ordered(opened)
    plan.failures += failures
    first: Planned | None = None
    for path, step, step_from, (layers, heads_or_error) in kept:
        if layers is None:
            plan.entries.append(Planned(path, step, step_from, error=heads_or_error))
            continue
        error = None if first is None else _same_layers(path, layers, first)
        entry = Planned(path, step, step_from, tuple(layers), heads_or_error, error)
        plan.entries.append(entry)
        if first is None:
            first = entry
    return plan
