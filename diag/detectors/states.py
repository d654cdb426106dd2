"""The three attention states, defined once: malignant (sparse and low-rank), benign (sparse, full-rank), uniform.

Qi et al.: "malignant entropy collapse" is attention that is *sparse yet low-rank* (every query puts its mass on
the same one or few keys); it precedes the crash. *Benign* collapse is sparse but full-rank (each query on a
different key, e.g. near-identity attention in a ViT's first block); training stays stable. Low rank without
sparsity is uniform attention, a third state. Entropy alone cannot tell them apart; rank is needed too.

The definition, used alike by the live detector (:class:`AttentionStates`) and by the evaluation's ground truth
(:func:`episodes_of`, over the attention logged at every step), has three parts:

* **lines, per sample and head**: sparse when the attention entropy is at most ``sparse_entropy`` nats; low-rank
  when the effective rank is at most ``1 + low_rank_frac * (rows - 1)`` (rank 1 is the floor: every row the
  same); uniform when low-rank with an entropy of at least ``uniform_frac`` of uniform attention's over the same
  keys. An exit line sits ``exit_factor`` beyond each entry line (hysteresis).
* **dwell, per head**: a head *enters* malignant once the entry test held at ``collapse_persist`` samples spanning
  ``collapse_dwell`` steps (benign and uniform at once; samples between the lines do not break it, one beyond the
  exit line does); it *leaves* once the exit test held at 2 samples spanning ``exit_dwell`` steps (samples between
  the lines, or not finite, change nothing there either). ``since`` is the first sample of the dwell.
* **layers**: a layer is in a state while at least ``layer_share`` of its heads, and at least 2 when it has 2 or
  more, are in it; it enters at the step the last of those heads entered.

A head entering ``malignant`` is a ``malignant_collapse`` record at level warning (``Lxx/Hyy``: one head can be a
deliberate pointer head); a layer entering it is the critical record (``Lxx``). Benign and uniform records are
info at both scopes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from diag.catalog.tags import head_label
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import StatesConfig
from diag.detectors.episodes import Closed, Dwell, Episodes, Opened, Recurrence

__all__ = ["AttentionStates", "STATES", "StateEpisode", "episodes_of", "head_key", "lines"]

STATES = ("malignant", "benign", "uniform")
KINDS = {"malignant": "malignant_collapse", "benign": "benign_collapse", "uniform": "uniform_attention"}
LEVELS = {("malignant", "head"): "warning", ("malignant", "layer"): "critical"}  # the rest: info
WHAT = {
    "malignant_collapse": ("malignant entropy collapse: most queries put their mass on the same one or two keys "
                           "(sparse and low-rank attention, which precedes the crash in Qi et al.)",
                           "restart from a checkpoint before step {since} with warmup, a lower learning rate, "
                           "QK-norm or a spectral step limit",
                           "one head alone can be a deliberate pointer head: watch whether more heads of the layer "
                           "follow (then a critical record for the layer) and whether the loss still improves"),
    "benign_collapse": ("benign entropy collapse: sparse attention, each query on a different key (full rank)",
                        "usually nothing; watch whether it turns malignant", ""),
    "uniform_attention": ("uniform attention: near-uniform weights over the keys, low rank",
                          "look at the head; low rank across layers is the rank collapse of Dong et al.", ""),
}


def head_key(label: str, h: int, n_heads: int) -> str:
    """``"L03/H05"``: the key (and ``where``) of one head, numbered as its tags are."""
    return f"{label}/{head_label(h, n_heads)}"


def lines(rows: float, cfg: StatesConfig) -> tuple[float, float]:
    """(sparse entropy line in nats, low-rank line) for attention over ``rows`` rows."""
    return cfg.sparse_entropy, 1.0 + cfg.low_rank_frac * max(rows - 1.0, 0.0)


def tests(state: str, e: float, r: float, rows: float, u: float, cfg: StatesConfig) -> tuple[bool, bool]:
    """(entry test, exit test) of one state for one sample; the exit lines sit exit_factor beyond the entry
    lines. A sample that is not finite passes neither (it changes nothing)."""
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


def layer_needs(n_heads: int, cfg: StatesConfig) -> int:
    """How many heads of a layer of ``n_heads`` must be in a state for the layer to be in it."""
    return max(min(2, n_heads), math.ceil(cfg.layer_share * n_heads - 1e-9))


@dataclass(frozen=True)
class StateEpisode:
    """One episode of one state on a head (``where = "L03/H05"``) or a layer (``"L03"``)."""

    state: str
    where: str
    since: int  # the first step of the dwell that opened it
    opened: int  # the step at which the definition has it established (the dwell met)
    until: int | None  # the step the exit began, None while open at the end of the series


class _Machine:
    """The definition's state machine over a stream of samples, per state: head episodes and layer episodes."""

    def __init__(self, cfg: StatesConfig) -> None:
        self.cfg = cfg
        leave = Dwell(2, cfg.exit_dwell)
        enter = {"malignant": Dwell(cfg.collapse_persist, cfg.collapse_dwell)}
        self.heads = {s: Episodes(enter.get(s, Dwell(1, 0)), leave) for s in STATES}
        self.layers: dict[str, dict[str, bool]] = {s: {} for s in STATES}  # state -> layer label -> in it
        self.derive = False  # a state of heads only (format 2): each layer's membership is derived, silently
        self.n_heads: dict[str, int] = {}  # layer label -> its heads (as sampled)

    def step(self, step: int, label: str, m: dict[str, np.ndarray]) -> list[tuple[str, str, Opened | Closed]]:
        """The events of one layer's sample: (state, head key or layer label, event)."""
        rows = float(m["attn_rows"][0])
        self.n_heads[label] = len(m["attn_entropy"])
        u = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
        entropy, rank = m["attn_entropy"].tolist(), m["attn_rank"].tolist()
        out = []
        n = len(entropy)
        for h, (e, r) in enumerate(zip(entropy, rank)):
            key = head_key(label, h, n)
            for state, episodes in self.heads.items():
                inside, outside = tests(state, e, r, rows, u, self.cfg)
                if state == "benign" and self.heads["malignant"].since(key) is not None:
                    inside = False  # a (would-be) malignant head that regains rank for a moment is not benign
                event = episodes.update(key, step, inside, outside)
                if event is not None:
                    out.append((state, key, event))
        for state, episodes in self.heads.items():
            need = layer_needs(n, self.cfg)
            active = [h for h in range(n) if episodes.active(head_key(label, h, n))]
            # a layer enters a state when enough heads hold it at once, and leaves it when too few are still in
            # it: a head already on its way out (its exit dwell under way) does not open a layer, or a layer
            # would be "established" by a head whose attention had left the state before the others entered
            # it (say, a layer opened at step 75 by a head whose exit began at 52)
            holding = [h for h in active if episodes.holding(head_key(label, h, n))]
            if label not in self.layers[state] and self.derive:  # resumed from heads only: known, not news
                self.layers[state][label] = len(active) >= need
            was = self.layers[state].get(label, False)
            now = len(active) >= need if was else len(holding) >= need
            if now != was:
                self.layers[state][label] = now
                if now:
                    sinces = sorted(episodes.since(head_key(label, h, n)) for h in holding)
                    event = Opened(sinces[need - 1])
                else:  # the layer's state ended where the exit of the head that left it began
                    ends = [e.until for st, w, e in out if st == state and isinstance(e, Closed)]
                    event = Closed(-1, min(ends, default=step))
                out.append((state, label, event))
        return out

    def state_dict(self) -> dict:
        return {"heads": {s: e.state_dict() for s, e in self.heads.items()}, "layers": self.layers}

    def load_state_dict(self, state: dict) -> None:
        for s, e in state.get("heads", {}).items():
            self.heads[s].load_state_dict(e)
        self.layers = {s: dict(state.get("layers", {}).get(s, {})) for s in STATES}


