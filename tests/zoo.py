"""Tiny models of every architecture the tests exercise, built offline from configs.

Each builder returns (model, make_batch, loss_fn); make_batch(gen) draws a batch
from the given generator (never the global RNG), loss_fn(model, batch) returns a
scalar loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH = 50, 12, 3


@dataclass
class Case:
    name: str
    model: nn.Module
    make_batch: Callable[[torch.Generator], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]


# ---------------------------------------------------------------- nanoGPT-style


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

    def reference_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Eager attention probabilities (B, nh, T, T), float64."""
        b, t, c = x.shape
        q, k, _ = self.c_attn(x).double().split(self.n_embd, dim=2)
        q = q.view(b, t, self.n_head, -1).transpose(1, 2)
        k = k.view(b, t, self.n_head, -1).transpose(1, 2)
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        return att.softmax(-1)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab=VOCAB, block=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _tokens(gen: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)}


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def nanogpt(dropout: float = 0.1) -> Case:
    torch.manual_seed(0)
    model = NanoGPT(dropout=dropout)
    return Case("nanogpt", model, _tokens, lambda m, b: _lm_loss(m(b["input_ids"]), b["input_ids"]))


# ---------------------------------------------------------------- Hugging Face


def _hf_lm_loss(m: nn.Module, b: dict) -> torch.Tensor:
    return m(**b, labels=b["input_ids"]).loss


def _padded_tokens(gen: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4 :] = 0  # right padding in the second sequence
    return {"input_ids": ids, "attention_mask": mask}


def gpt2(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=attn)
    return Case(f"gpt2-{attn}", model, _padded_tokens, _hf_lm_loss)


def llama(attn: str = "eager", kv_heads: int = 2, dropout: float = 0.1) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attention_dropout=dropout, initializer_range=0.2)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    return Case(f"llama-{attn}", model, _padded_tokens, _hf_lm_loss)


# ---------------------------------------------------------------- torch


class EncoderClassifier(nn.Module):
    def __init__(self, d=32, heads=4, layers=2, dropout=0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.emb(ids), src_key_padding_mask=pad))


def _encoder_batch(gen: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[1, SEQ - 3 :] = True
    return {"input_ids": ids, "pad": pad}


def torch_encoder() -> Case:
    torch.manual_seed(0)
    model = EncoderClassifier()

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        logits = m(b["input_ids"], b["pad"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), b["input_ids"].reshape(-1))

    return Case("torch-encoder", model, _encoder_batch, loss)


CASES: dict[str, Callable[[], Case]] = {
    "nanogpt": nanogpt,
    "gpt2-eager": lambda: gpt2("eager"),
    "gpt2-sdpa": lambda: gpt2("sdpa"),
    "llama-eager": lambda: llama("eager"),
    "llama-sdpa": lambda: llama("sdpa"),
    "torch-encoder": torch_encoder,
}
