"""The Q/K/V weights (and gradients) of the monitored layers, and the W_O weight where the layout names one (for
the update ratio), as whole tensors in float32 or better.

Plain parameters (one process, DDP) are read in place, with no collective. Sharded ones (FSDP2) are gathered
(:mod:`hooks.parallel.gather`) one layer at a time. Only the parameters a layout names are gathered, and only
when the Monitor reads them: on steps that sample gradients, spectra or update ratios, and at the call after an
update-ratio sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from hooks.layout.discover import AttentionLayer
from hooks.parallel.gather import _dtensor_type, _keep, _plan, gather_full

__all__ = ["QKVReader"]


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
        dtensor = _dtensor_type()
        return dtensor is not None and any(
            isinstance(p, dtensor) and _plan(p.detach(), _keep(layer)).kind != "local"
            for layer in self.layers for p in layer.weights().values())

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
            keep += [_keep(layer)] * (len(tensors) - len(keep))
        full = iter(gather_full(tensors, keep))  # one collective for the group (none under tensor parallelism alone)
        out = []
        for names, grad_names in plan:
            read = {n: next(full) for n in names} if weights else None
            out.append((read, None if grad_names is None else {n: next(full) for n in grad_names}))
        return out
