"""Training logs: progress bar or plain lines, metrics.jsonl, TensorBoard events, and MFU.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from t5lite.insight.flops import batch_train_flops, real_tokens


def _duration(secs: float) -> str:
    seconds = round(secs)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class MetricsWriter:
    """Writes step metrics to the terminal, `metrics.jsonl` and TensorBoard (process 0 only)."""

    FLUSH_S = 1.0  # longest a step's record waits before it is written to the files

    def __init__(
        self,
        model_dir: str,
        *,
        total_steps: int,
        enabled: bool = True,
        log_period: int = 10,
        stream: Any = None,
    ):
        self.enabled = enabled
        self.model_dir = model_dir
        self.total_steps = total_steps
        self.log_period = max(1, log_period)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._first: tuple[int, float] | None = None  # this process's first step and its time
        self._jsonl = None
        self._tb = None
        self._lines: list[str] = []  # metrics.jsonl lines not written yet
        self._scalars: list[tuple[str, float, int, float]] = []  # (tag, value, step, walltime)
        self._flushed = time.time()
        if not enabled:
            return
        os.makedirs(model_dir, exist_ok=True)
        self._jsonl = open(os.path.join(model_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(model_dir, "tensorboard"))
        except ImportError:  # optional: JSONL is always written
            self._tb = None

    def write(self, step: int, metrics: Mapping[str, float], prefix: str = "train") -> None:
        """Records one step's (or one eval's) metrics."""
        if not self.enabled:
            return
        now = time.time()
        if prefix == "train" and self._first is None:
            self._first = (step, now)  # after compilation, after any resumed steps
        record = {"step": step, "split": prefix, **{k: _num(v) for k, v in metrics.items()}}
        self._lines.append(json.dumps(record) + "\n")
        if self._tb is not None:
            self._scalars.extend(
                (f"{prefix}/{k}", v, step, now)
                for k, v in metrics.items()
                if isinstance(v, int | float) and math.isfinite(v)
            )
        printed = prefix != "train" or step % self.log_period == 0 or step == self.total_steps
        # Every step's record, written in batches: a file flush and a dozen TensorBoard events
        # (each a queue put that wakes tensorboardX's writer thread) per step took host time
        # from the devices on a busy host. The files are at most FLUSH_S behind, and never
        # behind the printed log; `close` (also on errors) writes the rest.
        if printed or now - self._flushed >= self.FLUSH_S:
            self.flush()
        if printed:
            self._print(step, metrics, prefix)

    def flush(self) -> None:
        """Writes the records held back since the last flush to metrics.jsonl and TensorBoard."""
        self._flushed = time.time()
        if self._jsonl is not None and self._lines:
            self._jsonl.write("".join(self._lines))
            self._jsonl.flush()
        self._lines.clear()
        if self._tb is not None and self._scalars:
            _write_tb_events(self._tb, self._scalars)
        self._scalars.clear()

    def append_jsonl(self, relative_path: str, record: Mapping[str, Any]) -> str | None:
        """Appends `record` as one JSON line to a file under the model directory (created with
        its folders); what the file held is kept. Returns the path."""
        if not self.enabled:
            return None
        path = os.path.join(self.model_dir, relative_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        line = json.dumps(record, sort_keys=True, default=_num) + "\n"
        with open(path, "a") as f:  # one write of the whole line
            f.write(line)
        return path

    def _print(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        shown = " ".join(
            f"{k}={_fmt(v)}"
            for k, v in metrics.items()
            if k
            in (
                "loss",
                "accuracy",
                "learning_rate",
                "tokens_per_s",
                "padded_tokens_per_s",
                "seqs_per_s",
                "step_time_s",
                "mfu",
            )
            or prefix != "train"
        )
        eta = self.eta_seconds(step) if prefix == "train" else None
        eta_text = f" ETA {_duration(eta)}" if eta is not None else ""
        if prefix == "train" and self.tty:
            done = step / max(self.total_steps, 1)
            bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
            line = f"[{bar}] {step}/{self.total_steps}{eta_text} {shown}"
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self.stream.write("\r" + line[:width].ljust(width))  # one line, whatever the width
            if step == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(f"{prefix} step {step}/{self.total_steps}:{eta_text} {shown}\n")
        self.stream.flush()

    def eta_seconds(self, step: int) -> float | None:
        """Time to `total_steps` at this process's own pace: measured from its first step, so
        neither compilation nor the steps of an earlier run (resumed) distort it."""
        if self._first is None or step <= self._first[0]:
            return None
        first_step, first_time = self._first
        per_step = (time.time() - first_time) / (step - first_step)
        return per_step * max(self.total_steps - step, 0)

    def info(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                self.stream.write("\n")
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _write_tb_events(tb: Any, scalars: list[tuple[str, float, int, float]]) -> None:
    """One TensorBoard event per (step, time) holding all its scalars, as TensorBoard reads them.

    `add_scalar` makes an event per scalar, each serialised and written by tensorboardX's
    writer thread: a dozen per train step, host time taken from the devices on a CPU host.
    """
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import _clean_tag  # the tag as `add_scalar` writes it

    groups: dict[tuple[int, float], list[Any]] = {}
    for tag, value, step, walltime in scalars:
        value_pb = Summary.Value(tag=_clean_tag(tag), simple_value=float(value))
        groups.setdefault((step, walltime), []).append(value_pb)
    writer = tb._get_file_writer()
    for (step, walltime), values in groups.items():
        writer.add_summary(Summary(value=values), step, walltime)


class Throughput:
    """Step time, sequences and tokens per second and MFU, between consecutive `measure` calls.

    `tokens_per_s` counts real (non-padding) tokens, `padded_tokens_per_s` every position of
    every row; `mfu` is model FLOPs of the real tokens (`t5lite.insight.flops`) per second over
    the peak of all devices. Each process counts the rows it fed, times the process count (the
    processes' batches have the same shape and, with shuffled data, about the same padding).

    Args:
      config: the network config (`T5Config` / `DecoderOnlyConfig`).
      batch_size: global rows per step.
      peak_flops: dense peak FLOP/s of all devices together, or None (unknown: MFU is "n/a").
      process_count: processes feeding the step.
      clock: seconds, monotone (tests pass a fake one).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int,
        peak_flops: float | None,
        *,
        process_count: int = 1,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.batch_size = batch_size
        self.peak = peak_flops
        self.process_count = process_count
        self.clock = clock
        self.t_prev = clock()

    def measure(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Rates for the step that fed `local_batch` (this process's numpy rows)."""
        now = self.clock()
        dt, self.t_prev = max(now - self.t_prev, 1e-9), now
        n = self.process_count
        real = n * sum(real_tokens(local_batch).values())
        padded = n * sum(
            int(np.size(local_batch[k]))
            for k in ("decoder_target_tokens", "encoder_input_tokens")
            if k in local_batch
        )
        flops = n * batch_train_flops(self.config, local_batch)
        return {
            "step_time_s": dt,
            "seqs_per_s": self.batch_size / dt,
            "tokens_per_s": real / dt,
            "padded_tokens_per_s": padded / dt,
            "model_flops_per_s": flops / dt,
            "mfu": flops / dt / self.peak if self.peak else "n/a (peak unknown)",
        }


def _num(v: Any) -> Any:
    if isinstance(v, int | float | str) or v is None:
        return v
    return float(v)


def _fmt(v: Any) -> str:
    if isinstance(v, str) or v is None:
        return str(v)
    v = float(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"
