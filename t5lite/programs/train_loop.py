"""The train loop: a generator of steps, and the hooks that act on them.

Like Levanter's `Trainer.training_steps` / `add_hook`: the loop dispatches steps and yields each
step's `StepInfo`; everything else a step triggers (the watchdog, the finite and stall checks,
the log, saving, evaluation, preemption) is a hook added to the loop. The hooks themselves live in
`train_hooks.py`.

Three kinds of hooks, and the order in which they run for step N:

1. step N is dispatched (the call returns before the step has run);
2. **metrics hooks** (`add_hook(fn, every=k)`, called with a `StepMetrics`: the step's metrics
   read on the host) for step N-1 when its read was deferred, in the order they were added;
3. **stop hooks** (`add_stop_hook(fn)`: preemption), asked once for step N; one that answers
   True makes N the last step of this invocation;
4. **state hooks** (`add_state_hook(hook)`: saving, evaluation) are asked whether they are
   `due(info)` at step N, once each (the save policy is evaluated here and nowhere else);
5. step N+1's batch is read and put on the devices, unless N is the last step;
6. the metrics hooks for step N, if a state hook is due or N is the last step; otherwise they
   are deferred to step N+1's point 2 (the late read: the host never waits for a step while
   the devices have nothing queued);
7. the state hooks that are due, in the order they were added;
8. `info` is yielded.

So a step's metrics are always checked (metrics hooks raise to stop the run) before its state is
saved or evaluated, and step N+1's batch goes to the devices after step N-1's report: putting it
ends in a device program, which XLA:CPU runs only after step N, holding the host thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

from t5lite.trainer import TrainState, summarize


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, model too large); the message says why."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One dispatched train step, as the state hooks see it."""

    step: int
    state: TrainState
    """The state after the step. The next step donates it: read it inside the hooks only."""
    metrics: dict[str, jax.Array]
    """The step's metrics, on the devices (reading them waits for the step)."""
    local_batch: dict[str, np.ndarray]
    """This process's rows of the step's batch (numpy)."""
    data_state: dict[str, Any]
    """The data iterator's state right after this step's batch: what a checkpoint records."""
    final: bool = False
    """The step is the run's `num_steps`-th."""
    stopping: bool = False
    """`stop_after_steps` steps of this invocation are done."""
    preempted: bool = False
    """A preemption signal arrived (agreed across processes at this step)."""

    @property
    def last(self) -> bool:
        """This invocation ends at this step (its state is saved)."""
        return self.final or self.stopping or self.preempted


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One step's metrics, read on the host: what the metrics hooks see."""

    step: int
    values: dict[str, float]
    """loss, z_loss, accuracy, target_tokens, sequences, and grad_norm / learning_rate where
    logged (`trainer.summarize`)."""
    params_finite: np.ndarray
    """One flag per floating-point parameter array (`trainer.inexact_leaf_paths` order)."""
    local_batch: dict[str, np.ndarray]
    last: bool = False
    """This invocation ends at this step (`StepInfo.last`)."""
    final: bool = False
    """The step is the run's `num_steps`-th."""


class StateHook(Protocol):
    """A hook that acts on a step's state (saving, evaluation)."""

    def due(self, info: StepInfo) -> bool:
        """Whether it acts at this step; asked once per step, before the step's metrics are
        read (a due hook makes them read at once)."""
        ...

    def __call__(self, info: StepInfo) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Which steps one invocation of the loop runs."""

    start: int
    """The step of the state the loop starts from (steps `start + 1`, ... run)."""
    num_steps: int
    """The run's last step."""
    stop_after_steps: int | None = None
    """End (with a checkpoint) after this many steps of this invocation, as a preemption would."""


# A step's global batch, the data iterator's state after it, and this process's numpy rows.
_Prepared = tuple[dict[str, jax.Array], dict[str, Any], dict[str, np.ndarray]]


