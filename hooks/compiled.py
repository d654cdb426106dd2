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
"""

from __future__ import annotations

import contextlib

import torch

from hooks.capture import AttentionCapture

__all__ = ["EagerCapture"]


class EagerCapture(AttentionCapture):
    """:class:`~hooks.capture.AttentionCapture` that keeps ``torch.compile`` out of the armed window."""

    _stance = None  # the set_stance object whose exit restores the stance before arming

    def arm(self) -> None:
        if not self.armed and self._stance is None:
            self._stance = _force_eager()
        super().arm()

    def disarm(self) -> None:
        super().disarm()
        stance, self._stance = self._stance, None
        if stance is not None:
            with contextlib.suppress(RuntimeError):  # inside a compiled region dynamo refuses: it stays
                stance.__exit__(None, None, None)


def _force_eager():
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("force_eager")  # sets it now; its __exit__ restores the prior stance
    except RuntimeError:  # armed inside a compiled region: leave the compiler alone
        return None
