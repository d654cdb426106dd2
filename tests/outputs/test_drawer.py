"""The drawer: drawings run on one worker thread, in order; close() waits for all of them."""

from __future__ import annotations

import threading
import time

import numpy as np

from diag.outputs.drawer import Drawer


def _image(value: int) -> dict[str, np.ndarray]:
    return {"img": np.full((2, 2, 3), value, dtype=np.uint8)}


def test_close_waits_for_every_drawing_and_gives_them_in_order():
    drawer = Drawer(most=2)

    def slow(value):
        def draw():
            time.sleep(0.02)
            return _image(value)
        return draw

    for step in range(5):
        drawer.submit(step, slow(step))
    drawn = drawer.ready() + drawer.close()
    assert [d.step for d in drawn] == [0, 1, 2, 3, 4]
    assert [int(d.images["img"][0, 0, 0]) for d in drawn] == [0, 1, 2, 3, 4]
    assert all(d.error is None for d in drawn)


def test_a_drawing_that_raises_costs_its_own_images_only():
    drawer = Drawer()

    def broken():
        raise RuntimeError("no font")

    drawer.submit(0, lambda: _image(1))
    drawer.submit(1, broken)
    drawer.submit(2, lambda: _image(3))
    drawn = drawer.close()
    assert [(d.step, bool(d.images), repr(d.error)) for d in drawn] == [
        (0, True, "None"), (1, False, "RuntimeError('no font')"), (2, True, "None")]


def test_submit_waits_while_the_queue_is_full():
    drawer, go = Drawer(most=1), threading.Event()
    drawer.submit(0, lambda: (go.wait(5), _image(0))[1])  # the worker holds this one until go is set
    drawer.submit(1, lambda: _image(1))  # waits in the queue
    third = threading.Thread(target=drawer.submit, args=(2, lambda: _image(2)))
    third.start()
    time.sleep(0.1)
    assert third.is_alive()  # blocked: one waiting is the most
    go.set()
    third.join(5)
    assert not third.is_alive()
    assert [d.step for d in drawer.close()] == [0, 1, 2]


def test_after_close_a_drawing_runs_at_once():
    drawer = Drawer()
    drawer.close()
    drawer.submit(3, lambda: _image(3))
    assert [d.step for d in drawer.ready()] == [3]
