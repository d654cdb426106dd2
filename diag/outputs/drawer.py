"""Images drawn on one background thread, so that matplotlib's time is not spent in the training step.

The caller (the Monitor's :class:`diag.outputs.tb_views.TensorBoardViews`) submits, per step, a function that
draws that step's images from data it already copied; a worker thread runs them in order. What is drawn comes
back to the caller's thread (:meth:`Drawer.ready`, at the next sampled step), which writes it: the sinks are
only ever called from the training thread. :meth:`Drawer.close` waits for everything submitted, so nothing
drawn is lost. The queue is bounded: a caller that submits faster than the worker draws waits for it.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

__all__ = ["Drawer", "Drawn"]

Draw = Callable[[], dict[str, np.ndarray]]  # a step's images: {tag: (H, W, 3) uint8 RGB}


class Drawn:
    """What one submitted drawing gave: its step, its images, and the exception it raised (or None)."""

    __slots__ = ("step", "images", "error")

    def __init__(self, step: int, images: dict[str, np.ndarray], error: Exception | None) -> None:
        self.step, self.images, self.error = step, images, error


class Drawer:
    """Runs drawings on one worker thread, started at the first :meth:`submit`.

    most: drawings waiting at once; :meth:`submit` blocks while that many wait (memory stays bounded).
    """

    def __init__(self, most: int = 4) -> None:
        self._todo: queue.Queue[tuple[int, Draw] | None] = queue.Queue(most)
        self._done: deque[Drawn] = deque()  # appended by the worker, taken by the caller's thread
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, step: int, draw: Draw) -> None:
        """Queue ``draw`` (step ``step``'s images); after :meth:`close`, draws it at once in this thread."""
        if self._closed:
            self._done.append(_run(step, draw))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="diag-drawer", daemon=True)
            self._thread.start()
        self._todo.put((step, draw))

    def ready(self) -> list[Drawn]:
        """The drawings finished since the last call, in the order they were submitted."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> list[Drawn]:
        """Wait for every drawing submitted, stop the worker, and return what :meth:`ready` has not given yet."""
        self._closed = True
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None
        return self.ready()

    def _work(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            self._done.append(_run(*job))


def _run(step: int, draw: Draw) -> Drawn:
    try:
        return Drawn(step, draw(), None)
    except Exception as err:  # noqa: BLE001 - a drawing that fails costs its images only; the caller reports it
        return Drawn(step, {}, err)
