"""Models that start with attention sinks: byte-level Hugging Face GPT-2 and LLaMA whose sequences begin with a BOS
token, sinks built into chosen heads, and the share of attention each head gives position 0.

A built-in sink (:func:`implant`), as trained language models carry them (Xiao et al. 2024; Sun et al. 2024,
massive activations): BOS carries a massive activation in two residual dimensions that nothing else writes; in
each chosen head the query has a constant component (a bias) along a direction ``u`` and the key reads the
massive dimensions into ``u``, so every query's logit to BOS is ``margin`` above its logits to other keys
(``margin`` drawn per head, 6-14: from sinks that hold most of a head's attention to sharp ones); BOS's value
reads nothing of its massive dimensions (about 0: a no-op for the heads that attend to it).

* GPT-2 (learned absolute positions, a fused ``c_attn``): ``u`` a random unit direction of the head.
* LLaMA (rotary positions, grouped-query attention: 2 key/value heads; built with attention biases): ``u`` in the
  head's lowest-frequency rotary pair, which turns by ``position / 10000**((d-2)/d)`` radians (0.32 at position
  1,024 for d 16), so the logit to BOS, ``margin * cos(angle)``, holds over the whole context. The pair carries
  nothing else in the sink heads' queries and in every key, so BOS is the only key it reaches.

:func:`built` makes one deterministically from a seed: a short pre-train (sink-free) on the standard library's
source, then the implant. :func:`mass_on_first` measures the sinks from the model's own attention
(``output_attentions`` under eager attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers

from hooks.demo import Schedule, adamw, train_steps

__all__ = ["BOS", "VOCAB", "bos_batches", "build", "built", "implant", "load", "mass_on_first", "save",
           "sink_heads"]

BOS = 256  # the bytes, then BOS
VOCAB = 257
MASSIVE = (0, 1)  # the residual dimensions of BOS's massive activation
ACTIVATION = 60.0
MARGINS = (6.0, 14.0)  # the logit to BOS over the others, drawn per sink head
PRETRAIN = {"steps": 200, "context": 256, "batch": 8, "lr": 1e-3, "warmup": 20}
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def build(family: str, layers: int = 4, heads: int = 8, width: int = 128, context: int = 512) -> torch.nn.Module:
    """A byte-level causal language model with BOS (id 256), untied output embedding, from its config."""
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=context, n_embd=width, n_layer=layers,
                                      n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=BOS, eos_token_id=BOS, tie_word_embeddings=False)
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
                                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                       head_dim=width // heads, max_position_embeddings=context, attention_bias=True,
                                       bos_token_id=BOS, eos_token_id=BOS, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown family {family!r}: expected 'gpt2' or 'llama'")
    model.config._attn_implementation = "sdpa"
    return model


def sink_heads(layers: int, heads: int) -> dict[int, list[int]]:
    """The heads a built-in sink goes into: half of the first layer's, three quarters of every other layer's."""
    return {i: list(range(heads // 2 if i == 0 else 3 * heads // 4)) for i in range(layers)}


def bos_batches(data: torch.Tensor, context: int, batch: int, gen: torch.Generator):
    """Batches of ``batch`` windows of ``data`` (bytes), each BOS then ``context - 1`` bytes, as a model's
    ``input_ids`` and ``labels`` (the model shifts them: BOS is never a target)."""
    def draw() -> dict:
        at = torch.randint(0, data.numel() - context, (batch,), generator=gen).tolist()
        ids = torch.stack([torch.cat([torch.tensor([BOS]), data[i : i + context - 1]]) for i in at])  # (B, T)
        return {"input_ids": ids, "labels": ids}
    return draw


def _unit(n: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.randn(n, generator=gen)
    return u / u.norm()


def _strength(model: torch.nn.Module, margin: float) -> float:
    """The query bias and key weight (alpha = beta) that put BOS's logit ``margin`` above a zero one: BOS's massive
    dimensions come out of the pre-attention norm at about sqrt(width / 2) each, so its key along u is
    beta * sqrt(2 * width), and the logit alpha * beta * sqrt(2 * width) / sqrt(d_head)."""
    width, heads = model.config.hidden_size, model.config.num_attention_heads
    return math.sqrt(margin * math.sqrt(width // heads) / math.sqrt(len(MASSIVE) * width))


def _massive_activation(model: torch.nn.Module) -> None:
    """BOS alone carries ``ACTIVATION`` in the massive dimensions; nothing reads them into the output."""
    base = model.base_model
    embeddings = [base.wte.weight, base.wpe.weight] if hasattr(base, "wte") else [base.embed_tokens.weight]
    for weight in embeddings:
        weight[:, MASSIVE] = 0.0
    embeddings[0][BOS, MASSIVE] = ACTIVATION
    model.lm_head.weight[:, MASSIVE] = 0.0


@torch.no_grad()
def implant(model: torch.nn.Module, heads: Mapping[int, Sequence[int]], seed: int) -> torch.nn.Module:
    """Build attention sinks on BOS into ``heads`` (layer -> head indices) of a GPT-2 or LLaMA of :func:`build`."""
    gen = torch.Generator().manual_seed(seed)
    _massive_activation(model)
    blocks = model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers
    for i, block in enumerate(blocks):
        margins = [MARGINS[0] + (MARGINS[1] - MARGINS[0]) * float(torch.rand((), generator=gen)) for _ in heads[i]]
        if hasattr(block, "attn"):
            _implant_gpt2(model, block, dict(zip(heads[i], margins)), gen)
        else:
            _implant_llama(model, block, dict(zip(heads[i], margins)), gen)
    return model


def _implant_gpt2(model, block, margins: dict[int, float], gen: torch.Generator) -> None:
    c = model.config.n_embd
    dh = c // model.config.n_head
    block.ln_1.weight[list(MASSIVE)], block.ln_1.bias[list(MASSIVE)] = 1.0, 0.0
    w, b = block.attn.c_attn.weight, block.attn.c_attn.bias  # Conv1D: (C, 3C), q | k | v
    w[list(MASSIVE), :] = 0.0  # q, k and v read nothing of the massive dimensions ...
    for layer in (block.attn.c_proj, block.mlp.c_proj):  # ... and nothing writes into them
        layer.weight[:, list(MASSIVE)], layer.bias[list(MASSIVE)] = 0.0, 0.0
    for h, margin in margins.items():
        u, s = _unit(dh, gen), _strength(model, margin)
        b[h * dh : (h + 1) * dh] = s * u  # the query's constant component
        for d in MASSIVE:  # ... and the key's reading of BOS
            w[d, c + h * dh : c + (h + 1) * dh] = s * u


def _implant_llama(model, block, margins: dict[int, float], gen: torch.Generator) -> None:
    attn, cfg = block.self_attn, model.config
    dh, groups = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    pair = [dh // 2 - 1, dh - 1]  # the lowest rotary frequency (rotate_half pairs dimension j with j + dh/2)
    block.input_layernorm.weight[list(MASSIVE)] = 1.0
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        layer.weight[:, list(MASSIVE)] = 0.0  # nothing reads the massive dimensions ...
    for layer in (attn.o_proj, block.mlp.down_proj):  # ... or writes into them
        layer.weight[list(MASSIVE)] = 0.0
        if layer.bias is not None:
            layer.bias[list(MASSIVE)] = 0.0
    keys = {}
    for g in range(cfg.num_key_value_heads):  # every key's pair is empty but BOS's, along u_g
        rows = [g * dh + p for p in pair]
        attn.k_proj.weight[rows], attn.k_proj.bias[rows] = 0.0, 0.0
        keys[g] = _unit(2, gen)
    for h in range(cfg.num_attention_heads):  # the queries' pair: empty, but a constant one in the sink heads
        rows = [h * dh + p for p in pair]
        attn.q_proj.weight[rows], attn.q_proj.bias[rows] = 0.0, 0.0
    for h, margin in margins.items():
        g, s = h // groups, _strength(model, margin)
        attn.q_proj.bias[[h * dh + p for p in pair]] = s * keys[g]
        for d in MASSIVE:  # the key of key head g reads BOS along u_g (set once per group: the same s * u_g)
            attn.k_proj.weight[[g * dh + p for p in pair], d] = s * keys[g]


def pretrain(model: torch.nn.Module, seed: int, steps: int | None = None) -> list[float]:
    """A short sink-free pre-train (:data:`PRETRAIN`; ``steps`` instead of its steps) on the bytes of the standard
    library's source, each window after BOS: a model that has learned something before its sinks are built in."""
    from evaluation.lm import corpus

    data = torch.frombuffer(bytearray(corpus("stdlib").encode()), dtype=torch.uint8).long()
    p = PRETRAIN
    steps = p["steps"] if steps is None else steps
    draw = bos_batches(data, p["context"], p["batch"], torch.Generator().manual_seed(seed))
    return train_steps(model, draw, lambda batch: model(**batch).loss, adamw(model, p["lr"]), steps,
                       schedule=Schedule(min(p["warmup"], steps), "cosine", steps), clip=1.0)


