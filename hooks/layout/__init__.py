"""Stage 1, the layout: which modules are attention and where their W_Q, W_K, W_V, W_O are.

``discover`` finds the layers and proposes a layout for each from names and shapes; ``confirm``
checks a layout against the q and k an attention kernel received and ``read`` reads one from them
where the two disagree; ``suspects`` words the refusal when no layer is found.
"""

from hooks.layout.discover import AttentionLayer, discover

__all__ = ["AttentionLayer", "discover"]
