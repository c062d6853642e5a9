"""The hooks of the `train` program's loop (`train_loop.TrainLoop`), in the order it adds them.

Metrics hooks, every step: `Watchdog` (the run stops when no step completes for too long),
`recovery.HealthCheck` (a non-finite or spiking step rolls back or ends the run),
`StallDetector` (a run that stopped learning ends), `LogStep` (metrics.jsonl, TensorBoard and
the printed line, with throughput).
Stop hook: `preemption(ckpt)`. State hooks: `SaveCheckpoint`, then `Evaluate`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from t5lite.checkpoint import CheckpointManager
from t5lite.distributed import ProgressWatchdog
from t5lite.programs import metrics_writer as mw
from t5lite.programs.configs import EvalConfig
from t5lite.programs.evaluate import run_evaluation
from t5lite.programs.train_loop import StepInfo, StepMetrics, TrainingError
from t5lite.trainer import Trainer


class Watchdog:
    """Armed after the first step (compilation time is unbounded), then pinged every step: with
    several processes, a run whose peer died stops instead of hanging."""

    def __init__(
        self, step_timeout_s: float | None, stack: contextlib.ExitStack, writer: mw.MetricsWriter
    ):
        self.step_timeout_s, self.stack, self.writer = step_timeout_s, stack, writer
        self.watchdog: ProgressWatchdog | None = None
        self.t0 = time.time()

    def __call__(self, m: StepMetrics) -> None:
        if self.watchdog is None:
            self.watchdog = self.stack.enter_context(
                contextlib.closing(ProgressWatchdog(self.step_timeout_s))
            )
            self.writer.info(f"compiled; the first step took {time.time() - self.t0:.1f} s")
        self.watchdog.ping()


class StallDetector:
    """Notices a run that predicts the uniform distribution step after step (dead, diverged).

    Its cross-entropy is then ln(V) on every batch and its gradients are zero, so nothing will
    change however long it runs; finite-value checks cannot see it.
    """

    def __init__(
        self,
        vocab_size: int,
        patience: int,
        ckpt: CheckpointManager,
        stop_text: Callable[[int], str] | None = None,
    ):
        # stop_text(since): where a rerun starts, for the error (`HealthCheck.stop_text`).
        self.stop_text = stop_text
        self.uniform = math.log(vocab_size)
        self.patience = patience
        self.ckpt = ckpt
        self.since: int | None = None  # the stall that counts towards `patience` started here
        self.streak_since: int | None = None  # the current stall, however long
        self.ended_stalled: tuple[int, int, float] | None = None  # (since, last step, ce)

    def __call__(self, m: StepMetrics) -> None:
        self.check(m.step, m.values)
        if not self.is_stalled(m.values):
            self.streak_since = None
        elif self.streak_since is None:
            self.streak_since = m.step
        if m.last and self.streak_since is not None and m.step - self.streak_since >= 1:
            self.ended_stalled = (self.streak_since, m.step, self._ce(m.values))

    def _ce(self, m: dict[str, float]) -> float:
        return m["loss"] - m.get("z_loss", 0.0)

    def is_stalled(self, m: dict[str, float]) -> bool:
        """Cross-entropy ln(V) (uniform predictions) and a zero gradient norm where logged."""
        ce = self._ce(m)
        return abs(ce - self.uniform) <= 1e-4 * self.uniform and m.get("grad_norm", 0.0) == 0

    def check(self, step: int, m: dict[str, float]) -> None:
        if not self.is_stalled(m) or self.patience <= 0:
            self.since = None
            return
        self.since = step if self.since is None else self.since
        if step - self.since + 1 >= self.patience:
            raise TrainingError(
                f"the model has stopped learning: cross-entropy {self._ce(m):.4f} = "
                f"ln(vocab_size) (uniform predictions) with zero gradients since step "
                f"{self.since}; {self._where(self.since)}. Lower the learning rate, or set "
                "train.max_stalled_steps=0 to train on anyway"
            )

    def _where(self, since: int) -> str:
        if self.stop_text is not None:
            return self.stop_text(since)
        return f"checkpoints are kept (latest: {self.ckpt.latest_step()})"

    def annotation(self, m: StepMetrics) -> dict[str, Any]:
        """The metrics flag of the last step of a run that ends stalled."""
        if m.last and self.ended_stalled is not None:
            return {"stalled_since": self.ended_stalled[0]}
        return {}

    def end_of_run(self, final: bool, writer: mw.MetricsWriter) -> None:
        """A run that ends stalled (two steps or more, however few) says so: an error at the
        run's last step (exit 1; its checkpoints are kept), a warning when
        `max_stalled_steps` is 0 or the run only stops (preemption, `stop_after_steps`)."""
        if self.ended_stalled is None:
            return
        since, step, ce = self.ended_stalled
        text = (
            f"the run ended stalled: cross-entropy {ce:.4f} = ln(vocab_size) (uniform "
            f"predictions) with zero gradients from step {since} to its last step {step}"
        )
        if final and self.patience > 0:
            raise TrainingError(
                f"{text}; {self._where(since)}. Lower the learning rate, or set "
                "train.max_stalled_steps=0 to end with a warning"
            )
        writer.info(f"warning: {text}")


class LogStep:
    """Writes each step's metrics and throughput (`metrics.jsonl`, TensorBoard, the printed
    line every `LogConfig.period` steps); `last` is the newest record."""

    def __init__(
        self,
        writer: mw.MetricsWriter,
        throughput: mw.Throughput,
        annotate: Callable[[StepMetrics], dict[str, Any]] | None = None,
    ):
        self.writer, self.throughput, self.annotate = writer, throughput, annotate
        self.last: dict[str, Any] = {}

    def __call__(self, m: StepMetrics) -> None:
        self.last = {**m.values, **self.throughput.measure(m.local_batch)}
        if self.annotate is not None:
            self.last.update(self.annotate(m))
        self.writer.write(m.step, self.last)


def preemption(ckpt: CheckpointManager) -> Callable[[int], bool]:
    """The stop hook: whether a preemption signal arrived (see `install_preemption_handler`)."""
    return ckpt.reached_preemption


class SaveCheckpoint:
    """Saves the state with the data iterator's position and `run_info` where the checkpoint
    policy says (period, the last step, preemption); the save of the last step is committed
    before the hook returns."""

    def __init__(
        self,
        ckpt: CheckpointManager,
        logical_axes: Any,
        run_info: dict[str, Any],
        health: Any = None,
    ):
        self.ckpt, self.logical_axes, self.run_info = ckpt, logical_axes, run_info
        # `recovery.HealthCheck`: its record of good checkpoints is saved; it judges each save.
        self.health = health

    def due(self, info: StepInfo) -> bool:
        return self.ckpt.should_save(info.step, info.final or info.stopping, info.preempted)

    def __call__(self, info: StepInfo) -> None:
        extra = {"data": info.data_state, "step": info.step, **self.run_info}
        if self.health is not None:
            extra.update(self.health.good.record())
        self.ckpt.save(info.step, info.state, extra, self.logical_axes)
        if self.health is not None:
            self.health.saved(info.step)
        if info.last:
            self.ckpt.wait()


class Evaluate:
    """Evaluation every `EvalConfig.period` steps and after the last; `last` holds the newest
    eval metrics."""

    def __init__(
        self,
        config: EvalConfig,
        evaluator: Any,
        trainer: Trainer,
        decode_len: int,
        writer: mw.MetricsWriter,
    ):
        self.config, self.evaluator, self.trainer = config, evaluator, trainer
        self.decode_len, self.writer = decode_len, writer
        self.last: dict[str, Any] = {}

    def due(self, info: StepInfo) -> bool:
        return info.final or bool(self.config.period and info.step % self.config.period == 0)

    def __call__(self, info: StepInfo) -> None:
        metrics = run_evaluation(
            self.evaluator,
            self.trainer,
            info.state.params,
            decode_len=self.decode_len,
            writer=self.writer,
            step=info.step,
            num_to_print=self.config.num_predictions_to_print,
        )
        self.last = metrics or self.last
