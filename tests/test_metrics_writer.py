"""The train log: an ETA from this process's own steps, one terminal line of the right width."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from t5lite.programs import metrics_writer as mw


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(mw.time, "time", c)
    return c


def test_eta_ignores_compilation_and_resumed_steps(tmp_path, clock):
    w = mw.MetricsWriter(str(tmp_path), total_steps=100, stream=io.StringIO(), log_period=1)
    clock.now += 300  # a long compilation before the first step of this run
    w.write(51, {"loss": 1.0})  # resumed at step 50: the first step of this process
    assert w.eta_seconds(51) is None
    clock.now += 20  # then 2 s per step
    w.write(61, {"loss": 1.0})
    assert w.eta_seconds(61) == pytest.approx(2.0 * 39)
    assert "train step 61/100: ETA 1m18s loss=1" in w.stream.getvalue()
    w.close()


@pytest.mark.parametrize("columns", [40, 120])
def test_progress_line_fits_the_terminal(tmp_path, clock, monkeypatch, columns):
    size = os.terminal_size((columns, 24))
    monkeypatch.setattr(mw.shutil, "get_terminal_size", lambda fallback: size)
    term = _Terminal()
    w = mw.MetricsWriter(str(tmp_path), total_steps=10, stream=term, log_period=1)
    metrics = {"loss": 1.234, "accuracy": 0.5, "learning_rate": 1e-3, "tokens_per_s": 12345.0,
               "seqs_per_s": 99.0, "step_time_s": 0.25, "mfu": "n/a (CPU)"}  # fmt: skip
    for step in range(1, 5):
        clock.now += 1
        w.write(step, metrics)
    lines = [x for x in term.getvalue().split("\r") if x]
    assert len(lines) == 4 and all(len(x) == columns - 1 for x in lines)
    assert lines[-1].startswith("[########............] 4/10 ETA 6s loss")  # 3 steps, 1 s each
    w.close()


def test_records_are_written_in_batches_never_behind_the_log(tmp_path, clock):
    """Every step's record reaches metrics.jsonl, at the latest FLUSH_S after its step or with
    the next printed line, and all of them on close (the order and content unchanged)."""
    path = tmp_path / "metrics.jsonl"
    w = mw.MetricsWriter(str(tmp_path), total_steps=100, stream=io.StringIO(), log_period=10)

    def logged():
        return [json.loads(x)["step"] for x in path.read_text().splitlines()]

    for step in range(1, 4):
        w.write(step, {"loss": float(step)})
    assert logged() == []  # held back: less than FLUSH_S since the writer started
    clock.now += w.FLUSH_S
    w.write(4, {"loss": 4.0})
    assert logged() == [1, 2, 3, 4]
    for step in range(5, 11):
        w.write(step, {"loss": float(step)})
    assert logged() == list(range(1, 11))  # step 10 is printed: the file has caught up
    w.write(11, {"loss": 11.0})
    w.write(11, {"accuracy": 0.5}, prefix="eval")  # eval records are written at once
    assert logged() == [*range(1, 12), 11]
    w.write(12, {"loss": float("nan")})
    w.close()
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [*range(1, 12), 11, 12]
    assert records[-1]["split"] == "train" and math.isnan(records[-1]["loss"])
    assert records[-2] == {"step": 11, "split": "eval", "accuracy": 0.5}


def _tb_events(log_dir) -> list:
    """The events of every TensorBoard file under `log_dir` (TFRecord framing: length, its CRC,
    the serialised `Event`, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(log_dir.glob("events.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            events.append(Event.FromString(data[at + 12 : at + 12 + n]))
            at += 12 + n + 4
    return [e for e in events if e.HasField("summary")]


def test_tensorboard_gets_one_event_per_step_with_all_its_scalars(tmp_path, clock):
    """Each record's finite numbers reach TensorBoard under `split/name` at its step and time,
    one event per step (tensorboardX's `add_scalar` made one per number)."""
    pytest.importorskip("tensorboardX")
    w = mw.MetricsWriter(str(tmp_path), total_steps=100, stream=io.StringIO(), log_period=10)
    for step in range(1, 4):
        clock.now += 0.25
        w.write(step, {"loss": 1.0 / step, "accuracy": 0.1 * step, "mfu": "n/a", "x": math.inf})
    w.write(3, {"accuracy": 0.75}, prefix="eval")
    w.close()
    events = _tb_events(tmp_path / "tensorboard")
    got = {(e.step, e.wall_time, v.tag): v.simple_value for e in events for v in e.summary.value}
    want = {
        **{(s, 1000.0 + 0.25 * s, "train/loss"): 1.0 / s for s in (1, 2, 3)},
        **{(s, 1000.0 + 0.25 * s, "train/accuracy"): 0.1 * s for s in (1, 2, 3)},
        (3, 1000.75, "eval/accuracy"): 0.75,
    }
    assert got == pytest.approx(want)
    assert [e.step for e in events] == [1, 2, 3]  # step 3's eval shares its step and time