class Batches:
    """The global batch of the next step, prepared (read, packed, put on the devices) while the
    current step runs, with the data iterator's state right after it: what that step's
    checkpoint records, so a resume continues with the batch after it whatever was prefetched."""

    def __init__(self, dataset: Any, global_batch: Callable[[dict[str, np.ndarray]], Any]):
        self.dataset = dataset
        self.global_batch = global_batch
        self._next: _Prepared | None = None

    def prefetch(self) -> None:
        if self._next is None:
            local = next(self.dataset)  # numpy, this process's rows: throughput counts its tokens
            self._next = (self.global_batch(local), self.dataset.get_state(), local)

    def reset(self) -> None:
        """Forgets the prefetched batch (the data iterator is set elsewhere: a rollback)."""
        self._next = None

    def take(self) -> _Prepared:
        self.prefetch()
        out, self._next = self._next, None
        assert out is not None
        return out


@dataclasses.dataclass(frozen=True)
class _MetricsHook:
    fn: Callable[[StepMetrics], None]
    every: int


class TrainLoop:
    """Dispatches train steps and runs the hooks around them (see the module docstring).

    Args:
      train_step: `(state, batch) -> (state, device metrics)`, dispatched asynchronously.
      batches: the prepared batches of the steps.
      config: which steps to run.
    """

    def __init__(
        self,
        train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]],
        batches: Batches,
        config: LoopConfig,
    ):
        self.train_step = train_step
        self.batches = batches
        self.config = config
        self._metrics_hooks: list[_MetricsHook] = []
        self._stop_hooks: list[Callable[[int], bool]] = []
        self._state_hooks: list[StateHook] = []

    def add_hook(self, fn: Callable[[StepMetrics], None], *, every: int = 1) -> None:
        """`fn(metrics)` for the steps that are multiples of `every` (and the last step),
        after the hooks added before it."""
        self._metrics_hooks.append(_MetricsHook(fn, max(1, every)))

    def add_stop_hook(self, fn: Callable[[int], bool]) -> None:
        """`fn(step)`, asked once per step; True ends the invocation at that step."""
        self._stop_hooks.append(fn)

    def add_state_hook(self, hook: StateHook) -> None:
        """`hook(info)` at the steps where `hook.due(info)`, after the step's metrics hooks."""
        self._state_hooks.append(hook)

    def steps(self, state: TrainState) -> Iterator[StepInfo]:
        """Runs the steps; yields each step's info once its hooks have run (its metrics hooks
        may run one step later, see the module docstring)."""
        cfg = self.config
        pending: StepInfo | None = None  # dispatched, its metrics not read yet
        for step in range(cfg.start + 1, cfg.num_steps + 1):
            batch, data_state, local = self.batches.take()
            # Returns before the step has run (on XLA:CPU: once the step before it is done).
            state, metrics = self.train_step(state, batch)
            if pending is not None:
                self._read(pending)
                pending = None
            info = StepInfo(
                step,
                state,
                metrics,
                local,
                data_state,
                final=step == cfg.num_steps,
                stopping=cfg.stop_after_steps is not None
                and step - cfg.start >= cfg.stop_after_steps,
                # Each stop hook is asked once per step: with several processes preemption is a
                # sync point all of them reach.
                preempted=any([fn(step) for fn in self._stop_hooks]),
            )
            last = info.last
            due = [hook for hook in self._state_hooks if hook.due(info)]
            if not last:
                self.batches.prefetch()
            if due or last:
                self._read(info)
            else:
                pending = info
            for hook in due:
                hook(info)
            yield info
            if last:
                return

    def _read(self, info: StepInfo) -> None:
        """Reads `info`'s metrics on the host (waits for its step) and runs the metrics hooks."""
        raw = jax.device_get(info.metrics)
        flags = np.asarray(raw["params_finite"])
        last, step = info.last, info.step
        m = StepMetrics(step, summarize(raw), flags, info.local_batch, last=last, final=info.final)
        for hook in self._metrics_hooks:
            if hook.every == 1 or last or step % hook.every == 0:
                hook.fn(m)
