"""A tiny LLaMA written as torchtitan writes it (``torchtitan/models/llama3/model``: ``attention.wq/wk/wv/wo``,
``attention_norm``, ``feed_forward.w1/w2/w3``, ``tok_embeddings``, ``norm``, ``output``), with torchtitan's
tensor- and sequence-parallel plan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``), so the
tests run the plan people use for 70B on the model shape it was written for. Rotary embeddings as cos/sin
(torchtitan uses complex ``freqs_cis``; the rotation is the same); no qk-norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D) rotated by rope (2, T, D // 2): cos, sin per position and frequency."""
    cos, sin = rope[0][None, :, None], rope[1][None, :, None]
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1: under tensor parallelism the projections give this rank's heads only (as torchtitan's view)
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = _rotate(xq, rope), _rotate(xk, rope)
        rep = xq.shape[2] // xk.shape[2]
        xk, xv = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 hidden: int = 64, max_seq: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden)
                                     for i in range(n_layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        d = dim // n_heads
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(max_seq).float(), freqs)  # (T, D / 2)
        self.register_buffer("rope", torch.stack([angles.cos(), angles.sin()]), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        rope = self.rope[:, : ids.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))


def apply_tp(model: Transformer, tp_mesh) -> None:
    """torchtitan's ``apply_tp`` (llama3, without float8, loss parallelism or qk-norm): the embedding's output
    and the norms sequence-parallel, Q/K/V and w1/w3 colwise, W_O and w2 rowwise back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
