"""The Monitor inside the trainers users already have.

    from hooks.integrations.hf import MonitorCallback          # transformers.Trainer
    from hooks.integrations.lightning import MonitorCallback   # lightning.pytorch.Trainer

Each submodule imports its own framework; this package (and ``hooks``) imports neither.
What both callbacks share lives here: the check of the Monitor arguments they pass on, and
the stop-on-critical decision that every rank takes together.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from diag.detectors import Alert, TrainingHalted
from diag.errors import ConfigError
from hooks.monitor.monitor import Monitor

__all__ = ["CriticalStop", "any_rank", "check_monitor_kwargs", "callback_options"]

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


def callback_options(every: object, kwargs: dict[str, Any]) -> tuple[dict[str, Any], CriticalStop]:
    """What both ``MonitorCallback``s do with their arguments: the Monitor keyword arguments, checked,
    without ``stop_on_critical`` and ``on_alert``, which go to the ranks' shared :class:`CriticalStop`."""
    checked = check_monitor_kwargs("MonitorCallback", every, kwargs)
    # The trainer owns its output folder: a fresh train()/fit() replaces the Monitor's earlier run there
    # (a resume continues it through purge_step); overwrite=False asks for the Monitor's refusal instead.
    checked.setdefault("overwrite", True)
    stop = CriticalStop(bool(checked.pop("stop_on_critical", False)), checked.pop("on_alert", None))
    return checked, stop


def any_rank(flag: bool, device: torch.device | str | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank of the default process group (or just ``flag``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class CriticalStop:
    """``stop_on_critical`` for several ranks: each rank's Monitor only records its critical alerts
    (it gets ``stop_on_critical=False`` and this object as ``on_alert``); after each sampled step the
    ranks agree, and if any saw one, all raise ``TrainingHalted`` (one rank alone would leave the
    others waiting in the next collective)."""

    def __init__(self, enabled: bool, on_alert: Callable[[Alert], None] | None = None) -> None:
        self.enabled, self.user_callback = enabled, on_alert
        self.critical: Alert | None = None

    def __call__(self, alert: Alert) -> None:
        if alert.level == "critical" and self.critical is None:
            self.critical = alert
        if self.user_callback is not None:
            self.user_callback(alert)  # AlertSink catches what it raises

    def check(self, monitor: Monitor, step: int, agree: Callable[[bool], bool]) -> None:
        """Call on every rank after every ``monitor.step(step)``. Alerts come from a sampled step and
        from the step after it (the update ratios), so only those steps hold the collective ``agree``."""
        if not self.enabled or not (monitor.should_sample(step) or monitor.should_sample(step - 1)):
            return
        if agree(self.critical is not None):
            alert = self.critical or Alert(step, "halted_by_other_rank", "critical", "",
                                           "another rank raised a critical alert; see that rank's log")
            monitor.sinks.flush()
            raise TrainingHalted(alert)
