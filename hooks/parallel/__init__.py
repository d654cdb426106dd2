"""The stage of parallelism: what a rank holds of the model and how the ranks share what they measure.

``ranks`` (this process's rank and the job's size), ``heads`` (which heads of a layer a tensor-parallel rank
holds), ``gather`` (whole tensors from sharded DTensors), ``work`` and ``headgather`` (the heads each rank
measures and the one gather of their scalars), ``splits`` (the step limit's matrices split across ranks) and
``detectors`` (the detectors across ranks, so every rank stops together).
"""
