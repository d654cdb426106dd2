"""What one training run of the evaluation is: a :class:`RunSpec` (its task, seed, learning rate and schedule,
twin, shape, corpus, context and batch, precision, threads and the Monitor's interval, what the run is for),
and the folder name that says it."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hooks.demo import Schedule

__all__ = ["EVERYS", "PURPOSES", "TASKS", "RunSpec"]

TASKS = ("lm", "vit", "hf", "finetune")
EVERYS = ("default", 2, 5, 10, 20)  # the cadences a run recorded every step is replayed at ("default": the Monitor's)
# what a run is for, which says how it is judged: a collapse run against its attention's states and its QK-norm
# twin, a Eureka run against its accuracy jump, a healthy run (no warning or critical record may reach it), a
# fine-tune of a model that starts with attention sinks (healthy too, its sinks a baseline state)
PURPOSES = ("collapse", "eureka", "healthy", "sinks")


@dataclass(frozen=True)
class RunSpec:
    task: str  # "lm", "vit", "hf" or "finetune"
    seed: int
    lr: float
    steps: int
    warmup: int = 0
    schedule: str = "constant"  # or "cosine": linear warmup, then cosine decay to 0
    twin: str = ""  # "", "qknorm" (q and k normalised per head) or "normsoftmax"
    layers: int = 0  # 0: the task's default shape
    heads: int = 0
    width: int = 0
    corpus: str = "stdlib"  # lm, hf, finetune: "stdlib" or "pydoc"
    context: int = 0  # lm, hf, finetune: the context length (0: the task's default)
    model: str = ""  # hf: "gpt2", "llama", "bert", "modernbert", "roformer" or "vit"; finetune: "gpt2" or "llama";
    # vit: "" (evaluation.eureka) or "hfvit" (evaluation.eureka_hf)
    threads: int = 1  # torch threads: another reduction order gives the same run other rounding
    every: int = 1  # the Monitor's interval (0: its default cadence)
    batch: int = 0  # lm, hf, finetune: sequences per step (0: the task's default)
    autocast: str = ""  # hf: "bf16" trains under torch.autocast(dtype=torch.bfloat16) on the CPU
    sinks: str = ""  # finetune: "built" (sinks implanted by evaluation.sinks)
    purpose: str = ""  # one of PURPOSES; "": the task's (lm: collapse, vit: eureka past 1,000 steps, hf: healthy)

    def __post_init__(self) -> None:
        for name, allowed in (("task", TASKS), ("schedule", ("constant", "cosine")),
                              ("twin", ("", "qknorm", "normsoftmax")), ("autocast", ("", "bf16")),
                              ("sinks", ("", "built")), ("purpose", ("",) + PURPOSES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RunSpec.{name}={getattr(self, name)!r}: expected one of {allowed}")
        if (self.task == "finetune") != bool(self.sinks):
            raise ValueError(f"RunSpec(task={self.task!r}, sinks={self.sinks!r}): a fine-tune names the sinks its "
                             "model starts with ('built'), and only a fine-tune does")
        if not self.purpose:
            object.__setattr__(self, "purpose", self._task_purpose())

    def _task_purpose(self) -> str:
        if self.task == "finetune":
            return "sinks"
        if self.task == "hf":
            return "healthy"
        return "eureka" if self.task == "vit" and self.steps > 1000 else "collapse"

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
        head = {"hf": f"hf-{self.model}", "finetune": f"ft-{self.model}-{self.sinks}",
                "vit": f"vit-{self.model}" if self.model else "vit"}.get(self.task, self.task)
        parts = [head, f"lr{self.lr:g}"]
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
        if self.batch:
            parts.append(f"b{self.batch}")
        if self.autocast:
            parts.append(self.autocast)
        if self.threads != 1:
            parts.append(f"t{self.threads}")
        return "-".join(parts) + f"-s{self.seed}"

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