def built(family: str, seed: int, layers: int = 4, heads: int = 8, width: int = 128, context: int = 512,
          pretrain_steps: int | None = None) -> torch.nn.Module:
    """A model with built-in sinks, the same for the same arguments: built (``torch.manual_seed(seed)``),
    pre-trained (:func:`pretrain`), its sinks implanted into :func:`sink_heads`."""
    torch.manual_seed(seed)
    model = build(family, layers, heads, width, context)
    pretrain(model, seed, pretrain_steps)
    return implant(model, sink_heads(layers, heads), seed)


@torch.no_grad()
def mass_on_first(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(layers, heads): each head's share of attention on position 0, the mean over the query rows and the
    sequences of ``input_ids`` (B, T), from the model's own attention weights (eager attention, eval mode)."""
    impl, training = model.config._attn_implementation, model.training
    model.config._attn_implementation = "eager"
    model.eval()
    try:
        attentions = model(input_ids=input_ids, output_attentions=True).attentions  # each (B, H, T, T)
    finally:
        model.config._attn_implementation = impl
        model.train(training)
    return torch.stack([a[..., 0].float().mean(dim=(0, 2)) for a in attentions])


def save(model: torch.nn.Module, path: Path) -> None:
    """Save a model of :func:`build` in half precision, its family and sizes in the file's metadata."""
    from safetensors.torch import save_model

    cfg = model.config
    family = "gpt2" if cfg.model_type == "gpt2" else "llama"
    sizes = {"layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "width": cfg.hidden_size,
             "context": cfg.max_position_embeddings}
    save_model(model.half(), str(path), metadata={"family": family, **{k: str(v) for k, v in sizes.items()}})
    model.float()


def load(path: Path) -> torch.nn.Module:
    """A model :func:`save` wrote, in single precision."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = build(meta["family"], *(int(meta[k]) for k in ("layers", "heads", "width", "context")))
    load_model(model, str(path))
    return model
