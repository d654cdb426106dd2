"""The layout stage (above parallel): which modules are attention and where their W_Q, W_K, W_V, W_O are.

``discover`` finds the layers and proposes a layout for each from names and shapes (a ``record`` per layer);
``book`` (:class:`LayoutBook`) decides each layer's layout on what the capture saw, and is asked by the capture,
the Monitor and the step limit: ``confirm`` compares a layout with the q and k an attention kernel received,
``read`` reads one from them where the two disagree, ``refusals`` words a refusal; ``suspects`` words the
refusal when no layer is found.
"""

from hooks.layout.book import LayoutBook
from hooks.layout.discover import AttentionLayer, discover
from hooks.layout.record import LayoutRecord

__all__ = ["AttentionLayer", "LayoutBook", "LayoutRecord", "discover"]
