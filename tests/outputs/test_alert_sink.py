"""The alert channels: one console line per alert with its docs anchor, the location once, resolved records."""

from __future__ import annotations

import json
import logging
import warnings

from diag.detectors import Alert
from diag.outputs.alert_sink import AlertSink, console_line
from diag.outputs.sinks import FanOut, MemorySink


def test_one_console_line_per_alert_with_where_once_and_the_anchor(tmp_path, caplog):
    mem = MemorySink()
    sink = AlertSink(FanOut([mem]), tmp_path / "alerts.jsonl")
    firing = Alert(40, "malignant_collapse", "critical", "L00/H01", "malignant entropy collapse ... since step 30. "
                   "What to do: restart", {"attn_entropy": 0.1}, "firing", 30)
    layer = Alert(40, "benign_collapse", "info", "L01", "benign ...", {}, "firing", 40, ("L01/H00", "L01/H02"))
    heads = Alert(40, "benign_collapse", "info", "L02/H00+H01", "benign ...", {}, "firing", 40,
                  ("L02/H00", "L02/H01"))
    with caplog.at_level(logging.INFO, logger="diag"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no second print through warnings
        sink.emit([firing, layer, heads])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [console_line(firing), console_line(layer), console_line(heads)]
    assert lines[0] == ("diag alert malignant_collapse at L00/H01, step 40: malignant entropy collapse ... since "
                        "step 30. What to do: restart (docs/alerts.md#malignant_collapse)")
    assert "at L01 (H00, H02), step 40" in lines[1]  # a layer's record, with the heads it counts
    assert "at L02/H00, L02/H01, step 40" in lines[2]  # a record of several heads
    text = mem.records[0].texts["alerts/malignant_collapse"]
    assert text.count("L00/H01") == 1 and "docs/alerts.md#malignant_collapse" in text
    saved = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert saved[0]["since"] == 30 and saved[0]["status"] == "firing"
    assert saved[0]["docs"] == "docs/alerts.md#malignant_collapse"
    assert saved[1]["heads"] == ["L01/H00", "L01/H02"]


def test_resolved_records_are_text_not_counts_and_never_stop_training(tmp_path):
    mem = MemorySink()
    sink = AlertSink(FanOut([mem]), None, stop_on_critical=True)
    sink.emit([Alert(90, "malignant_collapse", "info", "L00/H01", "resolved: ... after 60 steps",
                     {"duration_steps": 60.0}, "resolved", 30)])
    assert mem.records[0].scalars == {}
    assert "(resolved)" in mem.records[0].texts["alerts/malignant_collapse"]


def test_sinks_with_write_alerts_receive_the_alert_objects_and_a_failing_one_stops_nothing(tmp_path):
    class Broken(MemorySink):
        def write_alerts(self, alerts):
            raise RuntimeError("backend down")

    class Plain:  # write/flush/close only: never asked for alerts
        def __init__(self):
            self.records = []

        def write(self, record):
            self.records.append(record)

        def flush(self):
            pass

        def close(self):
            pass

    mem, broken, plain = MemorySink(), Broken(), Plain()
    sink = AlertSink(FanOut([broken, mem, plain]), tmp_path / "alerts.jsonl")
    firing = Alert(40, "malignant_collapse", "critical", "L00/H01", "collapse", {"attn_entropy": 0.1}, "firing", 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sink.emit([firing])
    assert mem.alerts == [firing]  # the object itself: level, where, message, anchor
    assert len(plain.records) == 1 and len((tmp_path / "alerts.jsonl").read_text().splitlines()) == 1
