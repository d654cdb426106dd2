"""Episodes with hysteresis: one alert when a condition starts, one record when it ends.

A condition on one key (a head ``"L03/H05"``, a layer ``"L03"`` or the run ``""``) opens an
episode once its *enter* test has held for a minimum dwell, and closes it once its separate,
looser *exit* test has held for another dwell. Between the two tests nothing changes, so a
value that hovers around one threshold is one episode, not a stream of alerts. Dwells count
both samples and steps, so the same episode is seen at ``every=2`` and at ``every=20``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Dwell", "Episodes", "Opened", "Closed", "Recurrence"]


@dataclass(frozen=True)
class Dwell:
    """Held for at least ``samples`` consecutive samples spanning at least ``steps`` steps
    (``samples <= 1``: at once)."""

    samples: int
    steps: int

    def met(self, count: int, span: int) -> bool:
        return count >= self.samples and (self.samples <= 1 or span >= self.steps)


@dataclass(frozen=True)
class Opened:
    since: int  # the first step of the dwell that opened it


@dataclass(frozen=True)
class Closed:
    since: int  # the step the episode began
    until: int  # the first step of the exit dwell: where the condition ended

    @property
    def duration(self) -> int:
        return self.until - self.since


class Episodes:
    """Per-key hysteresis. State per key: ``[active, since, count, out_since, out_count]``."""

    def __init__(self, enter: Dwell, exit: Dwell) -> None:
        self.enter, self.exit = enter, exit
        self.keys: dict[str, list] = {}

    def active(self, key: str) -> bool:
        return bool(self.keys.get(key, [False])[0])

    def since(self, key: str) -> int | None:
        entry = self.keys.get(key)
        return entry[1] if entry else None

    def holding(self, key: str) -> bool:
        """Active and not on its way out: no exit dwell under way (the last sample that left the between-lines
        band was inside)."""
        entry = self.keys.get(key)
        return bool(entry and entry[0] and entry[3] is None)

    def update(self, key: str, step: int, inside: bool, outside: bool) -> Opened | Closed | None:
        """``inside``: the enter test holds; ``outside``: the exit test holds (never both). Neither
        (between the lines, or not measurable) changes nothing: not the count, not the dwell's start."""
        entry = self.keys.setdefault(key, [False, None, 0, None, 0])
        active, since, count, out_since, out_count = entry
        if not active:
            if outside or (not inside and since is None):
                self.keys[key] = [False, None, 0, None, 0]
                return None
            if not inside:  # between the lines: a candidate stays a candidate
                return None
            since = step if since is None else since
            count += 1
            if self.enter.met(count, step - since):
                self.keys[key] = [True, since, count, None, 0]
                return Opened(since)
            self.keys[key] = [False, since, count, None, 0]
            return None
        if inside:  # back inside: the exit dwell starts again
            self.keys[key] = [True, since, count, None, 0]
            return None
        if not outside:  # between the lines (or not measurable) while open: changes nothing either
            return None
        out_since = step if out_since is None else out_since
        out_count += 1
        if self.exit.met(out_count, step - out_since):
            self.keys[key] = [False, None, 0, None, 0]
            return Closed(since, out_since)
        self.keys[key] = [True, since, count, out_since, out_count]
        return None

    def state_dict(self) -> dict:
        return {key: list(entry) for key, entry in self.keys.items()}

    def load_state_dict(self, state: dict) -> None:
        self.keys = {key: list(entry) for key, entry in state.items()}


class Recurrence:
    """At most three records per key and kind: the first episode (its alert and its ``resolved`` record), and a
    second one, announced as recurring and then held: its end and any later episode of the key are not
    announced. A head that keeps returning to a state is one thing to look at, not a stream of records (a
    hovering head can open six episodes of one kind in a 300-step run); its scalars still show every
    episode. State: ``{key: episodes opened}``."""

    LIMIT = 2  # episodes announced per key

    def __init__(self) -> None:
        self.opened: dict[str, int] = {}

    def announce(self, key: str, event: Opened | Closed) -> int | None:
        """Whether ``event`` on ``key`` becomes a record: the episode's number (1, or 2 for the recurring one)
        for an opening, 1 for the first episode's end; None when it is held back."""
        n = self.opened.get(key, 0)
        if isinstance(event, Opened):
            self.opened[key] = n + 1
            return n + 1 if n < self.LIMIT else None
        return 1 if n <= 1 else None

    def state_dict(self) -> dict:
        return dict(self.opened)

    def load_state_dict(self, state: dict) -> None:
        self.opened = {str(k): int(v) for k, v in (state or {}).items()}
