"""The bottom stage of hooks, parallelism: what a rank holds of the model and how the ranks share what they measure.

``ranks`` (this process's rank and the job's size), ``dtensors`` (whether a tensor is a DTensor, its local shard,
the modules FSDP2 manages), ``heads`` (which heads of a layer a tensor-parallel rank holds), ``gather`` (whole
tensors from sharded DTensors), ``work`` and ``headgather`` (the heads each rank measures and the one gather of
their scalars), ``owners`` (FSDP2 alone: each layer measured by one owner rank, one all-reduce of scalars),
``splits`` (the step limit's matrices split across ranks) and ``detectors`` (the detectors across ranks: every
rank stops together on a critical alert). It imports no other stage: the stages above ask it, and it reads a
layer through the fields it needs (:class:`hooks.parallel.headgather.BlockLayer`).
"""
