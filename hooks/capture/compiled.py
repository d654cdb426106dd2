"""Compiled models: the sampled forward runs eagerly, every other forward stays compiled.

The attention capture adds module hooks and a ``TorchFunctionMode`` around one
forward per sampled step. Traced by ``torch.compile``, they would change the
guards (a recompile) and break the graph (the statistics are Python-side work).
:class:`EagerCapture` instead sets the compiler stance ``"force_eager"`` while it
is armed (from the ``monitor.step`` before a sampled step until the sampled
step's ``monitor.step``) and restores the previous stance when disarmed. Compiled
code is not touched: no recompile, no graph break, and the cached graphs run
again from the next step on. Without ``torch.compiler.set_stance`` (torch < 2.6)
nothing changes.

The stance is global, so it is reference-counted across captures (several
Monitors, armed and disarmed in any order): ``force_eager`` is set when the
first capture arms and the prior stance comes back when the last one disarms.
A restore that dynamo refuses (inside a compiled region) is retried at the next
disarm.
"""

from __future__ import annotations

import torch

from hooks.capture.capture import AttentionCapture

__all__ = ["EagerCapture"]

_armed: set[int] = set()  # ids of the captures that hold force_eager now
_restore: list = []  # the set_stance object whose __exit__ restores the stance before the first arm


class EagerCapture(AttentionCapture):
    """:class:`~hooks.capture.capture.AttentionCapture` that keeps ``torch.compile`` out of the armed window."""

    def arm(self) -> None:
        if not self.armed and id(self) not in _armed:
            if not _armed and not _restore:
                stance = _force_eager()
                if stance is not None:
                    _restore.append(stance)
            _armed.add(id(self))
        super().arm()

    def disarm(self) -> None:
        super().disarm()
        _armed.discard(id(self))
        if not _armed and _restore:
            try:
                _restore[0].__exit__(None, None, None)
            except RuntimeError:  # inside a compiled region dynamo refuses: retried at the next disarm
                return
            _restore.clear()


def _force_eager():
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("force_eager")  # sets it now; its __exit__ restores the prior stance
    except RuntimeError:  # armed inside a compiled region: leave the compiler alone
        return None
