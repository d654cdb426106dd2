"""The catalog at the bottom of diag: one entry per metric (:mod:`diag.catalog.metrics`) and the tag scheme
(:mod:`diag.catalog.tags`). It imports nothing of diag but :mod:`diag.errors`; everything that writes,
charts or draws a metric reads it here. A new metric is one entry in :data:`METRICS`."""

from diag.catalog.metrics import METRICS, Metric
from diag.catalog.tags import Tag, parse_tag, parse_where

__all__ = ["METRICS", "Metric", "Tag", "parse_tag", "parse_where"]
