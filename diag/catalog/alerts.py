"""The catalog of alert kinds: one entry per kind a detector or a hook raises, the one source of its advice.

An entry holds the levels its firing records take (a ``resolved`` record is always info), what the kind
means in one line, what to do in one line, and its section of docs/alerts.md. Every channel reads the advice
here: the detectors end their messages with ``What to do: <todo>`` (so the console line, ``alerts.jsonl``, the
W&B and MLflow alerts and the webhook carry it), and the run report (:mod:`diag.reports.run`) gives a record
whose message has none (a ``resolved`` record, a record of an older run) the entry's advice.

``todo`` may name ``{since}``, the step the episode began (:meth:`AlertKind.what_to_do` fills it in).
A new kind is one :class:`AlertKind` in :data:`ALERTS` (or, for a detector of your own passed to
``Detectors(extra=...)``, :func:`register_alert`) and a ``### <kind>`` section in docs/alerts.md;
``tests/catalog/test_alert_catalog.py`` finds every kind the code raises and fails on one without either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diag.errors import ConfigError

__all__ = ["AlertKind", "ALERTS", "DOCS", "LEVELS", "advice", "register_alert"]

LEVELS = ("info", "warning", "critical")
DOCS = "docs/alerts.md"
_SINCE = re.compile(r"(step )?\{since\}")


@dataclass(frozen=True)
class AlertKind:
    """One alert kind: ``name`` (the records' ``kind``), ``levels`` of its firing records, what it ``means``
    and what to do (``todo``) in a line each, and ``anchor``, its section of docs/alerts.md (default: the
    name)."""

    name: str
    levels: tuple[str, ...]
    means: str
    todo: str
    anchor: str = ""

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> ConfigError:
            return ConfigError(f"diag.catalog.alerts: the entry {self.name!r} has {what}; {fix}")

        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise bad(f"name={self.name!r}", "a kind is lower-case letters, digits and '_', e.g. 'loss_spike'")
        if not self.levels or not set(self.levels) <= set(LEVELS):
            raise bad(f"levels={self.levels!r}", f"give the levels its firing records take, of {LEVELS}")
        for field, text in (("means", self.means), ("todo", self.todo)):
            if not text.strip() or "\n" in text or "What to do" in text:
                raise bad(f"{field}={text!r}", "one line, without the 'What to do:' the messages put before it")
        if set(re.findall(r"\{(\w*)\}", self.todo)) - {"since"}:
            raise bad(f"todo={self.todo!r}", "the only field a todo may name is {since}")

    @property
    def docs(self) -> str:
        """``docs/alerts.md#<anchor>``: where the kind is explained at length."""
        return f"{DOCS}#{self.anchor or self.name}"

    def what_to_do(self, since: int | None = None) -> str:
        """The advice, ``{since}`` filled in with the step the episode began (unknown: "the episode's start")."""
        if since is None:
            return _SINCE.sub("the episode's start", self.todo)
        return self.todo.format(since=since)


_NONFINITE = "check the data of that step, lower the learning rate, clip gradients, check mixed-precision loss scaling"
_RESTART = ("restart from a checkpoint before step {since} with warmup, a lower learning rate, QK-norm or a spectral "
            "step limit")

ALERTS: dict[str, AlertKind] = {k.name: k for k in (
    AlertKind("malignant_collapse", ("warning", "info"),
              "malignant entropy collapse: most queries put their mass on the same few keys (sparse and low-rank "
              "attention, which precedes the crash in Qi et al.)",
              f"watch the loss; if it rises or stops well above its trend (a collapse_damage record), {_RESTART}"),
    AlertKind("benign_collapse", ("info",),
              "benign entropy collapse: sparse attention, each query on a different key (full rank)",
              "usually nothing; watch whether it turns malignant"),
    AlertKind("uniform_attention", ("info",), "uniform attention: near-uniform weights over the keys, low rank",
              "look at the head; low rank across layers is the rank collapse of Dong et al."),
    AlertKind("attention_sink", ("info",),
              "attention sink: most of every query's mass on one key position shared by every sequence (what "
              "pretrained language models' heads do with their first token; it does not hurt the loss by itself)",
              "nothing; a head that leaves its sink for a few keys of its own is a malignant_collapse record"),
    AlertKind("collapse_damage", ("critical",),
              "a layer's malignant collapse is hurting the run: after it the loss rose and stays up, or stopped well "
              "above the trend it had",
              f"{_RESTART} (docs/steplimit.md)"),
    AlertKind("collapse_stall", ("warning",),
              "the loss stopped falling after a layer's malignant collapse; every loss curve slows down, so this "
              "alone does not show damage",
              "compare the loss over the same steps with a run you trust (an earlier run, a run with QK-norm), and "
              "look at the learning-rate schedule (a decay, or its end, stalls the loss by itself); if this run sits "
              f"above the other, {_RESTART} (docs/steplimit.md)"),
    AlertKind("large_early_updates", ("info",),
              "the first updates are large next to the weights: no (or a short) warmup at this learning rate",
              "nothing if the run is meant to have no warmup; collapse_risk shows which layers are heading for "
              "collapse"),
    AlertKind("eureka_plateau", ("warning",),
              "the loss is on a plateau while attention has not learned where to look: the model may be stuck "
              "before a Eureka-moment",
              "rule out a data or label bug first; then NormSoftmax (divide the logits by their standard deviation "
              "before the softmax), more seeds, or a longer budget. More learning rate or warmup does not address "
              "it"),
    AlertKind("eureka_moment", ("info",),
              "the loss left its plateau while the Q/K gradient share rose or attention entropy fell",
              "nothing; validation accuracy should follow"),
    AlertKind("nonfinite_loss", ("critical",), "the loss is NaN or inf", _NONFINITE),
    AlertKind("nonfinite_weights", ("critical",), "a head's Q or K weights are not finite (its qk_sigma1 is NaN)",
              f"go back to a checkpoint before it; {_NONFINITE}"),
    AlertKind("nonfinite_gradients", ("critical",), "a Q, K or V gradient norm is not finite", _NONFINITE),
    AlertKind("gradient_overflow", ("info",),
              "fp16 gradients overflowed: the GradScaler skips the update and lowers its scale",
              "nothing if rare; if it repeats at every sample, look for a layer whose gradients are non-finite in "
              "float32, or use bf16"),
    AlertKind("qk_clip", ("info",),
              "QK-clip scaled W_Q and W_K of the heads whose largest logit exceeded its tau",
              "nothing; the record says where the clip acts. A head clipped at every step for long keeps growing "
              "its logits: a lower learning rate or QK-norm treats the cause"),
    AlertKind("loss_spike", ("warning",), "the loss jumped above its running mean by spike_sigma standard deviations",
              "inspect the batch; clip gradients; if attn_max_logit climbs too, consider QK-norm or a lower learning "
              "rate"),
)}


def register_alert(kind: AlertKind) -> AlertKind:
    """Add the entry of a kind a detector of your own raises (``Detectors(extra=...)``); returns it. A kind
    that has an entry already is refused."""
    if not isinstance(kind, AlertKind):
        raise ConfigError(f"register_alert: got {type(kind).__name__}; pass an AlertKind(name, levels, means, todo)")
    if kind.name in ALERTS:
        raise ConfigError(f"register_alert: the kind {kind.name!r} has an entry already ({ALERTS[kind.name]}); "
                          "choose another name for your detector's kind")
    ALERTS[kind.name] = kind
    return kind


def advice(kind: str, since: int | None = None) -> str | None:
    """What to do about a record of ``kind`` (``{since}`` filled in), or None for a kind with no entry."""
    entry = ALERTS.get(kind)
    return None if entry is None else entry.what_to_do(since)
