"""Attention states per head: malignant (sparse and low-rank), benign (sparse, full-rank), uniform.

Qi et al.: malignant entropy collapse - every query looks at the same one or few keys -
precedes the crash; benign collapse (each query on a different key) does not. Each state is
an episode per head (:mod:`diag.detectors.episodes`); heads of one layer that start or end
at the same step are reported as one record for the layer. The lines scale with the
attention's size: the low-rank line is ``1 + low_rank_frac * (rows - 1)`` (rank 1 is the
floor: every row the same), so a 5-token attention can be malignant (10% of 5 rows, the old
line, is 0.5: below any effective rank). The sparse line stays ``sparse_entropy`` nats.
"""

from __future__ import annotations

import math

import numpy as np

from diag.catalog.tags import head_label
from diag.detectors.base import Alert, Observation
from diag.detectors.config import AlertConfig
from diag.detectors.episodes import Closed, Dwell, Episodes, Opened

__all__ = ["AttentionStates", "attention_state", "lines", "group_by_layer"]

KINDS = {"malignant": ("malignant_collapse", "critical"), "benign": ("benign_collapse", "info"),
         "uniform": ("uniform_attention", "info")}
WHAT = {
    "malignant_collapse": ("malignant entropy collapse: most queries put their mass on the same one or two keys "
                           "(sparse and low-rank attention, which precedes the crash in Qi et al.)",
                           "restart from a checkpoint before step {since} with warmup, a lower learning rate, "
                           "QK-norm or a spectral step limit; if the loss still improves, check whether this is a "
                           "deliberate pointer head"),
    "benign_collapse": ("benign entropy collapse: sparse attention, each query on a different key (full rank)",
                        "usually nothing; watch whether it turns malignant"),
    "uniform_attention": ("uniform attention: near-uniform weights over the keys, low rank",
                          "look at the head; low rank across layers is the rank collapse of Dong et al."),
}


def lines(rows: float, cfg: AlertConfig) -> tuple[float, float]:
    """(sparse entropy line in nats, low-rank line) for attention over ``rows`` rows."""
    return cfg.sparse_entropy, 1.0 + cfg.low_rank_frac * max(rows - 1.0, 0.0)


def attention_state(entropy: float, rank: float, rows: float, cfg: AlertConfig,
                    uniform_entropy: float = math.inf) -> str:
    """'malignant' (sparse and low-rank), 'benign' (sparse, not low-rank), 'uniform' (low-rank with
    entropy >= uniform_frac of uniform attention's over the same keys) or 'normal'."""
    sparse_line, rank_line = lines(rows, cfg)
    sparse, low_rank = entropy <= sparse_line, rank <= rank_line
    if sparse:
        return "malignant" if low_rank else "benign"
    return "uniform" if low_rank and entropy >= cfg.uniform_frac * uniform_entropy else "normal"


def _tests(state: str, e: float, r: float, rows: float, u: float, cfg: AlertConfig) -> tuple[bool, bool]:
    """(enter test, exit test) of one state; the exit lines sit exit_factor beyond the entry lines."""
    if not (math.isfinite(e) and math.isfinite(r)):
        return False, False
    sparse_line, rank_line = lines(rows, cfg)
    f = cfg.exit_factor
    if state == "malignant":
        return e <= sparse_line and r <= rank_line, e > f * sparse_line or r > f * rank_line
    if state == "benign":
        return e <= sparse_line and r > rank_line, e > f * sparse_line
    inside = r <= rank_line and e >= cfg.uniform_frac * u
    return inside, r > f * rank_line or e < (1.0 - f * (1.0 - cfg.uniform_frac)) * u


class AttentionStates:
    """Episodes of the three attention states on every head (needs the ``attention`` signal)."""

    def __init__(self, cfg: AlertConfig) -> None:
        self.cfg = cfg
        exit = Dwell(2, cfg.exit_dwell)
        self.episodes = {"malignant": Episodes(Dwell(cfg.collapse_persist, cfg.collapse_dwell), exit),
                         "benign": Episodes(Dwell(1, 0), exit), "uniform": Episodes(Dwell(1, 0), exit)}

    def observe(self, obs: Observation) -> list[Alert]:
        alerts: list[Alert] = []
        for label, m in obs.layers.items():
            if "attn_entropy" in m and "attn_rank" in m and "attn_rows" in m:
                alerts += group_by_layer(label, self._layer(obs.step, label, m))
        return alerts

    def _layer(self, step: int, label: str, m: dict[str, np.ndarray]) -> list[Alert]:
        rows = float(m["attn_rows"][0])
        u = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
        n = len(m["attn_entropy"])
        out = []
        for h, (e, r) in enumerate(zip(m["attn_entropy"].tolist(), m["attn_rank"].tolist())):
            where = f"{label}/{head_label(h, n)}"
            for state, episodes in self.episodes.items():
                inside, outside = _tests(state, e, r, rows, u, self.cfg)
                if state == "benign" and self.episodes["malignant"].since(where) is not None:
                    inside = False  # a (would-be) malignant head that regains rank for a moment is not benign
                event = episodes.update(where, step, inside, outside)
                if event is not None:
                    out.append(self._alert(step, where, state, event, e, r, rows))
        return out

    def _alert(self, step: int, where: str, state: str, event: Opened | Closed, e: float, r: float,
               rows: float) -> Alert:
        kind, level = KINDS[state]
        values = {"attn_entropy": e, "attn_rank": r, "attn_rows": rows}
        what, todo = WHAT[kind]
        if isinstance(event, Closed):
            values["duration_steps"] = float(event.duration)
            return Alert(step, kind, "info", where, f"resolved: {what.split(':')[0]} ended at step {event.until} "
                         f"after {event.duration} steps", values, "resolved", event.since)
        message = (f"{what}; entropy {e:.2f} nats, effective rank {r:.1f} of {rows:.0f} rows, since step "
                   f"{event.since}. What to do: {todo.format(since=event.since)}")
        return Alert(step, kind, level, where, message, values, "firing", event.since)

    def state_dict(self) -> dict:
        return {"attention_episodes": {state: e.state_dict() for state, e in self.episodes.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name, episodes in state.get("attention_episodes", {}).items():
            self.episodes[name].load_state_dict(episodes)


def group_by_layer(label: str, alerts: list[Alert]) -> list[Alert]:
    """Records of one kind and status that several heads of layer ``label`` share at one step: one record."""
    groups: dict[tuple[str, str], list[Alert]] = {}
    for a in alerts:
        groups.setdefault((a.kind, a.status), []).append(a)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out += group
            continue
        first = group[0]
        values = {**first.values, "heads": float(len(group))}
        message = f"{len(group)} heads together (values of {first.where.split('/')[-1]}): {first.message}"
        out.append(Alert(first.step, first.kind, first.level, label, message, values, first.status,
                         min(a.since for a in group if a.since is not None), tuple(a.where for a in group)))
    return out
