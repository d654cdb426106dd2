"""The max attention logit of every family x every attention implementation, against logits by hand.

One matrix for all the models the tests build: the families of ``zoo.FAMILY_BUILDERS`` plus the
reference zoo (nanoGPT, GPT-2, LLaMA, ``nn.TransformerEncoder``). Each case runs one sampled step;
the Monitor's ``attn_max_logit/<layer>/H<h>`` is compared with the largest float64 logit over the
keys each query may see, recomputed by hand from each module's recorded inputs
(``references.logits_by_hand``: hand-sliced weights and biases, RoPE through the family's own
function, T5's relative position bias). A new family: a branch in each helper of tests/support/references.py
and a row in ``IMPLEMENTATIONS`` here.
"""

from __future__ import annotations

import pytest
import torch

from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo
from tests.support.references import assert_max_logits, logits_by_hand

REL = 1e-4
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    **{fam: ("eager", "sdpa") for fam in zoo.FAMILY_BUILDERS},
    "gpt2": ("eager", "sdpa"),
    "llama": ("eager", "sdpa"),
    "nanogpt": ("sdpa",),  # F.scaled_dot_product_attention in its forward
    "torch-encoder": ("mha",),  # nn.MultiheadAttention
    "torch-seq2seq": ("mha",),
}
MATRIX = [(fam, impl) for fam, impls in IMPLEMENTATIONS.items() for impl in impls]


def build(fam: str, impl: str) -> zoo.Case:
    """The case with every dropout off (the max logit is compared with a dropout-free recomputation)."""
    if fam == "nanogpt":
        return zoo.nanogpt(dropout=0.0)
    if fam == "torch-seq2seq":
        return zoo.torch_seq2seq(dropout=0.0)
    if fam == "torch-encoder":
        return zoo.torch_encoder(dropout=0.0)
    builder = {"gpt2": zoo.gpt2, "llama": zoo.llama, **zoo.FAMILY_BUILDERS}[fam]
    return builder(impl, dropout=0.0)


@pytest.mark.parametrize(("fam", "impl"), MATRIX, ids=[f"{f}-{i}" for f, i in MATRIX])
def test_max_logit_matches_logits_by_hand(fam, impl):
    case, sink = build(fam, impl), MemorySink()
    batch = case.make_batch(torch.Generator().manual_seed(3))
    case.model.train()  # (nn.TransformerEncoderLayer's fast path, which skips the module hooks, is eval-only)
    monitor = Monitor(case.model, every=1, sinks=[sink])
    loss = case.loss(case.model, batch)
    loss.backward()
    monitor.step(0, loss=loss)
    monitor.close()
    logits = logits_by_hand(case, batch, case)  # no optimizer step: the weights are those of step 0
    assert len(logits) == len(monitor.layers)
    for layer, s in zip(monitor.layers, logits):
        assert_max_logits(sink.records[0].scalars, layer.label, s, rel=REL)  # excluded keys are -inf in s
