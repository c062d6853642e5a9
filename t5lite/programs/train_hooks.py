"""The hooks of the `train` program's loop (`train_loop.TrainLoop`), in the order it adds them.

Metrics hooks, every step: `Watchdog` (the run stops when no step completes for too long),
`FiniteCheck` (a non-finite step ends the run), `StallDetector` (a run that stopped learning
ends), `LogStep` (metrics.jsonl, TensorBoard and the printed line, with throughput).
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


class FiniteCheck:
    """Ends the run at a step whose loss, gradient norm or parameters are not finite.

    That step's state is never saved; the checkpoints already committed are all finite (each
    was saved only after its own step passed this check), so the newest one is the last good.
    """

    def __init__(self, ckpt: CheckpointManager, param_paths: list[str]):
        self.ckpt, self.param_paths = ckpt, param_paths

    def __call__(self, m: StepMetrics) -> None:
        if m.params_finite.all() and all(math.isfinite(v) for v in m.values.values()):
            return
        bad = [p for p, ok in zip(self.param_paths, m.params_finite) if not ok]
        self.ckpt.wait()  # an earlier, finite step may still be committing: it is the last good
        latest = self.ckpt.latest_step()
        what = [f"loss {m.values['loss']:.4g}"]
        if "grad_norm" in m.values:
            what.append(f"gradient norm {m.values['grad_norm']:.4g}")
        if bad:
            what.append(f"{len(bad)} non-finite parameter arrays, first 'params/{bad[0]}'")
        raise TrainingError(
            f"step {m.step} is not finite ({', '.join(what)}); it was not saved. The last good "
            "checkpoint is "
            + (str(self.ckpt.step_dir(latest)) if latest is not None else "none (no save yet)")
            + ": resume from it with a lower learning rate or stronger clipping"
        )


class StallDetector:
    """Notices a run that predicts the uniform distribution step after step (dead, diverged).

    Its cross-entropy is then ln(V) on every batch and its gradients are zero, so nothing will
    change however long it runs; finite-value checks cannot see it.
    """

    def __init__(self, vocab_size: int, patience: int, ckpt: CheckpointManager):
        self.uniform = math.log(vocab_size)
        self.patience = patience
        self.ckpt = ckpt
        self.since: int | None = None

    def __call__(self, m: StepMetrics) -> None:
        self.check(m.step, m.values)

    def check(self, step: int, m: dict[str, float]) -> None:
        ce = m["loss"] - m.get("z_loss", 0.0)
        stalled = abs(ce - self.uniform) <= 1e-4 * self.uniform and m.get("grad_norm", 0.0) == 0
        if not stalled or self.patience <= 0:
            self.since = None
            return
        self.since = step if self.since is None else self.since
        if step - self.since + 1 >= self.patience:
            latest = self.ckpt.latest_step()
            raise TrainingError(
                f"the model has stopped learning: cross-entropy {ce:.4f} = ln(vocab_size) "
                f"(uniform predictions) with zero gradients since step {self.since}; checkpoints "
                f"are kept (latest: {latest}). Lower the learning rate, or set "
                "train.max_stalled_steps=0 to train on anyway"
            )


class LogStep:
    """Writes each step's metrics and throughput (`metrics.jsonl`, TensorBoard, the printed
    line every `LogConfig.period` steps); `last` is the newest record."""

    def __init__(self, writer: mw.MetricsWriter, throughput: mw.Throughput):
        self.writer, self.throughput = writer, throughput
        self.last: dict[str, Any] = {}

    def __call__(self, m: StepMetrics) -> None:
        self.last = {**m.values, **self.throughput.measure(m.local_batch)}
        self.writer.write(m.step, self.last)


def preemption(ckpt: CheckpointManager) -> Callable[[int], bool]:
    """The stop hook: whether a preemption signal arrived (see `install_preemption_handler`)."""
    return ckpt.reached_preemption


class SaveCheckpoint:
    """Saves the state with the data iterator's position and `run_info` where the checkpoint
    policy says (period, the last step, preemption); the save of the last step is committed
    before the hook returns."""

    def __init__(self, ckpt: CheckpointManager, logical_axes: Any, run_info: dict[str, Any]):
        self.ckpt, self.logical_axes, self.run_info = ckpt, logical_axes, run_info

    def due(self, info: StepInfo) -> bool:
        return self.ckpt.should_save(info.step, info.final or info.stopping, info.preempted)

    def __call__(self, info: StepInfo) -> None:
        extra = {"data": info.data_state, "step": info.step, **self.run_info}
        self.ckpt.save(info.step, info.state, extra, self.logical_axes)
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
