"""``analyze --probe``: attention signals of checkpoints, by running the model built from its config.

Only Hugging Face model folders qualify: ``config.json`` names a built-in
``transformers`` architecture (``architectures[0]``), which is built from the
config alone (no code from the checkpoint, no ``trust_remote_code``), every
dropout set to 0, eager attention. Each checkpoint's weights are loaded into it
and one forward on the probe inputs runs under the live capture
(:class:`hooks.capture.capture.AttentionCapture`, training mode and grad enabled as it
requires; nothing is backpropagated), so the numbers are those the Monitor would
log for that batch.

Probe inputs: a text file of token ids (whitespace-separated integers, one
sequence per line, cut to the shortest line), or plain text when the model
folder holds a tokenizer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from diag.errors import DiagError
from diag.layouts.statedict import StateDictLayer
from diag.offline.checkpoint import Checkpoint
from diag.outputs.records import LayerArrays, attention_metrics, host_arrays
from hooks.capture.capture import AttentionCapture
from hooks.checkpoint.architecture import architecture
from hooks.layout.discover import AttentionLayer, discover

__all__ = ["Probe", "ProbeError"]


class ProbeError(DiagError):
    """The model cannot be built from the checkpoint's config, or the probe inputs are unusable."""


def _build(ckpt: Checkpoint) -> nn.Module:
    import transformers

    config = dict(ckpt.config)
    arch, cls = architecture(config)
    if cls is None or "model_type" not in config:
        raise ProbeError(f"{ckpt.path}: --probe needs a Hugging Face model folder whose config.json names a "
                         f"built-in transformers architecture; found architectures={arch!r}. Drop --probe for "
                         "weight-side metrics only")
    for key, value in config.items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            config[key] = 0.0
    cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    return cls._from_config(cfg, attn_implementation="eager").train()


def _read_ids(path: Path, folder: Path) -> Tensor:
    lines = [ln.split() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ProbeError(f"--probe {path}: the file is empty; write token ids or text, one sequence per line")
    if all(tok.isdigit() for line in lines for tok in line):
        rows = [[int(tok) for tok in line] for line in lines]
    else:
        try:
            from transformers import AutoTokenizer

            # never code from the folder (auto_map), never the network, never an interactive prompt
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ProbeError(f"--probe {path} holds text but {folder} has no usable tokenizer ({err}); "
                             "write whitespace-separated token ids instead") from None
        rows = [tokenizer(" ".join(line))["input_ids"] for line in lines]
    length = min(len(r) for r in rows)
    return torch.tensor([r[:length] for r in rows], dtype=torch.long)  # (B, T)


class Probe:
    """A callable for :func:`diag.offline.series.analyze_checkpoints`: checkpoint -> attention arrays per layer."""

    def __init__(self, inputs: str | Path, attn_seqs: int = 2, attn_rank_rows: int = 256) -> None:
        self.inputs = Path(inputs)
        if not self.inputs.is_file():
            raise ProbeError(f"--probe {self.inputs}: no such file; pass a file of token ids or text")
        self.attn_seqs, self.attn_rank_rows = attn_seqs, attn_rank_rows
        self.model: nn.Module | None = None
        self.layers: list[AttentionLayer] = []
        self.ids: Tensor | None = None

    def identity(self) -> str:
        """What the arrays depend on besides the checkpoint: the inputs' bytes and the capture's settings (the
        name of a stored unit, :mod:`diag.offline.store`)."""
        digest = hashlib.sha256(self.inputs.read_bytes()).hexdigest()
        return f"probe {digest} seqs={self.attn_seqs} rank_rows={self.attn_rank_rows}"

    def __getstate__(self) -> dict:
        """Sent to a worker process (``--jobs``) without the model it built: the worker builds its own."""
        return {**self.__dict__, "model": None, "layers": [], "ids": None}

    def __call__(self, ckpt: Checkpoint, layers: list[StateDictLayer]) -> LayerArrays:
        try:
            return self._measure(ckpt, layers)
        except DiagError:
            raise
        except Exception as err:  # noqa: BLE001 - a config or inputs the model cannot take: only the probe fails
            why = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            raise ProbeError(f"{ckpt.path}: the model built from its config.json cannot run the probe inputs "
                             f"({type(err).__name__}: {why}); check config.json and the token ids, or drop "
                             "--probe") from None

    def _measure(self, ckpt: Checkpoint, layers: list[StateDictLayer]) -> LayerArrays:
        if self.model is None:
            self.model = _build(ckpt)
            self.layers = discover(self.model)
            self.ids = _read_ids(self.inputs, ckpt.path if ckpt.path.is_dir() else ckpt.path.parent)
        if [la.label for la in self.layers] != [la.label for la in layers]:
            raise ProbeError(f"{ckpt.path}: the built model's attention layers {[la.name for la in self.layers]} "
                             f"differ from the checkpoint's {[la.name for la in layers]}")
        self._load(ckpt)
        capture = AttentionCapture(self.layers, self.attn_seqs, self.attn_rank_rows)
        capture.arm()
        try:
            with torch.enable_grad():
                self.model(input_ids=self.ids)
        finally:
            results, problems = capture.take()
        missing = [la.name for la in self.layers if la.index not in results]
        if missing:
            why = problems.get(next(la.index for la in self.layers if la.name == missing[0]), "not seen")
            raise ProbeError(f"{ckpt.path}: attention of {missing[0]} not measured: {why}")
        return host_arrays([(la.label, attention_metrics(results[la.index])) for la in self.layers])

    def _load(self, ckpt: Checkpoint) -> None:
        assert self.model is not None
        state = ckpt.tensors.read(ckpt.tensors.shapes)
        with torch.no_grad():
            result = self.model.load_state_dict(state, strict=False)
        own = {f"{la.name}.{n}" for la in self.layers for n in la.layout.param_names}
        if result.unexpected_keys or own & set(result.missing_keys):
            raise ProbeError(f"{ckpt.path}: its tensors do not fit the model built from its config "
                             f"(unexpected {result.unexpected_keys[:3]}, missing {result.missing_keys[:3]})")
