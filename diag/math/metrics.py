"""The weight-side signal families, batched: spectra and gradient norms (update ratios: diag.math.updates).

Pure functions from per-head tensors (see :func:`diag.layouts.split_qkv`) to
dictionaries of float64 tensors; the monitor and the checkpoint analysis call
the same functions, so their numbers agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from diag.math.norms import frobenius
from diag.math.spectral import (
    effective_rank,
    qk_singular_values_of_layers,
    spectral_energy_concentration,
    stable_rank,
)

__all__ = [
    "layer_spectra",
    "grad_metrics",
    "grad_ratio",
    "DEFAULT_SEC_TOP",
]

# SEC_s with s = 4: with d_head = 64 a random-init head has SEC_4 of about 0.2;
# a head whose energy sits in a handful of directions approaches 1.
DEFAULT_SEC_TOP = 4


def _metrics_of_spectra(sv: Tensor, sec_top: int) -> dict[str, Tensor]:
    """Per head: qk_sigma1, qk_sec, qk_erank, qk_stable_rank and the spectrum itself."""
    return {
        "qk_sigma1": sv[..., 0],
        "qk_sec": spectral_energy_concentration(sv, sec_top),
        "qk_erank": effective_rank(sv),
        "qk_stable_rank": stable_rank(sv),
        "qk_spectrum": sv,
    }


def layer_spectra(qk: Sequence[tuple[Tensor, Tensor]], sec_top: int = DEFAULT_SEC_TOP) -> list[dict[str, Tensor]]:
    """The spectral metrics of many layers' heads: one batched call per group of equal shapes.

    qk: per layer, the per-head (wq, wk) of :func:`diag.layouts.split_qkv`. Returns the
    metrics of each layer, in the order given.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (wq, wk) in enumerate(qk):
        groups.setdefault((tuple(wq.shape), tuple(wk.shape), wq.dtype), []).append(i)
    out: list[dict[str, Tensor]] = [{} for _ in qk]
    for members in groups.values():
        sv = qk_singular_values_of_layers([qk[i] for i in members])  # (layers * H, D)
        batched = _metrics_of_spectra(sv.reshape(len(members), -1, sv.shape[-1]), sec_top)
        for j, i in enumerate(members):
            out[i] = {name: t[j] for name, t in batched.items()}
    return out


def grad_metrics(gq: Tensor, gk: Tensor, gv: Tensor) -> dict[str, Tensor]:
    """Frobenius norms per head of the Q, K, V gradient slices, and the layer's Q/K-to-V ratio.

    grad_ratio_qk_v = (mean_h |gQ_h| + mean_g |gK_g|) / (2 mean_g |gV_g|): a ratio of
    mean per-head norms, so grouped-query layers (fewer K/V heads) compare fairly.
    """
    norms = {f"grad_norm_{name}": frobenius(g) for name, g in zip("qkv", (gq, gk, gv))}
    norms["grad_ratio_qk_v"] = grad_ratio(norms["grad_norm_q"], norms["grad_norm_k"], norms["grad_norm_v"])
    return norms


def grad_ratio(norm_q: Tensor, norm_k: Tensor, norm_v: Tensor) -> Tensor:
    """grad_ratio_qk_v of :func:`grad_metrics` from the per-head norms (H,), (G,), (G,) (under tensor
    parallelism: of every rank's heads, gathered)."""
    return (norm_q.mean(-1) + norm_k.mean(-1)) / (2 * norm_v.mean(-1))
