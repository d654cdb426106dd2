"""The Monitor inside the trainers users already have.

    from hooks.integrations.hf import MonitorCallback          # transformers.Trainer
    from hooks.integrations.lightning import MonitorCallback   # lightning.pytorch.Trainer

Each submodule imports its own framework; this package (and ``hooks``) imports neither.
What both callbacks share lives here: the check of the Monitor arguments they pass on. With
``stop_on_critical`` on several ranks, the Monitor's detectors stop every rank together
(:class:`hooks.parallel.detectors.SharedDetectors`). Both add an
:class:`~diag.outputs.mlflow_sink.MLflowSink` on the main process when the trainer logs to MLflow
(:func:`with_mlflow_sink`), writing into the trainer's own run.
"""

from __future__ import annotations

import inspect
from typing import Any

from diag.errors import ConfigError
from hooks.monitor.monitor import Monitor

__all__ = ["check_monitor_kwargs", "callback_options", "with_mlflow_sink"]

# Arguments of Monitor that a callback sets itself (logdir and every are the callbacks' own arguments).
_SET_BY_CALLBACK = {"model": "the trainer's model", "purge_step": "the trainer's step on resume"}


def check_monitor_kwargs(owner: str, every: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse, at construction, what ``Monitor`` would refuse only when training starts."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"{owner}(every={every!r}): expected an integer >= 1 or None (the Monitor's "
                          "per-family default cadence), e.g. every=10")
    accepted = [p for p in inspect.signature(Monitor).parameters if p not in ("model", "logdir", "every")]
    for name in kwargs:
        if name in _SET_BY_CALLBACK:
            raise ConfigError(f"{owner}({name}=...): the callback sets it ({_SET_BY_CALLBACK[name]}); leave it out")
        if name not in accepted:
            raise ConfigError(f"{owner}({name}=...): not an argument of hooks.Monitor; choose from {accepted}")
    return dict(kwargs)


def callback_options(every: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What both ``MonitorCallback``s do with their arguments: the Monitor keyword arguments, checked."""
    checked = check_monitor_kwargs("MonitorCallback", every, kwargs)
    # The trainer owns its output folder: a fresh train()/fit() replaces the Monitor's earlier run there
    # (a resume continues it through purge_step); overwrite=False asks for the Monitor's refusal instead.
    checked.setdefault("overwrite", True)
    return checked


def with_mlflow_sink(kwargs: dict[str, Any], make_sink) -> dict[str, Any]:
    """``kwargs`` with ``make_sink()`` added to its ``sinks``, unless they already hold an MLflowSink (the user's
    own, which decides where the values go)."""
    sinks = list(kwargs.get("sinks", ()))
    if any(type(s).__name__ == "MLflowSink" for s in sinks):
        return kwargs
    return {**kwargs, "sinks": [*sinks, make_sink()]}
