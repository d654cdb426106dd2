"""What the Monitor draws for TensorBoard at a sampled step, apart from the scalars themselves.

* the custom-scalars layout, once, from the first sampled step's tags (:mod:`diag.outputs.tb_layout`);
* the alert events: at every sampled step, the number of alerts of each level raised there (zero
  when none), in the runs ``alerts/critical``, ``alerts/warning``, ``alerts/info``: spikes at the
  steps where alerts fired, never a line joining two far-apart alerts;
* the constants of the attention sample (``attn_rows``, ``attn_entropy_uniform`` per layer): a
  text table, once;
* at image steps: layer x head heatmaps and the update-ratio strips, with axes, tick values and
  colour bars (:mod:`diag.outputs.figures`, matplotlib imported then); at every sampled step the
  attention maps of the heads an alert names. They are drawn on a worker thread
  (:class:`diag.outputs.drawer.Drawer`) from copies of their data and written, at their own step, at
  the next sampled step or at :meth:`TensorBoardViews.close`.

No live model here: the Monitor hands in its record, per-layer arrays, the captured attention
maps by layer label, and the alerts. :func:`image_options` checks the Monitor's ``images`` and
``image_every`` and gives their defaults (docs/tensorboard.md).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Mapping, Sequence

import numpy as np

from diag.catalog.metrics import metrics_with, update_metric_names
from diag.errors import ConfigError
from diag.outputs.drawer import Drawer, Drawn
from diag.outputs.images import UpdateRatioHistory, flagged_heads
from diag.outputs.sinks import FanOut, Record
from diag.outputs.tb_layout import ALERT_EVENT_TAG, ALERT_LEVELS, alert_run, build_layout

__all__ = ["TensorBoardViews", "constants_table", "alert_events", "image_options"]


def image_options(images: bool | None, image_every: int | None, *, full: int, periods: Mapping[str, int],
                  every: int | None, logdir: bool) -> tuple[bool, int]:
    """The Monitor's ``images`` and ``image_every``, checked, with their defaults: images when the run has a
    ``logdir`` (and Pillow, which encodes them), every ten ``full`` periods (the steps that sample every family:
    ``periods``, family -> steps between samples; ``every``: the Monitor's uniform period, if it was given)."""
    if image_every is None:
        image_every = 10 * full
    if isinstance(image_every, bool) or not isinstance(image_every, int) or image_every < 1 or image_every % full:
        period = f"every={full}" if every == full else \
            f"{full} (the steps that sample every family, cadence {dict(periods)})"
        raise ConfigError(f"Monitor(image_every={image_every!r}): expected a positive multiple of {period} "
                          f"(images are drawn at sampled steps), e.g. image_every={10 * full}")
    if images is not None and not isinstance(images, bool):
        raise ConfigError(f"Monitor(images={images!r}): expected True, False or None (None: when logdir is set)")
    pillow = importlib.util.find_spec("PIL") is not None  # SummaryWriter.add_image encodes with Pillow
    if images and not pillow:
        raise ConfigError("Monitor(images=True) needs Pillow to encode PNGs: pip install pillow (or images=False)")
    return (logdir and pillow) if images is None else images, image_every


def alert_events(alerts: Sequence) -> dict[str, dict[str, float]]:
    """``{run: {"alerts_raised": count}}`` for every level, zero included."""
    counts = dict.fromkeys(ALERT_LEVELS, 0.0)
    for alert in alerts:
        if alert.level in counts:
            counts[alert.level] += 1.0
    return {alert_run(level): {ALERT_EVENT_TAG: n} for level, n in counts.items()}


def constants_table(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> str | None:
    """A markdown table of the per-layer constants of the attention sample, or None if there are none."""
    columns = metrics_with("text")
    rows = [(label, metrics) for label, metrics in arrays.items() if any(c.name in metrics for c in columns)]
    if not rows:
        return None
    lines = ["| layer | " + " | ".join(f"{c.title}, {c.unit} (`{c.name}`)" if c.unit else f"{c.title} (`{c.name}`)"
                                      for c in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for label, metrics in rows:
        cells = [f"{float(np.mean(metrics[c.name])):.4g}" if c.name in metrics else "-" for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nThe same at every sampled step of this run (they describe the sample, not "
                               "the model); `attn_entropy` is compared with the second column.")


class TensorBoardViews:
    """The layout, alert events, constants and images of one Monitor's run."""

    def __init__(self, sinks: FanOut, labels: Sequence[str], *, images: bool, image_every: int,
                 updates: bool, with_o: bool) -> None:
        self.sinks, self.labels = sinks, list(labels)
        self.images, self.image_every = images, image_every
        self.updates = update_metric_names("qkvo" if with_o else "qkv") if updates else ()
        self.history = UpdateRatioHistory()
        self.drawer = Drawer()  # the images are drawn on its thread, written at the next sample or at close
        self._layout_written = False
        self._constants_written = False
        if images and updates:
            sinks.add(self.history)  # rides along as a sink: sees the update ratios when they arrive

    def on_sample(self, record: Record, arrays: Mapping[str, Mapping[str, np.ndarray]],
                  maps: Mapping[str, object], alerts: Sequence, complete: bool = True) -> None:
        """maps: layer label -> (heads, queries, keys) attention probabilities of that layer, or None.
        complete: this step sampled every signal family (hooks.monitor.cadence); the layout waits for such a step,
        so that its charts are built from every family's tags."""
        extra = Record(record.step, runs=alert_events(alerts))
        if not self._layout_written and complete:
            self._layout_written = True
            self.sinks.write_layout(build_layout(record.scalars, updates=self.updates))
        if not self._constants_written:
            table = constants_table(arrays)
            if table is not None:
                self._constants_written = True
                extra.texts["run/attention_sample"] = table
        self.sinks.write_view(extra)  # dashboards only: not metrics.jsonl, not the records of a MemorySink
        if self.images:  # after the events: a drawing that fails costs only the images
            draw = self._drawing(record.step, arrays, maps, alerts)
            if draw is not None:
                self.drawer.submit(record.step, draw)
            self._write(self.drawer.ready())

    def close(self) -> None:
        """Wait for the images still being drawn and write them (the sinks are closed after this)."""
        self._write(self.drawer.close())

    def _write(self, drawn: list[Drawn]) -> None:
        """The images drawn, each step's as a record of its step; then the first drawing's error, if one failed."""
        for done in drawn:
            if done.images:
                self.sinks.write(Record(done.step, images=done.images))
        errors = [done.error for done in drawn if done.error is not None]
        if errors:
            raise errors[0]

    def _drawing(self, step: int, arrays: Mapping, maps: Mapping[str, object], alerts: Sequence):
        """A function that draws this step's images on the drawer's thread from copies taken now (the heatmaps'
        arrays and the update ratios so far at image steps, the attention maps of the heads the alerts name), or
        None when the step has none."""
        full = step % self.image_every == 0
        heads = []
        for where, label, head in flagged_heads(alerts):
            layer_maps = maps.get(label)
            if layer_maps is not None and head < layer_maps.shape[0]:
                heads.append((where, layer_maps[head].float().cpu().numpy()))  # (queries, keys)
        if not full and not heads:
            return None
        labels = list(self.labels)
        grids = {label: dict(metrics) for label, metrics in arrays.items()} if full else {}
        history = copy.deepcopy(self.history) if full else None

        def draw() -> dict[str, np.ndarray]:
            from diag.outputs.figures import attention_map_figure, layer_head_figures, update_ratio_figures

            images: dict[str, np.ndarray] = {}
            if history is not None:
                images.update(layer_head_figures(grids, labels, step))
                images.update(update_ratio_figures(history, labels))
            for where, probs in heads:
                images[f"attention_map/{where}"] = attention_map_figure(probs, where, step)
            return images

        return draw
