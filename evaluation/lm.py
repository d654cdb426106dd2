"""The collapse reproduction's task (``RunSpec(task="lm")``): the demo's character-level GPT, trained as a spec says.

The GPT of ``hooks.demo`` (4 layers of 2 heads, d_model 128, context 128, batch 16, AdamW betas 0.9/0.95,
weight decay 0.1) on the standard library's source (``corpus="stdlib"``) or on the English text of Python's own
documentation (``corpus="pydoc"``: ``pydoc_data.topics``), with the spec's learning-rate schedule, optionally
with QK-norm (the twin that cannot collapse) or NormSoftmax attention (the causal twin of a plateau: the logits
over the keys a query sees divided by their standard deviation, Hoffmann et al.;
:func:`evaluation.healthy.normsoftmax_attention`) and at another width, depth, context and batch. A run recorded at
every step keeps its attention maps' measurements too (``attention.npz``, :mod:`evaluation.maps`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from evaluation.recording import recording
from evaluation.spec import RunSpec
from hooks import Monitor
from hooks.demo import GPT, GPTConfig, SelfAttention, adamw, encode, get_batch, load_text, train_steps

__all__ = ["NormSoftmaxAttention", "build", "corpus", "train_spec"]


def corpus(name: str) -> str:
    """The text of a corpus: the standard library's source, or the English of Python's documentation."""
    if name == "stdlib":
        return load_text()
    if name == "pydoc":
        import pydoc_data.topics

        return "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    raise ValueError(f"unknown corpus {name!r}: expected 'stdlib' or 'pydoc'")


class NormSoftmaxAttention(SelfAttention):
    """The demo's causal attention with NormSoftmax in place of the softmax (the same weights, the same mask)."""

    is_causal = True  # what normsoftmax_attention reads for the causal mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from evaluation.healthy import normsoftmax_attention

        out, _ = normsoftmax_attention(self, q, k, v, None)  # (B, T, nh, hs)
        return out.transpose(1, 2)  # (B, nh, T, hs)


def build(spec: RunSpec, vocab: int) -> tuple[GPT, GPTConfig]:
    """The run's GPT (seeded by the caller): softmax, QK-norm or NormSoftmax attention."""
    sizes = {k: v for k, v in (("block_size", spec.context), ("batch_size", spec.batch)) if v}
    cfg = GPTConfig(vocab_size=vocab, qk_norm=spec.twin == "qknorm", **spec.shape, **sizes)
    model = GPT(cfg)
    if spec.twin == "normsoftmax":  # the same parameters in the same order: only attend changes
        for block in model.h:
            block.attn.__class__ = NormSoftmaxAttention
    return model, cfg


def train_spec(spec: RunSpec, out: Path) -> dict:
    """Train the run, recorded into ``out``; returns its every-step losses."""
    data, vocab = encode(corpus(spec.corpus))
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    model, cfg = build(spec, vocab)
    optimizer = adamw(model, spec.lr)
    maps = out / "attention.npz" if spec.every == 1 else None  # the ground truth's attention maps (evaluation.maps)
    with recording(Monitor(model, every=spec.every or None), out / "observations.jsonl", maps) as monitor:
        losses = train_steps(model, lambda: get_batch(data, cfg, gen), lambda batch: model(*batch), optimizer,
                             spec.steps, schedule=spec.lr_schedule, monitor=monitor)
    return {"losses": losses}
