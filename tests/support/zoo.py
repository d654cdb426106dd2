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


def torch_encoder(dropout: float | None = None) -> Case:
    """``dropout``: None keeps the encoder's defaults; a number sets every dropout to it, the attention's
    (a float in ``nn.MultiheadAttention``, not a module) included."""
    torch.manual_seed(0)
    model = EncoderClassifier()
    if dropout is not None:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = dropout
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = dropout

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


# ---------------------------------------------------------------- more families (tests/hooks/layout/test_families.py)

HF_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _hf(model_cls, cfg, attn: str) -> nn.Module:
    torch.manual_seed(0)
    return model_cls._from_config(cfg, attn_implementation=attn)


def _mlm_loss(m: nn.Module, b: dict) -> torch.Tensor:
    return m(**b, labels=b["input_ids"]).loss


def bert(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(**HF_SMALL, max_position_embeddings=64, initializer_range=0.2, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    return Case(f"bert-{attn}", _hf(BertForMaskedLM, cfg, attn), _padded_tokens, _mlm_loss)


def roberta(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(**HF_SMALL, max_position_embeddings=64, pad_token_id=1, initializer_range=0.2,
                        hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    return Case(f"roberta-{attn}", _hf(RobertaForMaskedLM, cfg, attn), _padded_tokens, _mlm_loss)


def _images(gen: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 5, (BATCH,), generator=gen)}


def vit(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(**{k: v for k, v in HF_SMALL.items() if k != "vocab_size"}, image_size=16, patch_size=4,
                    num_labels=5, initializer_range=0.2, hidden_dropout_prob=dropout,
                    attention_probs_dropout_prob=dropout)
    return Case(f"vit-{attn}", _hf(ViTForImageClassification, cfg, attn), _images, lambda m, b: m(**b).loss)


def mistral(attn: str = "eager", kv_heads: int = 2, dropout: float = 0.1) -> Case:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**HF_SMALL, num_key_value_heads=kv_heads, max_position_embeddings=64,
                        attention_dropout=dropout, initializer_range=0.2, sliding_window=None)
    return Case(f"mistral-{attn}", _hf(MistralForCausalLM, cfg, attn), _padded_tokens, _hf_lm_loss)


def qwen3(attn: str = "eager", kv_heads: int = 2, dropout: float = 0.1) -> Case:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**HF_SMALL, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64,
                      attention_dropout=dropout, initializer_range=0.2)
    return Case(f"qwen3-{attn}", _hf(Qwen3ForCausalLM, cfg, attn), _padded_tokens, _hf_lm_loss)


def gpt_neox(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(**HF_SMALL, max_position_embeddings=64, rotary_pct=0.5, attention_dropout=dropout,
                        hidden_dropout=dropout, initializer_range=0.2)
    return Case(f"gpt-neox-{attn}", _hf(GPTNeoXForCausalLM, cfg, attn), _padded_tokens, _hf_lm_loss)


def _seq2seq_batch(gen: torch.Generator) -> dict:
    batch = _padded_tokens(gen)  # source: right padding in the second sequence
    batch["labels"] = torch.randint(3, VOCAB, (BATCH, SEQ - 3), generator=gen)  # a shorter target
    return batch


def t5(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=dropout, decoder_start_token_id=0, initializer_factor=1.0)
    return Case(f"t5-{attn}", _hf(T5ForConditionalGeneration, cfg, attn), _seq2seq_batch, lambda m, b: m(**b).loss)


def bart(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     dropout=dropout, attention_dropout=dropout, init_std=0.2)
    return Case(f"bart-{attn}", _hf(BartForConditionalGeneration, cfg, attn), _seq2seq_batch,
                lambda m, b: m(**b).loss)


def _cross_tokens(gen: torch.Generator) -> dict:
    batch = _padded_tokens(gen)
    batch["encoder_hidden_states"] = torch.randn(BATCH, SEQ - 5, 32, generator=gen)  # another, shorter sequence
    enc_mask = torch.ones(BATCH, SEQ - 5, dtype=torch.long)
    enc_mask[1, -2:] = 0
    batch["encoder_attention_mask"] = enc_mask
    return batch


def gpt2_cross(attn: str = "eager", dropout: float = 0.1) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, add_cross_attention=True,
                     attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    return Case(f"gpt2-cross-{attn}", _hf(GPT2LMHeadModel, cfg, attn), _cross_tokens, _hf_lm_loss)


class Seq2Seq(nn.Module):
    """nn.TransformerEncoder + nn.TransformerDecoder: decoder self-attention and cross-attention (multihead_attn)."""

    def __init__(self, d=32, heads=4, layers=2, dropout=0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        enc = nn.TransformerEncoderLayer(d, heads, dim_feedforward=64, dropout=dropout, batch_first=True)
        dec = nn.TransformerDecoderLayer(d, heads, dim_feedforward=64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, layers)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.emb(src), src_key_padding_mask=src_pad)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.decoder(self.emb(tgt), memory, tgt_mask=causal, memory_key_padding_mask=src_pad,
                           tgt_is_causal=True)
        return self.head(out)


def _torch_seq2seq_batch(gen: torch.Generator) -> dict:
    batch = _encoder_batch(gen)
    batch["tgt"] = torch.randint(0, VOCAB, (BATCH, SEQ - 4), generator=gen)
    return batch


def torch_seq2seq(dropout: float = 0.1) -> Case:
    torch.manual_seed(0)
    model = Seq2Seq(dropout=dropout)

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        logits = m(b["input_ids"], b["tgt"], b["pad"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), b["tgt"].reshape(-1))

    return Case("torch-seq2seq", model, _torch_seq2seq_batch, loss)


FAMILY_BUILDERS: dict[str, Callable[..., Case]] = {
    "bert": bert,
    "roberta": roberta,
    "vit": vit,
    "mistral": mistral,
    "qwen3": qwen3,
    "gpt-neox": gpt_neox,
    "t5": t5,
    "bart": bart,
    "gpt2-cross": gpt2_cross,
}
