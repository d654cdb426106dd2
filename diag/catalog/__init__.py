"""The catalog at the bottom of diag: one entry per metric (:mod:`diag.catalog.metrics`), the tag scheme
(:mod:`diag.catalog.tags`) and one entry per alert kind (:mod:`diag.catalog.alerts`: its levels, meaning,
advice and docs section). It imports nothing of diag but :mod:`diag.errors`; everything that writes, charts or
draws a metric reads it here, and every channel's advice on an alert comes from it. A new metric is one entry
in :data:`METRICS`, a new alert kind one in :data:`ALERTS`."""

from diag.catalog.alerts import ALERTS, AlertKind, register_alert
from diag.catalog.metrics import METRICS, Metric
from diag.catalog.tags import Tag, parse_tag, parse_where

__all__ = ["ALERTS", "AlertKind", "METRICS", "Metric", "Tag", "parse_tag", "parse_where", "register_alert"]
