"""The Q/K/V weights (and gradients) of the monitored layers, and the W_O weight where the layout names one (for
the update ratio), as whole tensors in float32 or better.

Plain parameters (one process, DDP) are read in place: nothing is gathered or copied. Only DTensors go to
:mod:`hooks.parallel.gather`: HSDP's (and FSDP2's beside tensor parallelism) are gathered one layer at a time, so
at most one layer's gathered weights exist at a time; under tensor parallelism each rank reads its own block of
heads. Layers under FSDP2 alone are not read here: :class:`hooks.monitor.weightside.WeightSide` sends each one to
its owner rank (:mod:`hooks.parallel.owners`). Only the parameters a layout names are read, and only when the
Monitor asks: on steps that sample gradients, spectra or update ratios, and at the call after an update-ratio
sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from hooks.layout.discover import AttentionLayer
from hooks.parallel.dtensors import is_dtensor
from hooks.parallel.gather import gather_full, gathers, widened

__all__ = ["QKVReader", "kept_dim"]


def kept_dim(layer: AttentionLayer) -> int | None:
    """Under tensor parallelism, the mesh dim whose shard of the layer (its block of heads) this rank keeps."""
    return None if layer.block is None else layer.block.dim


class QKVReader:
    """Reads the Q/K/V weights (and gradients) of the monitored layers, a group of layers at a time.

    :meth:`groups`: plain parameters (one process, DDP) make one group of every layer: they are
    read in place, nothing is gathered or copied. Sharded ones (FSDP2 DTensors) make one group
    per layer, so the Monitor never holds more than one layer's gathered weights at a time
    (docs/cost.md). :meth:`read` returns a group's whole tensors in float32 or better, gathered
    in one collective per group; every rank reads the same groups in the same order.
    output: read W_O too (under ``layout.o``; its weight only, never its gradient).
    """

    def __init__(self, layers: Sequence[AttentionLayer], grads: bool = True, output: bool = True,
                 gathered_grads: Callable[[AttentionLayer], bool] | None = None) -> None:
        self.layers, self.grads, self.output = list(layers), grads, output
        self.gathered_grads = gathered_grads or (lambda layer: True)  # False: its gradients are read elsewhere

    def groups(self) -> list[list[AttentionLayer]]:
        """The layers in reading order: one group of all (plain, or tensor parallelism alone: each rank's blocks
        are read in place), or one layer per group (anything to gather)."""
        return [[layer] for layer in self.layers] if self.gathers() else [list(self.layers)]

    def gathers(self) -> bool:
        """Whether reading a layer gathers anything (FSDP2, HSDP; not tensor parallelism alone); checked at each
        call: a model may be sharded after attaching."""
        return any(gathers(layer.weights().values(), kept_dim(layer)) for layer in self.layers)

    def read(
        self, group: Sequence[AttentionLayer], weights: bool = True, grads: bool = False
    ) -> list[tuple[dict[str, Tensor] | None, dict[str, Tensor] | None]]:
        """(weights, grads) of each layer of ``group``: weights None when not asked, grads None when
        not asked or when a Q/K/V parameter has no ``.grad``."""
        tensors: list[Tensor] = []
        keep: list[int | None] = []
        plan = []
        for layer in group:
            named = layer.params()
            wanted = (layer.weights() if self.output else named) if weights else {}
            with_grads = (grads and self.grads and self.gathered_grads(layer)
                          and all(p.grad is not None for p in named.values()))
            tensors += list(wanted.values()) + ([p.grad for p in named.values()] if with_grads else [])
            plan.append((list(wanted), list(named) if with_grads else None))
            keep += [kept_dim(layer)] * (len(tensors) - len(keep))
        full = iter(_whole(tensors, keep))
        out = []
        for names, grad_names in plan:
            read = {n: next(full) for n in names} if weights else None
            out.append((read, None if grad_names is None else {n: next(full) for n in grad_names}))
        return out


def _whole(tensors: list[Tensor], keep: list[int | None]) -> list[Tensor]:
    """Plain tensors as they are (float32 or better, no copy otherwise); DTensors through
    :func:`hooks.parallel.gather.gather_full` (one collective for the group, none under tensor parallelism
    alone)."""
    if any(is_dtensor(t) for t in tensors):
        return gather_full(tensors, keep)
    return [widened(t.detach()) for t in tensors]
