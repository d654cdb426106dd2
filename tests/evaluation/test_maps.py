"""evaluation/maps.py: the attention maps the ground truth reads are the ones the model computed, measured as the
definition says, and recording them changes nothing of the run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evaluation.maps import COLUMN_MASS, EVEN, SEQS, TOP_KEYS, TOP_MASS, MapRecorder, demo_attention, load_maps, measure
from evaluation.recording import recording
from hooks import Monitor
from hooks.demo import GPT, GPTConfig, SelfAttention, adamw, train_steps


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_maps_times_the_values_are_the_modules_attention_output(causal, qk_norm):
    torch.manual_seed(0)
    m = SelfAttention(32, 4, causal=causal, qk_norm=qk_norm)
    x = torch.randn(3, 10, 32)
    probs = demo_attention(m, x)  # (B, nh, T, T)
    _, _, v = m.c_attn(x).split(32, dim=2)
    v = v.view(3, 10, 4, 8).transpose(1, 2)  # (B, nh, T, hs)
    out = m(x)
    y = (probs @ v).transpose(1, 2).reshape(3, 10, 32)
    torch.testing.assert_close(m.c_proj(y), out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4, 10)) and (probs.triu(1) == 0).all() == causal


def slow_measure(p: np.ndarray, causal: bool) -> dict[str, np.ndarray]:
    """The definition's statistics of maps (S, H, T, K) by loops over heads, sequences and queries."""
    s, h, t, k = p.shape
    seen = [(i + 1 if causal else k) for i in range(t)]
    focused = np.zeros((h, len(TOP_KEYS), len(TOP_MASS)))
    columns = np.zeros((h, len(COLUMN_MASS)))
    even = np.zeros((h, len(EVEN)))
    shared = np.zeros(h)
    for hh in range(h):
        for a, m in enumerate(TOP_KEYS):
            rows = [sorted(p[ss, hh, i], reverse=True)[:m] for ss in range(s) for i in range(t) if seen[i] > m]
            for b, level in enumerate(TOP_MASS):
                focused[hh, a, b] = np.mean([sum(r) >= level - 1e-12 for r in rows]) if rows else 0.0
        for c, level in enumerate(COLUMN_MASS):
            counts = []
            for ss in range(s):
                col, total, n = sorted(p[ss, hh].sum(0) / t, reverse=True), 0.0, 0
                while total < level - 1e-12:
                    total, n = total + col[n], n + 1
                counts.append(n)
            columns[hh, c] = np.mean(counts)
        ratios = [-sum(x * np.log(x) for x in p[ss, hh, i] if x > 0) / np.log(seen[i])
                  for ss in range(s) for i in range(t) if seen[i] >= 2]
        even[hh] = [np.mean([r >= level for r in ratios]) for level in EVEN]
        shared[hh] = max(min(p[ss, hh, :, j].sum() / t for ss in range(s)) for j in range(k))
    return {"focused": focused, "columns": columns, "even": even, "shared": shared}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("temperature", [0.3, 3.0])
def test_measure_against_loops(causal, temperature):
    """Random maps from spread (logits of std 0.3) to sharp (std 3), causal and not: the vectorised statistics
    are the loops'."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 20, 20, generator=g, dtype=torch.float64) * temperature
    if causal:
        logits = logits.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    p = logits.softmax(-1)
    fast, slow = measure(p, causal), slow_measure(p.numpy(), causal)
    for key in slow:
        np.testing.assert_allclose(fast[key].numpy(), slow[key], rtol=1e-6, atol=1e-9, err_msg=key)


def _train(tmp_path, steps: int, maps: bool) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16, batch_size=6)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 11, (400,), generator=torch.Generator().manual_seed(1))

    def batch():
        ix = torch.randint(len(data) - 17, (6,), generator=gen).tolist()
        return torch.stack([data[i:i + 16] for i in ix]), torch.stack([data[i + 1:i + 17] for i in ix])

    out = tmp_path / ("with" if maps else "without")
    out.mkdir()
    with recording(Monitor(model, every=1), out / "observations.jsonl", out / "attention.npz" if maps else None) as m:
        losses = train_steps(model, batch, lambda b: model(*b), adamw(model, 3e-3), steps, monitor=m)
    assert not model.h[0].attn._forward_pre_hooks  # nothing left behind
    return losses, (out / "observations.jsonl").read_text().splitlines()


def test_recording_the_maps_changes_neither_the_run_nor_what_the_detectors_see(tmp_path):
    """The same tiny GPT trained 6 steps under a Monitor at every step, with and without the map recorder: the
    same losses bit for bit and the same observations (the Monitor's capture sees the model's attention call,
    not the recorder's); the file holds each step's measurements of each layer, equal to those of the maps
    recomputed from the trained weights' first step."""
    with_maps, seen_with = _train(tmp_path, 6, True)
    without, seen_without = _train(tmp_path, 6, False)
    assert with_maps == without
    assert [json.loads(a) for a in seen_with] == [json.loads(b) for b in seen_without]
    maps = load_maps(tmp_path / "with" / "attention.npz")
    assert maps.steps.tolist() == list(range(6)) and maps.layers == ["L00", "L01"]
    assert maps.rows == {"L00": 16, "L01": 16}
    assert maps.focused["L00"].shape == (6, 2, len(TOP_KEYS), len(TOP_MASS))
    assert maps.columns["L01"].shape == (6, 2, len(COLUMN_MASS)) and maps.shared["L01"].shape == (6, 2)
    assert np.isfinite(maps.even["L00"]).all() and SEQS < 6


def test_the_first_steps_maps_are_those_of_the_initial_weights(tmp_path):
    """At step 0 the weights are the initial ones: the recorded statistics equal those measured directly on
    the same batch's first SEQS sequences."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, batch_size=6)
    model = GPT(cfg)
    x = torch.randint(0, 11, (6, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model.wte(x[:SEQS]) + model.wpe(torch.arange(16))
        expected = measure(demo_attention(model.h[0].attn, model.h[0].ln_1(h)), True)
    recorder = MapRecorder(model, tmp_path / "attention.npz")
    model(x, x).backward()
    recorder.close()
    maps = load_maps(tmp_path / "attention.npz")
    np.testing.assert_allclose(maps.focused["L00"][0], expected["focused"].numpy(), atol=1e-6)
    np.testing.assert_allclose(maps.columns["L00"][0], expected["columns"].numpy(), atol=1e-5)


def test_a_model_without_the_demos_attention_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"MapRecorder: Linear has no hooks.demo.SelfAttention"):
        MapRecorder(torch.nn.Linear(2, 2), tmp_path / "attention.npz")
