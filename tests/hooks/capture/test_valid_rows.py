"""Padded query rows never count: every padded family of the zoo against its own eager attention.

For each family with padding (GPT-2, LLaMA, BERT, RoBERTa, Mistral, Qwen3, GPT-NeoX, T5, BART,
``nn.TransformerEncoder`` with a key padding mask), eager and SDPA, right and left padding:
``attn_entropy`` and ``attn_rank`` equal the float64 per-head reference computed from the model's
own ``output_attentions=True`` probabilities (``need_weights=True`` for ``nn.MultiheadAttention``)
restricted to the token rows (the ``attention_mask``; every row of a decoder's self- and
cross-attention), with the rank over the first ``attn_rank_rows`` token rows (5 here, so with left
padding the rank's rows are not the first 5 rows). Then unit tests of how rows are told apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diag.math.attention import stats_from_logits, stats_from_probabilities_reference, valid_query_rows
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo

N, RANK_ROWS, REL = 2, 5, 1e-4
FAMILIES = {"gpt2": zoo.gpt2, "llama": zoo.llama, "bert": zoo.bert, "roberta": zoo.roberta, "mistral": zoo.mistral,
            "qwen3": zoo.qwen3, "gpt-neox": zoo.gpt_neox, "t5": zoo.t5, "bart": zoo.bart}
CASES = [f"{f}-{impl}-{side}" for f in FAMILIES for impl in ("eager", "sdpa") for side in ("right", "left")]
CASES += ["torch-encoder-mha-right", "torch-encoder-mha-left", "bart-sdpa-same-length", "bart-eager-same-length"]


def build(name: str) -> tuple[zoo.Case, dict]:
    family, impl, side = name.rsplit("-", 2) if not name.endswith("same-length") else (*name.split("-")[:2], "same")
    if family == "torch-encoder":
        case = zoo.torch_encoder()
        for m in case.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            if isinstance(m, torch.nn.MultiheadAttention):
                m.dropout = 0.0
    else:
        case = FAMILIES[family](impl, dropout=0.0)
    batch = case.make_batch(torch.Generator().manual_seed(3))
    key = "pad" if family == "torch-encoder" else "attention_mask"
    if side == "left":
        batch[key] = batch[key].flip(1)  # the same amount of padding at the start of the sequence
    if side == "same":  # a target as long as the source: the decoder must not take the source's padding
        batch["labels"] = torch.randint(3, zoo.VOCAB, batch["input_ids"].shape, generator=torch.Generator())
    return case, batch


def eager_probabilities(case: zoo.Case, batch: dict) -> list[torch.Tensor]:
    """The model's own probabilities per monitored layer (N, H, Q, K), float64, in the Monitor's order."""
    small = {k: v[:N] for k, v in batch.items()}
    if case.name == "torch-encoder":
        probs, x = [], case.model.emb(small["input_ids"])
        with torch.no_grad():
            for layer in case.model.encoder.layers:
                _, w = layer.self_attn(x, x, x, key_padding_mask=small["pad"], need_weights=True,
                                       average_attn_weights=False)
                probs.append(w.double())
                x = layer(x, src_key_padding_mask=small["pad"])
        return probs
    model = type(case.model)._from_config(case.model.config, attn_implementation="eager")
    model.load_state_dict(case.model.state_dict())
    model.eval()
    with torch.no_grad():
        out = model(**small, output_attentions=True)
    if hasattr(out, "encoder_attentions") and out.encoder_attentions is not None:
        dec = [p for pair in zip(out.decoder_attentions, out.cross_attentions) for p in pair]
        return [p.double() for p in list(out.encoder_attentions) + dec]
    return [p.double() for p in out.attentions]


def token_rows(case: zoo.Case, batch: dict, layer) -> torch.Tensor:
    """(N, Q): the attention_mask (or ~pad) for self-attention over the source; every row of a decoder's."""
    if case.name == "torch-encoder":
        return ~batch["pad"][:N]
    if layer.cross or "decoder" in layer.name:
        return None
    return batch["attention_mask"][:N].bool()


@pytest.mark.parametrize("name", CASES)
def test_entropy_and_rank_over_token_rows_match_eager_attention(name):
    case, batch = build(name)
    sink = MemorySink()
    case.model.train()
    monitor = Monitor(case.model, every=1, sinks=[sink], signals=("attention",), attn_rank_rows=RANK_ROWS)
    case.loss(case.model, batch).backward()
    problems = dict(monitor.capture.problems)
    monitor.step(0)
    monitor.close()
    assert problems == {}
    scalars = sink.records[0].scalars
    probs = eager_probabilities(case, batch)
    assert len(probs) == len(monitor.layers)
    for layer, p in zip(monitor.layers, probs):
        allowed = (p > 0).any(1)  # (N, Q, K): where the model put any mass
        tokens = token_rows(case, batch, layer)
        tokens = torch.ones(p.shape[0], p.shape[2], dtype=torch.bool) if tokens is None else tokens
        entropy, rank = stats_from_probabilities_reference(p, allowed, RANK_ROWS, query_valid=tokens)
        n = layer.layout.n_heads
        for metric, ref in (("attn_entropy", entropy), ("attn_rank", rank)):
            got = np.array([scalars[f"{metric}/{layer.label}/H{h:02d}"] for h in range(n)])
            np.testing.assert_allclose(got, ref.numpy(), rtol=REL, err_msg=f"{metric} {layer.name}")


