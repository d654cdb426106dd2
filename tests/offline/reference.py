"""Slow, obviously correct references for the checkpoint analysis: float64, full SVDs, loops over heads.

``layer_reference`` gives every number the analysis writes for one attention layer of separate Q/K/V/O
projections (nn.Linear orientation): the per-head spectrum of Wq_h^T Wk_{pair(h)} from the full SVD of the
E x E product, its summaries, and the update ratios sigma_1(dW)/sigma_1(W) and ||dW||_F/||W||_F of each
projection from full SVDs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

SEC_TOP = 4
E, H, G, LAYERS = 256, 8, 2, 4  # E > 128: the update ratios' sigma_1 take the Krylov path, not an exact SVD
def llama_series(folder, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Hugging Face LLaMA folders (GQA) whose attention weights move between checkpoints; their state dicts."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=E, intermediate_size=32, num_hidden_layers=LAYERS,
                                   num_attention_heads=H, num_key_value_heads=G, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg)
    states = []
    for step in range(steps):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "self_attn" in name:
                    p.add_(torch.randn_like(p) * 0.02 * (step + 1))
        model.save_pretrained(folder / f"checkpoint-{step * 10}")
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def head_spectra(wq: torch.Tensor, wk: torch.Tensor, heads: int, pairing: list[int]) -> torch.Tensor:
    """(H, D): the D largest singular values of Wq_h^T Wk_{pairing[h]}, full SVD of the E x E product."""
    d = wq.shape[0] // heads
    q = wq.double().reshape(heads, d, -1)
    k = wk.double().reshape(-1, d, wq.shape[1])
    return torch.stack([torch.linalg.svdvals(q[h].T @ k[pairing[h]])[:d] for h in range(heads)])


def summaries(sv: torch.Tensor) -> dict[str, list[float]]:
    """SEC_4, effective rank and stable rank, per head, written out as the papers define them."""
    out: dict[str, list[float]] = {"qk_sigma1": [], "qk_sec": [], "qk_erank": [], "qk_stable_rank": []}
    for s in sv.tolist():
        energy = [x * x for x in s]
        p = [x / sum(s) for x in s]
        out["qk_sigma1"].append(s[0])
        out["qk_sec"].append(sum(energy[:SEC_TOP]) / sum(energy))
        out["qk_erank"].append(math.exp(-sum(x * math.log(x) for x in p if x > 0)))
        out["qk_stable_rank"].append(sum(energy) / s[0] ** 2)
    return out


def update_ratios(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """update_ratio_x = sigma_1(dW)/sigma_1(W) and update_fro_x = ||dW||_F/||W||_F, full SVD in float64."""
    out = {}
    for name, w in before.items():
        w, d = w.double(), after[name].double() - w.double()
        out[f"update_ratio_{name}"] = float(torch.linalg.svdvals(d)[0] / torch.linalg.svdvals(w)[0])
        out[f"update_fro_{name}"] = float(d.norm() / w.norm())
    return out


def assert_layer(got: dict[str, np.ndarray], sv: torch.Tensor, rel: float = 1e-6) -> None:
    """The analysis's arrays of one layer against the reference spectra ``sv`` (H, D)."""
    for metric, want in summaries(sv).items():
        assert got[metric].tolist() == pytest.approx(want, rel=rel, abs=1e-12), metric
    width = got["qk_spectrum"].size // sv.shape[0]
    spectrum = torch.as_tensor(got["qk_spectrum"]).reshape(sv.shape[0], width)[:, : sv.shape[1]]
    torch.testing.assert_close(spectrum, sv, rtol=rel, atol=1e-12)


def assert_updates(got: dict[str, np.ndarray], want: dict[str, float], rel: float) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert float(got[name][0]) == pytest.approx(value, rel=rel), name
