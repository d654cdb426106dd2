"""What one training run of the evaluation is: a :class:`RunSpec` (its task, seed, learning rate and schedule,
twin, shape, corpus, threads and the Monitor's interval), and the folder name that says it."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hooks.demo import Schedule

__all__ = ["RunSpec"]


@dataclass(frozen=True)
class RunSpec:
    task: str  # "lm", "vit" or "hf"
    seed: int
    lr: float
    steps: int
    warmup: int = 0
    schedule: str = "constant"  # or "cosine": linear warmup, then cosine decay to 0
    twin: str = ""  # "", "qknorm" (LayerNorm on q and k per head) or "normsoftmax"
    layers: int = 0  # 0: the task's default shape
    heads: int = 0
    width: int = 0
    corpus: str = "stdlib"  # lm: "stdlib" or "pydoc"
    context: int = 0  # lm: the context length (0: the demo's 128)
    model: str = ""  # hf: "gpt2", "llama", "bert", "modernbert", "roformer" or "vit"
    threads: int = 1  # torch threads: another reduction order gives the same run other rounding
    every: int = 1  # the Monitor's interval (0: its default cadence)

    def __post_init__(self) -> None:
        if self.task not in ("lm", "vit", "hf"):
            raise ValueError(f"RunSpec.task={self.task!r}: expected 'lm', 'vit' or 'hf'")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"RunSpec.schedule={self.schedule!r}: expected 'constant' or 'cosine'")
        if self.twin not in ("", "qknorm", "normsoftmax"):
            raise ValueError(f"RunSpec.twin={self.twin!r}: expected '', 'qknorm' or 'normsoftmax'")

    @property
    def lr_schedule(self) -> Schedule:
        """The learning rate of each step as a fraction of ``lr``."""
        return Schedule(self.warmup, self.schedule, self.steps)

    @property
    def shape(self) -> dict[str, int]:
        """The model's layers, heads and width where they differ from the task's default (``n_layer``, ``n_head``,
        ``n_embd``)."""
        return {k: v for k, v in (("n_layer", self.layers), ("n_head", self.heads), ("n_embd", self.width)) if v}

    @property
    def name(self) -> str:
        """A folder name that says what differs from the task's default, and the seed."""
        parts = [self.task if self.task != "hf" else f"hf-{self.model}", f"lr{self.lr:g}"]
        if self.warmup:
            parts.append(f"w{self.warmup}")
        if self.schedule != "constant":
            parts.append(self.schedule)
        if self.twin:
            parts.append(self.twin)
        if self.layers or self.heads or self.width:
            parts.append(f"{self.layers}x{self.heads}x{self.width}")
        if self.corpus != "stdlib":
            parts.append(self.corpus)
        if self.context:
            parts.append(f"ctx{self.context}")
        if self.threads != 1:
            parts.append(f"t{self.threads}")
        return "-".join(parts) + f"-s{self.seed}"

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
