"""One attention layer's layout and where it stands: the record :class:`hooks.layout.book.LayoutBook` keeps.

Discovery writes the first record of each layer (``given`` for a spec's or a named family's layout,
``proposed`` for a generic adapter's, which only a computation can confirm); from then on only the book
changes it. Everything else reads it through the layer (``layer.layout``, ``layer.o``) or asks the book.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from diag.layouts.vocab import QKVLayout

__all__ = ["LayoutRecord", "STATES", "SETTLED"]

# given: a spec's or a named family's layout, trusted until a computation contradicts it;
# proposed: a generic adapter's guess from names, not measured until a computation confirms it;
# confirmed: a computation agreed with it; adopted: read from the computation (it replaced the guess);
# refused: no metric of the layer is logged, ``why`` says why and what to pass.
STATES = ("given", "proposed", "confirmed", "adopted", "refused")
SETTLED = ("confirmed", "adopted")  # the packing cannot change: no further check


@dataclass
class LayoutRecord:
    """A layer's current layout, its W_O, its state and what decided it."""

    layout: QKVLayout
    o: nn.Parameter | None = field(default=None, repr=False)  # W_O (``layout.o``)
    state: str = "given"
    why: str = ""  # refused: the message (with the spec to pass); adopted: what the computation showed
    checked: str = ""  # confirmed or adopted: what the check compared ("q,k", "exact")
    between: str = ""  # what the module does between its projections and the kernel, where something was seen

    @property
    def settled(self) -> bool:
        return self.state in SETTLED
