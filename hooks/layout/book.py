"""The one place a layer's layout is decided: confirmed, adopted from the computation, or refused.

:class:`LayoutBook` keeps each layer's :class:`~hooks.layout.record.LayoutRecord` (its layout, W_O, state and
why). The capture hands it what it saw of an attention call (:class:`~hooks.layout.confirm.CapturedCall`) and
gets a :class:`~hooks.layout.confirm.Verdict` back; the Monitor asks it which layers are refused; the step
limit and the weight side read a layer's current layout through the layer, whose record the book holds.

On an observation, until the layer is settled:

1. the module's inputs are read batch-first, or time-first (fairseq, ``nn.MultiheadAttention`` without
   ``batch_first``) where that reading holds the kernel's queries;
2. :mod:`hooks.layout.confirm` compares the layout with the call (shapes, per-head norms);
3. where they disagree, :mod:`hooks.layout.read` reads the layout from the kernel's q and k: the same split
   confirms the layout (a norm between projection and kernel), another replaces a discovered layout
   (adopted) or refuses a spec's with the spec read in the message (:mod:`hooks.layout.refusals`).

A layout confirmed against the kernel's q and k is settled for good: later sampled steps skip the check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from diag.layouts.generic import generic_o, is_provisional
from diag.layouts.infer import same_split
from diag.layouts.vocab import QKVLayout, shape_problem
from hooks.layout.confirm import CapturedCall, Comparison, Inputs, Verdict, compare
from hooks.layout.discover import AttentionLayer, module_view
from hooks.layout.read import read_layout
from hooks.layout.refusals import not_this_attention, refuse, unconfirmable, unconfirmed, unpaired

__all__ = ["LayoutBook"]

log = logging.getLogger("diag")


class LayoutBook:
    """Every watched layer's layout and state; the only code that changes them.

    watching: whether a capture will show the layers' attention calls; without one a generic adapter's
    proposal can never be confirmed, so it is refused at once (with the spec to pass if it is right)."""

    def __init__(self, layers: Sequence[AttentionLayer], watching: bool = True) -> None:
        self.layers = list(layers)
        self._by_index = {layer.index: layer for layer in self.layers}
        if not watching:
            for index, why in unconfirmable(self.layers).items():
                self.refuse(self.layers[index], why)

    @property
    def refused(self) -> Mapping[int, str]:
        """Layer index -> why its layout is refused: none of that layer's metrics is logged. A read-only view:
        :meth:`refuse` refuses a layer."""
        return MappingProxyType({layer.index: layer.record.why for layer in self.layers
                                 if layer.record.state == "refused"})

    def refuse(self, layer: AttentionLayer, why: str) -> None:
        """Refuse the layout of the book's layer of ``layer.index`` for good (``why``: the message, with what to
        pass): none of its metrics is logged from then on. Under tensor parallelism the book holds each layer as
        this rank computes it (:meth:`AttentionLayer.on_this_rank`), so a layer another rank refused is refused
        here by its index."""
        record = self._by_index[layer.index].record
        record.state, record.why = "refused", why

    def settled(self, layer: AttentionLayer) -> bool:
        """Whether the layer's layout was confirmed against the kernel (or read from it): nothing to check."""
        return layer.record.settled

    def observe(self, layer: AttentionLayer, obs: CapturedCall, n: int) -> Verdict:
        """Decide on one attention call of the layer (first ``n`` sequences); the verdict says what was compared
        and, with ``problem`` set, why the call (``call_only``) or the whole layer is not measured."""
        record = layer.record
        if record.settled:
            return Verdict(checked=record.checked)
        if record.state == "refused":
            return Verdict(problem=record.why)
        verdict = self._decide(layer, obs, n)
        for q, k in () if _settles(verdict) else obs.seen.others:  # another product made the logits?
            other = self._decide(layer, replace(obs, seen=obs.seen.with_qk(q, k)), n)
            if _settles(other):
                verdict = other
                break
        self._settle(layer, verdict)
        return verdict

    def _decide(self, layer: AttentionLayer, obs: CapturedCall, n: int) -> Verdict:
        """The verdict on one call read with the module's inputs batch-first, or time-first where that fits
        better (B == T: either reading fits the shapes)."""
        first, second = compare(layer, obs, n)
        verdict = self._judge(layer, obs, first, n)
        if (verdict.problem is not None or verdict.checked in ("shapes", "q")) and second is not None:
            other = self._judge(layer, obs, second, n)
            if other.problem is None and other.checked in ("q", "q,k") and other.checked != verdict.checked:
                verdict = other
        return verdict

    def unconfirmable_call(self, layer: AttentionLayer, why: str) -> None:
        """The layer's forward showed nothing to compare a layout with (``why``: an attention call the capture
        does not read, or none at all): a proposal from names or shapes is refused, with it offered as a spec
        (nothing can confirm it); any other layout stands."""
        if layer.record.state == "proposed":
            self.refuse(layer, unconfirmed(layer, "shapes", why=f"{why}, so the computation cannot confirm a "
                                           "split").problem)

    # ------------------------------------------------------------------ decisions

    def _settle(self, layer: AttentionLayer, verdict: Verdict) -> None:
        record = layer.record
        if verdict.adopt is not None:
            self._adopt(layer, verdict.adopt, verdict.observed)
        elif verdict.problem is not None:
            if not verdict.call_only:  # the layout itself is suspect: every metric of the layer is dropped
                self.refuse(layer, verdict.problem)
            return
        if _settles(verdict):
            record.checked, record.between = verdict.checked, verdict.between
            record.state = "adopted" if verdict.adopt is not None else "confirmed"
            if verdict.between:
                log.info("diag: %s: between its projections and the attention kernel the module applies %s; the "
                         "weight-side signals are read from the weights, the attention statistics from what the "
                         "kernel received", layer.name, verdict.between)

    def _adopt(self, layer: AttentionLayer, inferred: QKVLayout, observed: str) -> None:
        """Install the inferred layout, keeping the layer's W_O where it still fits (else one named like an
        output projection, else none)."""
        record = layer.record
        params = dict(layer.module.named_parameters())
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        layout, o = inferred, None
        if record.layout.o is not None and record.o is not None:
            kept = replace(inferred, o=record.layout.o, o_transposed=record.layout.o_transposed)
            if shape_problem(kept, {**shapes, record.layout.o: tuple(record.o.shape)}) is None:
                layout, o = kept, record.o
        if o is None:
            layout = generic_o(module_view(layer.name, layer.module), inferred)
            o = None if layout.o is None else params[layout.o]
        record.layout, record.o, record.why = layout, o, observed
        log.info("diag: %s: layout read from the computation: %s (%s)", layer.name, layout.describe(), observed)

    # ------------------------------------------------------------------ the check of one reading

    def _judge(self, layer: AttentionLayer, obs: CapturedCall, found: Comparison, n: int) -> Verdict:
        """What one reading of the call means for the layout; one that disagrees with the kernel's q and k is
        read from them (adopt: when discovery proposed it; refused with the spec read when a spec gave it)."""
        lay, seen = layer.layout, obs.seen
        if not found.token_attention and not (lay.adapter == "computation" and found.visible):
            # (a proposal from shapes alone may simply have the head count wrong: read the kernel first)
            if is_provisional(lay):  # nothing to confirm the names' proposal with: offered as a spec, not guessed
                return unconfirmed(layer, "shapes", why=(
                    "its attention call is not (batch, heads, queries, keys) over tokens (a head count or head "
                    "size no split of its projections gives, e.g. attention across channels), so the computation "
                    "cannot confirm a split; with the layout passed as a spec, the weight-side signals are "
                    "measured and the attention statistics left out"))
            return not_this_attention(layer, seen)
        if found.problem is None:
            return self._unchecked(layer, found.checked)
        if not found.visible:
            return unconfirmed(layer, "heads", seen.heads) if is_provisional(lay) else refuse(layer, found.problem)
        try:
            return self._from_computation(layer, found.problem, obs, found.inputs, n)
        except Exception as err:  # noqa: BLE001 - e.g. sharded weights: the layer is refused, never left unchecked
            return refuse(layer, f"{found.problem}; reading the layout from the computation failed ({err!r})")

    def _unchecked(self, layer: AttentionLayer, checked: str) -> Verdict:
        """No disagreement: what was compared, unless that leaves a guess standing (a proposal from names
        not compared with q and k; grouped-query heads whose pairing nothing showed)."""
        lay = layer.layout
        if checked == "heads" and 1 < lay.kv_heads < lay.n_heads and lay.adapter != "spec":
            return unpaired(layer)
        if checked in ("q,k", "exact") or not is_provisional(lay):
            return Verdict(checked=checked)
        return unconfirmed(layer, checked)

    def _from_computation(self, layer: AttentionLayer, problem: str, obs: CapturedCall, inputs: Inputs,
                          n: int) -> Verdict:
        seen = obs.seen
        found = read_layout(layer.module, seen.q[:n], seen.k[:n], inputs.x, inputs.kv, layer.layout.cross,
                            obs.between)
        if found.layout is None:
            return refuse(layer, problem, None, found.observed)
        shapes = {name: tuple(p.shape) for name, p in layer.module.named_parameters()}
        names_known = all(name in shapes for name in layer.layout.param_names)
        between = ", ".join(found.through)
        if names_known and same_split(found.layout, layer.layout, shapes):  # a norm or a clamp in between
            return Verdict(checked="q,k", between=between)
        if layer.layout.adapter == "spec":
            return refuse(layer, problem, found.layout, found.observed)
        return Verdict(checked="q,k", adopt=found.layout, observed=found.observed, between=between)


def _settles(verdict: Verdict) -> bool:
    """The call confirmed the layout (or the layout read from it) against the kernel's q and k, or exactly."""
    return verdict.problem is None and verdict.checked in ("q,k", "exact")
