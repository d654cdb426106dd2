"""The attention states, defined once: malignant (sparse and low-rank), benign (sparse, full-rank), uniform, sink.

Qi et al.: "malignant entropy collapse" is attention that is *sparse yet low-rank* (every query puts its mass on
the same one or few keys); it precedes the crash. *Benign* collapse is sparse but full-rank (each query on a
different key, e.g. near-identity attention in a ViT's first block); training stays stable. Low rank without
sparsity is uniform attention. An *attention sink* (Xiao et al. 2023; Gu et al. 2024) is sparse and low-rank
too, but its mass sits on one key position that every query of every sequence shares (the first token of
pretrained language models): a head with nothing to add attends to a key whose value is near zero, and the loss
does not suffer. The collapsed heads of the runs the alerts are built for spread their mass over 4-10 keys that
differ between sequences instead (docs/metrics.md#attention-sinks). Entropy alone cannot tell these apart; rank
and where the mass goes are needed too.

The definition, used alike by the live detector (:class:`AttentionStates`) and, written a second time, by the
evaluation's implementation check (``evaluation/replica.py``), has four parts:

* **lines, per sample and head**: sparse when the attention entropy is at most ``sparse_entropy`` nats; low-rank
  when the effective rank is at most ``1 + low_rank_frac * (rows - 1)`` (rank 1 is the floor: every row the
  same); a sink when sparse, with at least ``sink_share`` of the queries' mass on one key position
  (``attn_sink``), the same position in every sampled sequence; malignant when
  sparse and low-rank and not a sink; uniform when low-rank with an entropy of at least ``uniform_frac`` of
  uniform attention's over the same keys. An exit line sits ``exit_factor`` beyond each entry line (hysteresis).
* **dwell, per head**: a head *enters* malignant or sink once the entry test held at ``collapse_persist`` samples
  spanning ``collapse_dwell`` steps (benign and uniform at once; samples between the lines do not break it, one
  beyond the exit line does). A sink is a lasting feature of a head: the collapsed heads of a run at a high
  learning rate can put half their mass on one shared position for a sample now and then (0.2-0.65 from sample
  to sample), and one such sample does not make them sinks; it *leaves* once the exit test held at 2 samples
  spanning ``exit_dwell`` steps (samples between the lines, or not finite, change nothing there either).
  ``since`` is the first sample of the dwell.
* **layers**: a layer is in a state while at least ``layer_share`` of its heads, and at least 2 when it has 2 or
  more, are in it; it enters at the step the last of those heads entered.
* **baseline**: an episode whose dwell began at the first attention sample of its layer is the model's baseline:
  what it looked like when monitoring began (a pretrained model's sinks, a fine-tune's starting point), not an
  event of this run.

A head or layer entering ``malignant`` is a ``malignant_collapse`` record at level warning (one head can be a
deliberate pointer head; a critical record needs damage, :mod:`diag.detectors.damage`); ``attention_sink``,
``benign_collapse`` and ``uniform_attention`` records are info, and so is every baseline episode's record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from diag.catalog.alerts import ALERTS
from diag.catalog.tags import head_label
from diag.detectors.base import Alert, Detector, Observation
from diag.detectors.config import StatesConfig
from diag.detectors.episodes import Closed, Dwell, Episodes, Opened, Recurrence

__all__ = ["AttentionStates", "STATES", "StateEpisode", "episodes_of", "head_key", "lines"]

STATES = ("malignant", "benign", "uniform", "sink")
KINDS = {"malignant": "malignant_collapse", "benign": "benign_collapse", "uniform": "uniform_attention",
         "sink": "attention_sink"}
LEVELS = {"malignant": "warning"}  # the rest, and every baseline episode: info
# kind -> (what it is, what to do: both from the catalog, diag/catalog/alerts.py; a head's note)
HEAD_NOTES = {"malignant_collapse": "one head alone can be a deliberate pointer head: watch whether more heads of "
              "the layer follow and whether the loss still falls (collapse_stall says when it stops)"}
WHAT = {kind: (ALERTS[kind].means, ALERTS[kind].todo, HEAD_NOTES.get(kind, "")) for kind in KINDS.values()}
BASELINE = ("present when monitoring began (the model came with it, e.g. a pretrained model's heads): a "
            "baseline, not an event of this run", "nothing by itself; a head or layer that enters it later is "
            "recorded at its own level")


def head_key(label: str, h: int, n_heads: int) -> str:
    """``"L03/H05"``: the key (and ``where``) of one head, numbered as its tags are."""
    return f"{label}/{head_label(h, n_heads)}"


def lines(rows: float, cfg: StatesConfig) -> tuple[float, float]:
    """(sparse entropy line in nats, low-rank line) for attention over ``rows`` rows."""
    return cfg.sparse_entropy, 1.0 + cfg.low_rank_frac * max(rows - 1.0, 0.0)


def tests(state: str, e: float, r: float, rows: float, u: float, cfg: StatesConfig,
          share: float = 0.0) -> tuple[bool, bool]:
    """(entry test, exit test) of one state for one sample; the exit lines sit exit_factor beyond the entry
    lines. ``share``: the sample's ``attn_sink``. A sample that is not finite passes neither (it changes
    nothing)."""
    if not (math.isfinite(e) and math.isfinite(r)):
        return False, False
    sparse_line, rank_line = lines(rows, cfg)
    f = cfg.exit_factor
    sink = e <= sparse_line and share >= cfg.sink_share
    if state == "sink":
        return sink, e > f * sparse_line or share < cfg.sink_share / f
    if state == "malignant":
        return e <= sparse_line and r <= rank_line and not sink, e > f * sparse_line or r > f * rank_line
    if state == "benign":
        return e <= sparse_line and r > rank_line and not sink, e > f * sparse_line
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
    baseline: bool = False  # its dwell began at the layer's first attention sample


class _Machine:
    """The definition's state machine over a stream of samples, per state: head episodes and layer episodes."""

    def __init__(self, cfg: StatesConfig) -> None:
        self.cfg = cfg
        leave = Dwell(2, cfg.exit_dwell)
        persist = Dwell(cfg.collapse_persist, cfg.collapse_dwell)
        enter = {"malignant": persist, "sink": persist}
        self.heads = {s: Episodes(enter.get(s, Dwell(1, 0)), leave) for s in STATES}
        self.layers: dict[str, dict[str, bool]] = {s: {} for s in STATES}  # state -> layer label -> in it
        self.layer_since: dict[str, dict[str, int]] = {s: {} for s in STATES}  # ... -> since, while in it
        self.derive = False  # a state of heads only (format 2): each layer's membership is derived, silently
        self.n_heads: dict[str, int] = {}  # layer label -> its heads (as sampled)
        self.first: dict[str, int] = {}  # layer label -> the step of its first attention sample
        self.first_unknown = False  # resumed from a state that did not keep it: no episode is a baseline
        self.sparse_first: set[str] = set()  # heads sparse at their layer's first sample (sinks, a baseline state)

    def baseline(self, label: str, since: int | None) -> bool:
        """Whether an episode of layer ``label`` that began at ``since`` is the model's baseline."""
        return since is not None and since == self.first.get(label)

    def step(self, step: int, label: str, m: dict[str, np.ndarray]) -> list[tuple[str, str, Opened | Closed]]:
        """The events of one layer's sample: (state, head key or layer label, event)."""
        first = label not in self.first
        self.first.setdefault(label, -1 if self.first_unknown else step)
        rows = float(m["attn_rows"][0])
        self.n_heads[label] = n = len(m["attn_entropy"])
        u = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
        shares = m["attn_sink"].tolist() if "attn_sink" in m else [0.0] * n
        out = []
        for h, (e, r, share) in enumerate(zip(m["attn_entropy"].tolist(), m["attn_rank"].tolist(), shares)):
            key = head_key(label, h, n)
            if first and not self.first_unknown and math.isfinite(e) and e <= self.cfg.sparse_entropy:
                self.sparse_first.add(key)
            for state, episodes in self.heads.items():
                inside, outside = tests(state, e, r, rows, u, self.cfg, share if math.isfinite(share) else 0.0)
                if state == "benign" and self.heads["malignant"].since(key) is not None:
                    inside = False  # a (would-be) malignant head that regains rank for a moment is not benign
                event = episodes.update(key, step, inside, outside)
                if event is not None:
                    out.append((state, key, event))
        for state, episodes in self.heads.items():
            out += self._layer(state, episodes, label, n, step, out)
        return out

    def _layer(self, state: str, episodes: Episodes, label: str, n: int, step: int,
               events: list) -> list[tuple[str, str, Opened | Closed]]:
        """The layer's event in ``state`` after its heads' (``events``), if any.

        A layer enters a state when enough heads hold it at once, and leaves it when too few are still in it: a
        head already on its way out (its exit dwell under way) does not open a layer, or a layer would be
        "established" by a head whose attention had left the state before the others entered it."""
        need = layer_needs(n, self.cfg)
        active = [h for h in range(n) if episodes.active(head_key(label, h, n))]
        holding = [h for h in active if episodes.holding(head_key(label, h, n))]
        if label not in self.layers[state] and self.derive:  # resumed from heads only: known, not news
            self.layers[state][label] = len(active) >= need
        was = self.layers[state].get(label, False)
        now = len(active) >= need if was else len(holding) >= need
        if now == was:
            return []
        self.layers[state][label] = now
        if now:
            sinces = sorted(episodes.since(head_key(label, h, n)) for h in holding)
            self.layer_since[state][label] = sinces[need - 1]
            return [(state, label, Opened(sinces[need - 1]))]
        self.layer_since[state].pop(label, None)
        # where its state ended: at the exit of the head that took it below the heads it needs (of those that
        # closed at this sample, in the order their exits began)
        ends = sorted(e.until for st, w, e in events if st == state and "/" in w and w.startswith(label + "/")
                      and isinstance(e, Closed))
        before = len(active) + len(ends)
        return [(state, label, Closed(-1, ends[before - need] if 0 <= before - need < len(ends) else step))]

    def state_dict(self) -> dict:
        return {"heads": {s: e.state_dict() for s, e in self.heads.items()}, "layers": self.layers,
                "layer_since": self.layer_since, "first": self.first, "sparse_first": sorted(self.sparse_first)}

    def load_state_dict(self, state: dict) -> None:
        for s, e in state.get("heads", {}).items():
            self.heads[s].load_state_dict(e)
        self.layers = {s: dict(state.get("layers", {}).get(s, {})) for s in STATES}
        self.layer_since = {s: {k: int(v) for k, v in state.get("layer_since", {}).get(s, {}).items()}
                            for s in STATES}
        self.first = {k: int(v) for k, v in state.get("first", {}).items()}
        self.first_unknown = "first" not in state
        self.sparse_first = set(state.get("sparse_first", []))


