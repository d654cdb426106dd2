"""The replay's records matched to the ground truth's onsets: per layer and per head, within a window on both sides.

A record counts only against the onsets of its own layer (a head's record, of its own head): a record on layer
``L01`` says nothing about a collapse of ``L02``. It is a *hit* for an episode whose onset (its ``opened``
step) it follows by at most ``after`` steps and precedes by at most ``before``; every record that is a hit for
none of its layer's (head's) episodes, on a layer with no episode or outside every window, is a *false record*.
A layer (head) is judged on its first episode: its collapse is *caught* when a record is a hit for it.

The window, ``COLLAPSE`` (a layer's or a head's ``malignant_collapse`` record): at most ``collapse_dwell`` (10)
steps early, at most 50 late. A record can precede the every-step onset only when the detectors, sampling fewer
steps, met the entry dwell on samples of the same entry run that skipped a sample the every-step dwell counted (a
layer's onset is normally its needed head's ``since`` plus the dwell); earlier than one dwell before the onset it
is the record of a state the every-step attention did not have yet. 50 late is the goal's own bound ("within 50
steps").
"""

from __future__ import annotations

from dataclasses import dataclass

from evaluation.groundtruth import Episode

__all__ = ["COLLAPSE", "Window", "match", "records_of"]


@dataclass(frozen=True)
class Window:
    """A record at ``step`` is a hit for an onset when ``onset - before <= step <= onset + after``."""

    before: int
    after: int

    def holds(self, step: int, onset: int) -> bool:
        return onset - self.before <= step <= onset + self.after


COLLAPSE = Window(10, 50)


def records_of(alerts: list, kind: str, scope: str) -> list[tuple[str, int]]:
    """The firing records of ``kind`` as (head or layer, step): ``scope="layer"`` the layer records (``"L03"``),
    ``"head"`` the head records, one per head where a record stands for several (``Alert.heads``)."""
    out = []
    for a in alerts:
        if a.kind != kind or a.status != "firing" or ("/" in a.where) != (scope == "head"):
            continue
        out += [(where, a.step) for where in (a.heads or (a.where,) if scope == "head" else (a.where,))]
    return out


def match(records: list[tuple[str, int]], onsets: dict[str, list[Episode]], window: Window, end: int) -> dict:
    """Each head or layer with an episode, judged on its first (``onsets``: every malignant episode of each, in
    the order opened), and the false records. ``end``: the run's last step (a first onset within ``after``
    steps of it that got no record is *censored*: whether its record would have come in time is unknown).

    Returns ``{"onsets": [{"where", "onset", "since", "baseline", "record", "in_time", "lead", "censored"}],
    "false": [{"where", "step"}]}``; ``record`` is the first hit (None: missed), ``lead`` the onset minus it."""
    judged = []
    for where, episodes in sorted(onsets.items()):
        first = episodes[0]
        hits = sorted(step for w, step in records if w == where and window.holds(step, first.opened))
        record = hits[0] if hits else None
        judged.append({"where": where, "onset": first.opened, "since": first.since, "baseline": first.baseline,
                       "record": record, "in_time": record is not None,
                       "lead": None if record is None else first.opened - record,
                       "censored": record is None and first.opened + window.after > end})
    false = [{"where": w, "step": step} for w, step in sorted(records, key=lambda r: (r[1], r[0]))
             if not any(window.holds(step, e.opened) for e in onsets.get(w, ()))]
    return {"onsets": judged, "false": false}
