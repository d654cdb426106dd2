"""Runs of models we did not write, trained as such models usually are: the healthy side of the evaluation.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs hf --model gpt2 --seed 0 --lr 1e-3 --steps 1000 \\
        --warmup 100 --schedule cosine --every 0 --out RUNS_DIR

Five families built from configs (4 layers of 4 heads, d_model 128; nothing downloaded; the library's own
``sdpa`` attention): Hugging Face GPT-2 and LLaMA (2 key/value heads: grouped-query attention) as causal
language models and two BERT-style masked language models (15% of the tokens masked), all on bytes of the
Python standard library's source (context 128, batch 8), and a ViT classifying scikit-learn's 8x8 digits (2x2
patches: 16 tokens and a class token, batch 64). The two masked language models: BERT itself (learned absolute
positions, post-LN), which at this size stays at the corpus's context-free loss for about 2,000 steps
(docs/alerts.md#masked-language-models-a-plateau-at-the-context-free-loss), and ModernBERT (rotary positions,
pre-LN, a fused ``Wqkv``; every layer global), which leaves it within 150 steps (design seed 0: 2.84 nats over
steps 100-149, against 3.14): the healthy BERT-style run (evaluation.seeds.HF_FAMILIES6). AdamW (betas 0.9/0.95,
weight decay 0.1), gradient clipping at 1, a constant learning rate or 100 warmup steps then cosine decay. The
Monitor samples every family every ``--every`` steps, or with ``--every 0`` is attached as a user would, with no
arguments (the default cadence). ``--normsoftmax`` trains the
same run with NormSoftmax attention (Hoffmann et al.: the logits divided by their standard deviation over the
keys, temperature 0.5), registered as a transformers attention function: the causal twin of a plateau (a
plateau that attention causes is one the twin leaves much faster). The twin's attention is not one the Monitor
reads (a custom kernel is refused and reported); its losses are what the twin test uses.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

from evaluation.lm import corpus as text_of
from evaluation.recording import recording
from evaluation.spec import RunSpec
from hooks import Monitor
from hooks.demo import adamw, train_steps

__all__ = ["build", "train_spec", "normsoftmax_attention"]

transformers.logging.set_verbosity_error()
SHAPE = {"layers": 4, "heads": 4, "width": 128, "context": 128, "batch": 8}  # a spec's 0s
VOCAB = 256  # bytes; the masked models' [MASK] is id 256
MASK_ID = VOCAB
TEMPERATURE = 0.5
MASKED = ("bert", "modernbert", "roformer")  # the masked language models


def _exact(query, key, value, valid, scale):
    """NormSoftmax over the full logit matrix: any mask, every weight returned (the reference of the fast path)."""
    s = (query @ key.transpose(-1, -2)) * scale  # (B, H, T, S)
    count = valid.sum(-1, keepdim=True).clamp_min(1)
    mean = (s * valid).sum(-1, keepdim=True) / count
    # + 1e-6 under the root: a row with one visible key has no spread, and sqrt's gradient at 0 is infinite
    std = ((((s - mean) * valid) ** 2).sum(-1, keepdim=True) / count + 1e-6).sqrt()
    s = (s / (TEMPERATURE * std + 1e-6)).masked_fill(~valid, float("-inf"))
    weights = torch.softmax(s, dim=-1)  # (B, H, T, S)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _spread(query, key, causal: bool):
    """The variance, over the keys a query sees, of its logits q.k (unscaled), without the logit matrix: q^T C q
    with C the covariance of those keys, from the keys' running first and second moments (causal: query t sees
    keys 0..t) or all keys' moments. The keys are centred first (a shift of every key moves all of a query's
    logits together and leaves their spread unchanged) so the difference of moments does not cancel. In float32
    at least, whatever the autocast dtype. (B, H, T)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    q, k = query.to(dtype), key.to(dtype)
    k = k - k.mean(-2, keepdim=True).detach()
    if causal:
        count = torch.arange(1, k.shape[-2] + 1, device=k.device, dtype=k.dtype).unsqueeze(-1)
        m1 = k.cumsum(-2) / count  # (B, H, T, D)
        m2 = (k.unsqueeze(-1) * k.unsqueeze(-2)).cumsum(-3) / count.unsqueeze(-1)  # (B, H, T, D, D)
        second = torch.einsum("bhtd,bhtde,bhte->bht", q, m2, q)
    else:
        m1 = k.mean(-2, keepdim=True)
        m2 = k.transpose(-1, -2) @ k / k.shape[-2]  # (B, H, D, D)
        second = torch.einsum("bhtd,bhde,bhte->bht", q, m2, q)
    return (second - (q * m1).sum(-1) ** 2).clamp_min(0.0)


def normsoftmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """NormSoftmax attention as a transformers attention function: ``softmax(s / (T * std_keys(s)))`` over the
    keys a query may see (the causal mask from ``module.is_causal``, a padding mask from ``attention_mask``).
    query (B, H, T, D), key and value (B, G, S, D); returns (B, T, H, D) and the weights (None on the fast path).

    Fast path (a causal mask or none, no padding, as in every run here): each query's logit spread comes from the
    keys' moments (:func:`_spread`), the query is scaled by ``scale / (T * std + 1e-6)`` and SDPA does the rest;
    the same function as the full-matrix path, at SDPA's cost instead of the unfused attention's (17x at context
    512 on this CPU). Any other mask takes the full-matrix path (:func:`_exact`)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: query head h reads key head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    t, n = query.shape[-2], key.shape[-2]
    causal = bool(getattr(module, "is_causal", False)) and t > 1
    valid = torch.ones(t, n, dtype=torch.bool, device=query.device)
    if causal:
        valid = valid.tril(n - t)
    if attention_mask is not None:
        mask = attention_mask[..., :n]
        mask = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        both = valid & mask
        if not torch.equal(both, valid.expand_as(both)):  # padding: the full matrix
            return _exact(query, key, value, both, scale)
    if t != n:  # a query block against a longer cache: the full matrix
        return _exact(query, key, value, valid, scale)
    std = (scale**2 * _spread(query, key, causal) + 1e-6).sqrt()  # (B, H, T)
    scaled = query * (scale / (TEMPERATURE * std + 1e-6)).unsqueeze(-1).to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(scaled, key, value, is_causal=causal, scale=1.0)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("normsoftmax", normsoftmax_attention)


def build(name: str, layers: int = 4, heads: int = 4, width: int = 128, context: int = 128,
          twin: str = "") -> torch.nn.Module:
    """The family ``name`` at these sizes, from its config (nothing downloaded); ``twin="qknorm"`` (LLaMA only): the
    same LLaMA with q and k normalised per head (HF Qwen3: LLaMA with an RMSNorm on q and k, which at one seed
    starts from the same weights), the twin that cannot collapse."""
    common = {"hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
              "num_attention_heads": heads}
    if twin == "qknorm" and name != "llama":
        raise ValueError(f"build({name!r}, twin='qknorm'): only llama has a QK-norm twin here (HF Qwen3)")
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=context, n_embd=width, n_layer=layers,
                                      n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":  # 2 key/value heads: grouped-query attention
        kind = transformers.Qwen3Config if twin == "qknorm" else transformers.LlamaConfig
        cfg = kind(vocab_size=VOCAB, num_key_value_heads=2, head_dim=width // heads, tie_word_embeddings=False,
                   max_position_embeddings=context, **common)
        return (transformers.Qwen3ForCausalLM if twin == "qknorm" else transformers.LlamaForCausalLM)(cfg)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB + 1, max_position_embeddings=context,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        return transformers.BertForMaskedLM(cfg)
    if name == "modernbert":
        # the special tokens at byte 0 (NUL: not in the corpus; the padding row of the embedding stays zero), no
        # local (sliding-window) layers: every layer attends to the whole context, as BERT's do
        cfg = transformers.ModernBertConfig(vocab_size=VOCAB + 1, max_position_embeddings=context,
                                            pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0,
                                            sep_token_id=0, global_attn_every_n_layers=1, local_attention=context,
                                            embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
                                            **common)
        return transformers.ModernBertForMaskedLM(cfg)
    if name == "roformer":  # BERT (post-LN) with rotary positions instead of learned absolute ones
        cfg = transformers.RoFormerConfig(vocab_size=VOCAB + 1, max_position_embeddings=context, embedding_size=width,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        return transformers.RoFormerForMaskedLM(cfg)
    if name == "vit":
        cfg = transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, num_labels=10,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        return transformers.ViTForImageClassification(cfg)
    raise ValueError(f"unknown model {name!r}: expected gpt2, llama, bert, modernbert, roformer or vit")


class Batches:
    """The task of each family: next bytes (GPT-2, LLaMA), masked bytes (BERT, ModernBERT, RoFormer), digit classes
    (ViT); ``batch`` sequences of ``context`` bytes of ``corpus`` (the ViT: 64 images)."""

    def __init__(self, name: str, seed: int, context: int = 128, batch: int = 8, corpus: str = "stdlib") -> None:
        self.name, self.context, self.batch = name, context, batch
        self.gen = torch.Generator().manual_seed(seed)
        if name == "vit":
            from sklearn.datasets import load_digits

            digits = load_digits()
            self.images = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]  # (N, 1, 8, 8)
            self.labels = torch.tensor(digits.target, dtype=torch.long)  # (N,)
        else:
            self.data = torch.frombuffer(bytearray(text_of(corpus).encode()), dtype=torch.uint8).long()

    def __call__(self) -> dict:
        if self.name == "vit":
            at = torch.randint(0, len(self.labels), (64,), generator=self.gen)
            return {"pixel_values": self.images[at], "labels": self.labels[at]}
        context = self.context
        at = torch.randint(0, self.data.numel() - context - 1, (self.batch,), generator=self.gen)
        ids = torch.stack([self.data[i : i + context] for i in at.tolist()])  # (B, T)
        if self.name not in MASKED:
            return {"input_ids": ids, "labels": ids}
        masked = torch.rand(ids.shape, generator=self.gen) < 0.15
        return {"input_ids": ids.masked_fill(masked, MASK_ID), "labels": ids.masked_fill(~masked, -100)}


def sizes(spec: RunSpec) -> dict[str, int]:
    """The spec's layers, heads, width, context and batch, each the default's (:data:`SHAPE`) where it names none."""
    return {k: getattr(spec, k) or v for k, v in SHAPE.items()}


def train_spec(spec: RunSpec, out: Path) -> dict:
    """Train the run, recorded into ``out``; returns its every-step losses and the mean of its last 50."""
    if spec.twin == "normsoftmax" and spec.model == "roformer":
        raise ValueError("RunSpec(model='roformer', twin='normsoftmax'): RoFormer computes its attention in its own "
                         "code, not through a transformers attention function, so it has no NormSoftmax twin; "
                         "leave --normsoftmax out, or take modernbert (rotary positions too) for a twin")
    size = sizes(spec)
    torch.manual_seed(spec.seed)
    model = build(spec.model, size["layers"], size["heads"], size["width"], size["context"],
                  twin="qknorm" if spec.twin == "qknorm" else "")
    model.config._attn_implementation = "normsoftmax" if spec.twin == "normsoftmax" else "sdpa"
    optimizer = adamw(model, spec.lr)
    batches = Batches(spec.model, spec.seed, size["context"], size["batch"], spec.corpus)
    autocast = torch.bfloat16 if spec.autocast == "bf16" else None
    with recording(Monitor(model, every=spec.every or None), out / "observations.jsonl") as monitor:
        losses = train_steps(model, batches, lambda batch: model(**batch).loss, optimizer, spec.steps,
                             schedule=spec.lr_schedule, clip=1.0, autocast=autocast, monitor=monitor)
    return {"losses": losses, "final_loss": float(sum(losses[-50:]) / len(losses[-50:])) if losses else math.nan}
