"""DTensors as one rank sees them: whether a tensor is one, its local shard, and which modules FSDP2 manages.

``torch.distributed.tensor`` and ``torch.distributed.fsdp`` are never imported just to check: where nothing
imported them, no tensor is a DTensor and no module an ``FSDPModule``.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["dtensor_type", "is_dtensor", "local_tensor", "fsdp_managed"]


def dtensor_type() -> type | None:
    """DTensor, if anything imported it (otherwise no tensor can be one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t: object) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local_tensor(t: object) -> object:
    """A DTensor's local shard (under tensor parallelism inside a forward: this rank's heads of a weight, or
    the whole of a replicated input); anything else as it is. No collective."""
    return t.to_local() if is_dtensor(t) else t


def fsdp_managed(model: nn.Module) -> frozenset[str]:
    """Names of the modules of ``model`` that are FSDP2 ``FSDPModule``s (their parameters are sharded by it)."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None:
        return frozenset()
    return frozenset(name for name, module in model.named_modules() if isinstance(module, fsdp))