def _has_attention(m: dict) -> bool:
    return "attn_entropy" in m and "attn_rank" in m and "attn_rows" in m


def episodes_of(observations: Iterable[Observation], cfg: StatesConfig) -> list[StateEpisode]:
    """Every state episode of a run, heads and layers, from its observations in step order; the same machine as
    the live detector (``evaluation/replica.py`` is a second implementation, written apart)."""
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
                    done.append(StateEpisode(state, where, since, opened, event.until,
                                             machine.baseline(where.split("/")[0], since)))
    done += [StateEpisode(s, w, since, opened, None, machine.baseline(w.split("/")[0], since))
             for (s, w), (since, opened) in open_.items()]
    return sorted(done, key=lambda e: (e.opened, e.where, e.state))


class AttentionStates(Detector):
    """Records of the attention states on every head and layer (needs the ``attention`` signal)."""

    def __init__(self, cfg: StatesConfig) -> None:
        self.cfg = cfg
        self.machine = _Machine(cfg)
        self.open_since: dict[str, int] = {}  # "state|where" -> since, for the layer records' resolved message
        self.step = -1  # the last step observed
        self.recurrence = Recurrence()  # at most three records per head (or layer) and state
        # head key -> the step it came inside or between the malignant lines (not an established sink):
        # sampled at every step for up to twice collapse_dwell from then (near)
        self.nearing: dict[str, int] = {}
        self.over_sink: set[str] = set()  # heads whose last sample held sink_share on one shared position

    def near(self) -> str | None:
        """A head inside or between the malignant lines, not an established sink, of a layer not in the malignant
        state, that came there at most twice ``collapse_dwell`` steps ago: attention at every step settles its
        dwell (malignant or sink: a sample over the sink line alone does not say which), and its
        layer's (a layer's collapse is established at a sample where its heads hold the state together; samples
        50 steps apart can miss it). Longer, a head hovering at a line is sampled at the cadence (a healthy
        model's heads can hover for thousands of steps)."""
        span = 2 * self.cfg.collapse_dwell
        recent = [(since, key) for key, since in self.nearing.items() if self.step - since < span]
        if not recent:
            return None
        since, key = min(recent)
        return f"{key} came near the malignant lines at step {since}"

    def holds(self, state: str, key: str) -> bool:
        """Whether the head ``key`` is established in ``state`` and not on its way out."""
        return self.machine.heads[state].holding(key)

    def layer_in(self, state: str, label: str) -> bool:
        return self.machine.layers[state].get(label, False)

    def layer_since(self, state: str, label: str) -> int | None:
        """Where the layer's episode in ``state`` began, while it lasts."""
        return self.machine.layer_since[state].get(label)

    def baseline(self, label: str, since: int | None) -> bool:
        """Whether an episode of layer ``label`` that began at ``since`` is the model's baseline."""
        return self.machine.baseline(label, since)

    def head_sinces(self, state: str) -> dict[str, set[int]]:
        """Per layer label, where the episodes in ``state`` of its heads began, open or still settling their dwell:
        the steps at which a layer episode that opens later can say it began."""
        episodes, out = self.machine.heads[state], {}
        for key in episodes.keys:
            if (since := episodes.since(key)) is not None:
                out.setdefault(key.rsplit("/", 1)[0], set()).add(since)
        return out

    def on_sink(self, key: str) -> bool:
        """Whether the head ``key`` holds a sink, or its last sample put ``sink_share`` of the queries' mass or more
        on one position shared by the sampled sequences, sparse or not (a sink not yet established, a pretrained
        sink whose remaining mass is spread over a long context, or a collapsed head's mass on one shared position
        for that sample): its attention at that sample has a sink's shape, and a falling entropy there is the
        sink tightening, no trend towards a malignant collapse."""
        return key in self.over_sink or self.holds("sink", key)

    def sparse_at_start(self, key: str) -> bool:
        """Whether the head ``key`` was sparse (a sink, or a state of the model's baseline) at its layer's first
        sample: a pretrained model's specialised head, whose focus is where it started, not a trend."""
        return key in self.machine.sparse_first

    def observe(self, obs: Observation) -> list[Alert]:
        alerts: list[Alert] = []
        self.step = max(self.step, obs.step)
        for label, m in obs.layers.items():
            if not _has_attention(m):
                continue
            events = []
            for s, w, e in self.machine.step(obs.step, label, m):
                n = self.recurrence.announce(f"{s}|{w}", e)
                if n is not None:
                    events.append((s, w, e, n))
                elif isinstance(e, Closed):  # the held episode of a recurring key ended unannounced
                    self.open_since.pop(f"{s}|{w}", None)
            self._note(obs.step, label, m)
            heads = [(s, w, e, n) for s, w, e, n in events if "/" in w]
            alerts += group_heads(label, [self._alert(obs.step, s, w, e, m, n) for s, w, e, n in heads])
            alerts += [self._alert(obs.step, s, w, e, m, n) for s, w, e, n in events if "/" not in w]
        return alerts

    def _note(self, step: int, label: str, m: dict) -> None:
        """Note the heads of ``label`` with a sink's share at this sample (:meth:`on_sink`), and those inside or
        between the malignant lines, not in an established sink, while the layer is not in the malignant state,
        each from the first sample of its stay there (:meth:`near`). A sample over the sink line keeps a head near
        until its sink is established."""
        rows = float(m["attn_rows"][0])
        u = float(m["attn_entropy_uniform"][0]) if "attn_entropy_uniform" in m else math.inf
        n = len(m["attn_entropy"])
        shares = m["attn_sink"].tolist() if "attn_sink" in m else [0.0] * n
        sinks, collapsed = self.machine.heads["sink"], self.layer_in("malignant", label)
        for h, (e, r, share) in enumerate(zip(m["attn_entropy"].tolist(), m["attn_rank"].tolist(), shares)):
            key = head_key(label, h, n)
            share = share if math.isfinite(share) else 0.0
            if share >= self.cfg.sink_share:
                self.over_sink.add(key)
            else:
                self.over_sink.discard(key)
            _, outside = tests("malignant", e, r, rows, u, self.cfg, share)
            measured = math.isfinite(e) and math.isfinite(r)  # a sample that is not finite passes neither test
            if measured and not outside and not sinks.active(key) and not collapsed:
                self.nearing.setdefault(key, step)
            else:
                self.nearing.pop(key, None)

    def _alert(self, step: int, state: str, where: str, event: Opened | Closed, m: dict, n: int = 1) -> Alert:
        scope = "head" if "/" in where else "layer"
        label = where.split("/")[0]
        kind = KINDS[state]
        rows = float(m["attn_rows"][0])
        h = int(where.split("/")[1][1:]) if scope == "head" else None
        pick = (lambda metric: float(m[metric][h])) if h is not None else (lambda metric: float(np.min(m[metric])))
        e, r = pick("attn_entropy"), pick("attn_rank")
        values = {"attn_entropy": e, "attn_rank": r, "attn_rows": rows}
        what, todo, head_note = WHAT[kind]
        key = f"{state}|{where}"
        if isinstance(event, Closed):
            since = self.open_since.pop(key, event.since)
            values["duration_steps"] = float(event.until - since)
            return Alert(step, kind, "info", where, f"resolved: {what.split(':')[0]} ended at step {event.until} "
                         f"after {event.until - since} steps", values, "resolved", since)
        self.open_since[key] = event.since
        baseline = self.machine.baseline(label, event.since)
        level = "info" if baseline else LEVELS.get(state, "info")
        if state == "sink" and h is not None and "attn_sink" in m:
            values["attn_sink"] = pick("attn_sink")
            where_to = f"key position {pick('attn_sink_pos'):.0f}" if "attn_sink_pos" in m else "one key position"
            if "attn_sink_pos" in m:
                values["attn_sink_pos"] = pick("attn_sink_pos")
            what = f"{what}; {where_to} holds {values['attn_sink']:.2f} of the mass"
        if baseline:
            what, todo, head_note = f"{what}; {BASELINE[0]}", BASELINE[1], ""
        again = (f" It is the {'layer' if scope == 'layer' else 'head'}'s second episode of this state: it keeps "
                 "returning to it, so this episode's end and any later one are not announced (the attention "
                 "scalars show them)." if n > 1 else "")
        todo = todo.format(since=event.since)
        if scope == "layer":
            n_heads = len(m["attn_entropy"])
            heads = [k for k in (head_key(where, i, n_heads) for i in range(n_heads))
                     if self.machine.heads[state].active(k)]
            values["heads"] = float(len(heads))
            message = (f"{len(heads)} of {n_heads} heads of the layer in {what}; entropy down to {e:.2f} nats, "
                       f"effective rank {r:.1f} of {rows:.0f} rows, since step {event.since}.{again} What to do: "
                       f"{todo}")
            return Alert(step, kind, level, where, message, values, "firing", event.since, tuple(heads))
        note = f"; {head_note}" if head_note else ""
        message = (f"{what}; entropy {e:.2f} nats, effective rank {r:.1f} of {rows:.0f} rows, since step "
                   f"{event.since}.{again} What to do: {todo}{note}")
        return Alert(step, kind, level, where, message, values, "firing", event.since)

    def state_dict(self) -> dict:
        return {"attention_states": {**self.machine.state_dict(), "open_since": dict(self.open_since),
                                     "recurrence": self.recurrence.state_dict(), "nearing": dict(self.nearing),
                                     "step": self.step}}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get("attention_states")
        if mine is None and "attention_episodes" in state:  # format 2: head episodes only; layers from them
            mine = {"heads": state["attention_episodes"]}
            self.machine.derive = True
        if mine is not None:
            self.machine.load_state_dict(mine)
            self.open_since = dict(mine.get("open_since", {}))
            self.recurrence.load_state_dict(mine.get("recurrence", {}))
            self.nearing = {k: int(v) for k, v in mine.get("nearing", {}).items()}
            self.step = int(mine.get("step", -1))


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
