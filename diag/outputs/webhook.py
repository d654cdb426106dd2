"""Alerts that reach a person: an ``on_alert`` callback that posts each episode to a chat webhook.

    from diag.outputs.webhook import AlertWebhook

    monitor = Monitor(model, logdir="runs/exp1", on_alert=AlertWebhook(os.environ["SLACK_WEBHOOK_URL"]))

Each post is Slack's incoming-webhook JSON, ``{"text": "..."}`` (Mattermost, Rocket.Chat and Discord's
``/slack`` endpoints take the same), sent with the standard library (``urllib.request``) by a background thread,
so a slow or absent server never holds a training step. One message when an episode starts (status ``firing``)
and one when it ends (``resolved``); an episode is its ``(kind, where, since)``, and a record of an episode
already posted is never posted again. Levels below ``min_level`` (default ``"warning"``: not the ``info``
alerts) are not posted. A failed post is logged once (the ``diag`` logger) and the next ones are still tried;
nothing raises into training.

It is a library helper, not only an example, because the rules it keeps (one message per episode and status, a
timeout, no exception and no wait on the training thread) are the part a copied recipe gets wrong.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.request

from diag.detectors.base import LEVELS, Alert
from diag.outputs.alert_sink import console_line

__all__ = ["AlertWebhook", "slack_text"]

log = logging.getLogger("diag")
ICONS = {"info": ":information_source:", "warning": ":warning:", "critical": ":rotating_light:"}


def slack_text(a: Alert, run: str | None = None) -> str:
    """``:warning: [run] diag alert <kind> at <where>, step <n>: <message> (docs/alerts.md#<kind>)``."""
    icon = ":white_check_mark:" if a.status == "resolved" else ICONS.get(a.level, "")
    return f"{icon} {f'[{run}] ' if run else ''}{console_line(a)}"


class AlertWebhook:
    """An ``on_alert`` callback: posts ``{"text": ...}`` to ``url`` once per episode start and end.

    Args:
        url: the incoming-webhook URL.
        run: a name put in each message (which run is speaking).
        min_level: the lowest level posted: ``"info"``, ``"warning"`` (default) or ``"critical"``.
        timeout: seconds per post.

    :meth:`close` waits (at most ``timeout`` per post left) for the posts in flight; ``posted`` counts the posts
    the server accepted.
    """

    def __init__(self, url: str, *, run: str | None = None, min_level: str = "warning", timeout: float = 5.0) -> None:
        if min_level not in LEVELS:
            raise ValueError(f"AlertWebhook(min_level={min_level!r}): expected one of {LEVELS}")
        self.url, self.run, self.timeout = url, run, timeout
        self.min_rank = LEVELS.index(min_level)
        self.posted = 0
        self._seen: set[tuple] = set()  # (kind, where, since, status) already queued
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._failed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, a: Alert) -> None:
        try:
            if LEVELS.index(a.level) < self.min_rank:
                return
            key = (a.kind, a.where, a.since if a.since is not None else a.step, a.status)
            with self._lock:
                if key in self._seen:
                    return
                self._seen.add(key)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._post_all, name="attnscope-webhook", daemon=True)
                    self._thread.start()
            self._queue.put(slack_text(a, self.run))
        except Exception as err:  # noqa: BLE001 - an alert channel never stops training
            self._report(err)

    def close(self) -> None:
        """Send what is queued, then stop the sender thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout * (self._queue.qsize() + 1))
            self._thread = None

    def _post_all(self) -> None:
        while (text := self._queue.get()) is not None:
            self._post(text)

    def _post(self, text: str) -> None:
        request = urllib.request.Request(self.url, data=json.dumps({"text": text}).encode("utf-8"),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
            self.posted += 1
        except Exception as err:  # noqa: BLE001 - reported once; the next alerts are still tried
            self._report(err)

    def _report(self, err: Exception) -> None:
        if not self._failed:
            self._failed = True
            log.error("diag: the alert webhook failed (%r); alerts still go to the log and alerts.jsonl, and later "
                      "ones are still posted (this is reported once)", err)
