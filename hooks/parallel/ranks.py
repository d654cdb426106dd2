"""This process's rank and the job's size: 0 and 1 unless ``torch.distributed`` is initialised. Only rank 0 writes
files (the Monitor's ``logdir`` sinks and ``alerts.jsonl``)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank", "world_size"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
