"""Training logs: progress bar or plain lines, metrics.jsonl, TensorBoard events, and MFU.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any


class MetricsWriter:
    """Writes step metrics to the terminal, `metrics.jsonl` and TensorBoard (process 0 only)."""

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
        self.total_steps = total_steps
        self.log_period = max(1, log_period)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._start = time.time()
        self._jsonl = None
        self._tb = None
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
        record = {"step": step, "split": prefix, **{k: _num(v) for k, v in metrics.items()}}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if prefix != "train" or step % self.log_period == 0 or step == self.total_steps:
            self._print(step, metrics, prefix)

    def _print(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        shown = " ".join(
            f"{k}={_fmt(v)}"
            for k, v in metrics.items()
            if k in ("loss", "accuracy", "learning_rate", "tokens_per_s", "seqs_per_s",
                     "step_time_s", "mfu") or prefix != "train"
        )  # fmt: skip
        if prefix == "train" and self.tty:
            done = step / max(self.total_steps, 1)
            elapsed = time.time() - self._start
            eta = elapsed / max(done, 1e-9) * (1 - done)
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            self.stream.write(f"\r[{bar}] {step}/{self.total_steps} ETA {eta:5.0f}s {shown}")
            if step == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(f"{prefix} step {step}/{self.total_steps}: {shown}\n")
        self.stream.flush()

    def info(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                self.stream.write("\n")
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


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