def _has_attention(m: dict) -> bool:
    return "attn_entropy" in m and "attn_rank" in m and "attn_rows" in m


def episodes_of(observations: Iterable[Observation], cfg: StatesConfig) -> list[StateEpisode]:
    """Every state episode of a run, heads and layers, from its observations in step order (the evaluation's
    ground truth reads the attention logged at every step); the same definition as the live detector."""
    machine = _Machine(cfg)
    open_: dict[tuple[str, str], tuple[int, int]] = {}
    done: list[StateEpisode] = []
    for obs in observations:
        for label, m in obs.layers.items():
            if not _has_attention(m):
                continue
            for state, where, event in machine.step(obs.step, label, m):
                if isinstance(event, Opened):
                    open_[(state, where)] = (event.since, obs.step)
                else:
                    since, opened = open_.pop((state, where))
                    done.append(StateEpisode(state, where, since, opened, event.until))
    done += [StateEpisode(s, w, since, opened, None) for (s, w), (since, opened) in open_.items()]
    return sorted(done, key=lambda e: (e.opened, e.where, e.state))


class AttentionStates(Detector):
    """Records of the three states on every head and layer (needs the ``attention`` signal)."""

    def __init__(self, cfg: StatesConfig) -> None:
        self.cfg = cfg
        self.machine = _Machine(cfg)
        self.open_since: dict[str, int] = {}  # "state|where" -> since, for the layer records' resolved message
        self.step = -1  # the last step observed
        self.recurrence = Recurrence()  # at most three records per head (or layer) and state
        # head key -> the first sample of its stay between the malignant entry and exit lines (neither in a
        # malignant episode nor a candidate): the collapse risk confirms the layer when a head comes there
        self.between: dict[str, int] = {}

    def wants_attention(self) -> str | None:
        """A head in a malignant state not yet established: the next close sample confirms or clears it (at the
        default cadence's 50 steps the collapse would be established that much later)."""
        episodes = self.machine.heads["malignant"]
        pending = [k for k in episodes.keys if episodes.since(k) is not None and not episodes.active(k)]
        return f"a malignant state is being confirmed on {pending[0]}" if pending else None

    def confirming(self) -> int:
        """Steps of close attention samples a malignant state being confirmed still needs (0: none is): from
        the first sample of its dwell up to twice ``collapse_dwell`` on (a candidate still pending after that
        sits between the lines, which the ordinary closer look follows). Judged on samples 10 or 50 steps
        apart, the dwell misses what happens between them: on the evaluation's runs (docs/alerts.md#evaluation)
        sparse samples establish layer states that the attention of every step does not have, and miss some
        that it has."""
        episodes = self.machine.heads["malignant"]
        ends = [episodes.since(k) + 2 * self.cfg.collapse_dwell - self.step for k in episodes.keys
                if episodes.since(k) is not None and not episodes.active(k)]
        return max(max(ends, default=0), 0)

    def watching(self) -> str | None:
        """A layer one established head short of the malignant state (not in it): its next head to enter
        would make a layer collapse, whose dwell the Monitor can count only from the first sample that shows
        it, so it samples attention every ``CloserLookConfig.watch_every`` steps meanwhile."""
        episodes, layers = self.machine.heads["malignant"], self.machine.layers["malignant"]
        for label, n in self.machine.n_heads.items():
            if layers.get(label, False):
                continue
            held = sum(episodes.holding(head_key(label, h, n)) for h in range(n))
            if held >= 1 and held + 1 >= layer_needs(n, self.cfg):
                return f"{label} is one head short of a malignant collapse"
        return None

    def holds(self, state: str, key: str) -> bool:
        """Whether the head ``key`` is established in ``state`` and not on its way out."""
        return self.machine.heads[state].holding(key)

    def layer_in(self, state: str, label: str) -> bool:
        return self.machine.layers[state].get(label, False)

    def observe(self, obs: Observation) -> list[Alert]:
        alerts: list[Alert] = []
        self.step = max(self.step, obs.step)
        for label, m in obs.layers.items():
            if _has_attention(m):
                events = []
                for s, w, e in self.machine.step(obs.step, label, m):
                    n = self.recurrence.announce(f"{s}|{w}", e)
                    if n is not None:
                        events.append((s, w, e, n))
                    elif isinstance(e, Closed):  # the held episode of a recurring key ended unannounced
                        self.open_since.pop(f"{s}|{w}", None)
                self._between(obs.step, label, m)
                heads = [(s, w, e, n) for s, w, e, n in events if "/" in w]
                alerts += group_heads(label, [self._alert(obs.step, s, w, e, m, n) for s, w, e, n in heads])
                alerts += [self._alert(obs.step, s, w, e, m, n) for s, w, e, n in events if "/" not in w]
        return alerts

    def _between(self, step: int, label: str, m: dict) -> None:
        """Note the heads of ``label`` between the malignant lines at this sample (neither inside the entry lines
        nor beyond the exit lines) that are neither in a malignant episode nor a candidate for one (that is
        confirmed by :meth:`confirming`), each from the first sample of its stay there: a head hovering at the
        line, which samples 10 steps apart can keep missing inside."""
        rows = float(m["attn_rows"][0])
        u = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
        n, episodes = len(m["attn_entropy"]), self.machine.heads["malignant"]
        for h, (e, r) in enumerate(zip(m["attn_entropy"].tolist(), m["attn_rank"].tolist())):
            key = head_key(label, h, n)
            inside, outside = tests("malignant", e, r, rows, u, self.cfg)
            measured = math.isfinite(e) and math.isfinite(r)  # a sample that is not finite passes neither test
            if measured and not inside and not outside and episodes.since(key) is None:
                self.between.setdefault(key, step)
            else:
                self.between.pop(key, None)

    def entered_between(self, label: str) -> int | None:
        """The latest step at which a head of layer ``label`` (neither in a malignant episode nor a candidate)
        came between the malignant lines and is there still, or None."""
        return max((s for k, s in self.between.items() if k.split("/")[0] == label), default=None)

    def _alert(self, step: int, state: str, where: str, event: Opened | Closed, m: dict, n: int = 1) -> Alert:
        scope = "head" if "/" in where else "layer"
        kind, level = KINDS[state], LEVELS.get((state, scope), "info")
        rows = float(m["attn_rows"][0])
        if scope == "head":
            h = int(where.split("/")[1][1:])
            e, r = float(m["attn_entropy"][h]), float(m["attn_rank"][h])
        else:
            e, r = float(np.min(m["attn_entropy"])), float(np.min(m["attn_rank"]))
        values = {"attn_entropy": e, "attn_rank": r, "attn_rows": rows}
        what, todo, head_note = WHAT[kind]
        key = f"{state}|{where}"
        if isinstance(event, Closed):
            since = self.open_since.pop(key, event.since)
            values["duration_steps"] = float(event.until - since)
            return Alert(step, kind, "info", where, f"resolved: {what.split(':')[0]} ended at step {event.until} "
                         f"after {event.until - since} steps", values, "resolved", since)
        self.open_since[key] = event.since
        again = (f" It is the {'layer' if scope == 'layer' else 'head'}'s second episode of this state: it keeps "
                 "returning to it, so this episode's end and any later one are not announced (the attention "
                 "scalars show them)." if n > 1 else "")
        if scope == "layer":
            n = len(m["attn_entropy"])
            heads = [k for k in (head_key(where, h, n) for h in range(n)) if self.machine.heads[state].active(k)]
            values["heads"] = float(len(heads))
            message = (f"{len(heads)} of {n} heads of the layer in {what}; entropy down to {e:.2f} nats, effective "
                       f"rank {r:.1f} of {rows:.0f} rows, since step {event.since}.{again} What to do: "
                       f"{todo.format(since=event.since)}")
            return Alert(step, kind, level, where, message, values, "firing", event.since, tuple(heads))
        note = f"; {head_note}" if head_note else ""
        message = (f"{what}; entropy {e:.2f} nats, effective rank {r:.1f} of {rows:.0f} rows, since step "
                   f"{event.since}.{again} What to do: {todo.format(since=event.since)}{note}")
        return Alert(step, kind, level, where, message, values, "firing", event.since)

    def state_dict(self) -> dict:
        return {"attention_states": {**self.machine.state_dict(), "open_since": dict(self.open_since),
                                     "recurrence": self.recurrence.state_dict(), "between": dict(self.between)}}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get("attention_states")
        if mine is None and "attention_episodes" in state:  # format 2: head episodes only; layers from them
            mine = {"heads": state["attention_episodes"]}
            self.machine.derive = True
        if mine is not None:
            self.machine.load_state_dict(mine)
            self.open_since = dict(mine.get("open_since", {}))
            self.recurrence.load_state_dict(mine.get("recurrence", {}))
            self.between = {k: int(v) for k, v in mine.get("between", {}).items()}


def group_heads(label: str, alerts: list[Alert]) -> list[Alert]:
    """Head records of one kind and status that several heads of layer ``label`` share at one step: one
    record, ``where = "Lxx/H00+H03"`` (never the layer's own ``"Lxx"``, which the layer records use)."""
    groups: dict[tuple[str, str], list[Alert]] = {}
    for a in alerts:
        groups.setdefault((a.kind, a.status), []).append(a)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out += group
            continue
        first = group[0]
        where = label + "/" + "+".join(a.where.split("/")[1] for a in group)
        values = {**first.values, "heads": float(len(group))}
        message = f"{len(group)} heads together (values of {first.where.split('/')[-1]}): {first.message}"
        out.append(Alert(first.step, first.kind, first.level, where, message, values, first.status,
                         min(a.since for a in group if a.since is not None), tuple(a.where for a in group)))
    return out