def test_padding_changes_the_numbers():
    """The padded rows are not a no-op here: counting them would give another entropy."""
    case, batch = build("bert-eager-right")
    p = eager_probabilities(case, batch)[0]
    allowed = (p > 0).any(1)
    with_pad, _ = stats_from_probabilities_reference(p, allowed, RANK_ROWS)
    without, _ = stats_from_probabilities_reference(p, allowed, RANK_ROWS, query_valid=batch["attention_mask"][:N]
                                                    .bool())
    assert (with_pad - without).abs().min() > 1e-3


# ------------------------------------------------------------------ how rows are told apart


def excluded_from(allowed: torch.Tensor) -> torch.Tensor:
    return ~allowed


def test_the_model_mask_decides_when_it_describes_the_kernel():
    t = 6
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # left padding
    allowed = causal & mask.bool()[:, None, :]
    open_rows = allowed.clone()
    open_rows[0, :2] = True  # Hugging Face lets fully masked rows attend to every key
    for a in (allowed, open_rows):
        assert valid_query_rows(excluded_from(a), mask).tolist() == [[False, False, True, True, True, True]]
    # from the kernel alone the open rows hide the padding: that is why the model's mask goes first
    assert valid_query_rows(excluded_from(open_rows)).tolist() == [[True] * 6]
    assert valid_query_rows(excluded_from(allowed)).tolist() == [[False, False, True, True, True, True]]


def test_an_encoder_mask_is_not_taken_for_a_causal_decoder_of_the_same_length():
    t = 6
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])  # the source's right padding
    decoder = torch.ones(t, t, dtype=torch.bool).tril()[None]  # causal, no padding of its own
    assert valid_query_rows(excluded_from(decoder), mask).tolist() == [[True] * 6]
    gpt2 = decoder & mask.bool()[:, None, :]  # a decoder-only model over that padded sequence
    assert valid_query_rows(excluded_from(gpt2), mask).tolist() == [[True] * 4 + [False] * 2]


def test_stats_with_token_rows_match_per_head_loops():
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        g.manual_seed(seed)
        n_q = int(torch.randint(1, 9, (1,), generator=g))
        logits = torch.randn(2, 3, n_q, n_q, generator=g) * 3
        allowed = torch.rand(2, n_q, n_q, generator=g) > 0.3
        tokens = torch.rand(2, n_q, generator=g) > 0.3
        rank_rows = int(torch.randint(1, 10, (1,), generator=g))
        masked = logits.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        if not (allowed & tokens[:, :, None]).any():
            continue
        stats = stats_from_logits(masked, rank_rows, tokens)
        probs = torch.softmax(masked.double(), -1)
        entropy, rank = stats_from_probabilities_reference(probs, allowed, rank_rows, query_valid=tokens)
        torch.testing.assert_close(stats.entropy, entropy, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(stats.rank, rank, rtol=1e-6, atol=1e-9, equal_nan=True)
        ok = allowed & tokens[:, :, None]
        ref_max = masked.double().masked_fill(~ok[:, None], -float("inf")).amax(dim=(0, 2, 3))
        torch.testing.assert_close(stats.max_logit, ref_max)


# ------------------------------------------------------------------ Hugging Face families whose logits come from bmm


def _bmm_family(name: str) -> tuple[torch.nn.Module, dict]:
    import transformers

    from diag.layouts.vocab import QKVLayout

    torch.manual_seed(0)
    if name == "bloom":  # alibi.baddbmm(q, k^T) viewed (B, H, T, S); fused per head [Q_h | K_h | V_h]
        cfg = transformers.BloomConfig(vocab_size=zoo.VOCAB, hidden_size=32, n_head=4, n_layer=2,
                                       attention_dropout=0.0, hidden_dropout=0.0)
        model = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="eager")
        return model, {"transformer.h.*.self_attention": QKVLayout(4, 8, q="query_key_value.weight",
                                                                    packing="fused_per_head")}
    # DeBERTa-v2: bmm(q, k^T / scale) of (B*H, T, D), then two relative-position bmm products, then a 4-D softmax
    cfg = transformers.DebertaV2Config(vocab_size=zoo.VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                       intermediate_size=64, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                       max_position_embeddings=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    model = transformers.DebertaV2ForMaskedLM._from_config(cfg, attn_implementation="eager")
    return model, {"deberta.encoder.layer.*.attention.self": QKVLayout(4, 8, "query_proj.weight", "key_proj.weight",
                                                                        "value_proj.weight")}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["bloom", "deberta-v2"])
def test_bmm_families_padded_match_their_eager_attention(name, side):
    model, spec = _bmm_family(name)
    batch = zoo._padded_tokens(torch.Generator().manual_seed(3))
    if side == "left":
        batch["attention_mask"] = batch["attention_mask"].flip(1)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink], spec=spec, signals=("attention",), attn_rank_rows=RANK_ROWS)
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    checked = dict(monitor.capture.checked)
    monitor.step(0)
    monitor.close()
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused, checked
    model.eval()
    with torch.no_grad():
        out = model(**{k: v[:N] for k, v in batch.items()}, output_attentions=True)
    tokens = batch["attention_mask"][:N].bool()
    for layer, p in zip(monitor.layers, out.attentions):
        p = p.double()
        entropy, rank = stats_from_probabilities_reference(p, (p > 0).any(1), RANK_ROWS, query_valid=tokens)
        for metric, ref in (("attn_entropy", entropy), ("attn_rank", rank)):
            got = np.array([sink.records[0].scalars[f"{metric}/{layer.label}/H{h:02d}"] for h in range(4)])
            np.testing.assert_allclose(got, ref.numpy(), rtol=REL, err_msg=f"{metric} {layer.name}")
