"""AlertWebhook against a real HTTP server on 127.0.0.1 that records what is posted (http.server in a thread)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from diag.detectors.base import Alert
from diag.outputs.webhook import AlertWebhook
from tests.support.mlflow_server import free_port


class Recorder(BaseHTTPRequestHandler):
    posts: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.posts.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def chat():
    Recorder.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", Recorder.posts
    server.shutdown()
    server.server_close()


def alert(step, status="firing", level="critical", kind="malignant_collapse", where="L01/H00", since=10):
    return Alert(step, kind, level, where, "the head collapsed", status=status, since=since)


def test_one_message_per_episode_start_and_end(chat):
    url, posts = chat
    hook = AlertWebhook(url, run="exp1")
    for a in [alert(10), alert(20), alert(10),  # the same episode again: no second message
              alert(30, where="L02/H01", since=30),  # another place: an episode of its own
              alert(40, status="resolved"), alert(50, status="resolved"),
              alert(60, since=60),  # the same kind and place again later: a new episode
              alert(70, level="info", kind="large_early_updates", where="", since=None)]:  # below min_level
        hook(a)
    hook.close()
    texts = [p[2]["text"] for p in posts]
    assert [p[:2] for p in posts] == [("/hook", "application/json")] * 4 and hook.posted == 4
    assert [("resolved" in t, "L02/H01" in t, "step 60" in t) for t in texts] == [
        (False, False, False), (False, True, False), (True, False, False), (False, False, True)]
    assert texts[0].startswith(":rotating_light: [exp1] diag alert malignant_collapse at L01/H00, step 10:")
    assert texts[0].endswith("(docs/alerts.md#malignant_collapse)") and set(posts[0][2]) == {"text"}


def test_a_server_that_is_down_never_reaches_training(caplog):
    hook = AlertWebhook(f"http://127.0.0.1:{free_port()}/hook", timeout=2)
    with caplog.at_level(logging.ERROR, logger="diag"):
        for step in range(3):
            hook(alert(step, since=step))  # three episodes, three failed posts
        hook.close()
    assert hook.posted == 0
    assert [r.getMessage().startswith("diag: the alert webhook failed") for r in caplog.records] == [True]


def test_as_the_monitors_on_alert(chat, tmp_path):
    """Through the Monitor's AlertSink: a non-finite loss at every step is one critical episode, one post."""
    from hooks.demo import GPT, GPTConfig
    from hooks.monitor.monitor import Monitor

    url, posts = chat
    hook = AlertWebhook(url)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, batch_size=2))
    idx = torch.randint(0, 16, (2, 8))
    with Monitor(model, every=1, on_alert=hook) as monitor:
        for step in range(4):
            loss = model(idx, idx)
            loss.backward()
            monitor.step(step, loss=torch.tensor(float("nan")))
    hook.close()
    assert [a.kind for a in monitor.alert_sink.history if a.level != "info"] == ["nonfinite_loss"]
    assert len(posts) == 1 and "diag alert nonfinite_loss, step 0" in posts[0][2]["text"]
