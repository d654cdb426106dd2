"""Where W_Q, W_K, W_V, W_O sit in a module or a state dict and how they are packed.

The layout vocabulary (`QKVLayout`, `split_qkv`), the adapters that find it, and state-dict keys. A new layout
or adapter goes here.
"""

from diag.layouts.adapters import ADAPTERS, ModuleView, find_layout
from diag.layouts.vocab import QKVLayout, split_o, split_projections, split_qkv

__all__ = ["ADAPTERS", "ModuleView", "QKVLayout", "find_layout", "split_o", "split_projections", "split_qkv"]
