"""Bad steps and known-good checkpoints: the train loop's divergence check and its rollbacks.

`HealthCheck` is the metrics hook that judges each step: a step whose loss, gradient norm or
updated parameters are not finite, or whose loss is a spike (`RecoveryConfig.spike_factor` times
the median of the recent healthy losses), is bad. A checkpoint is known good once
`good_after_steps` healthy steps have followed it (the step after a checkpoint computes its loss
with the checkpoint's parameters: finite but huge parameters show there), never merely because
it is finite. At a bad step the hook raises `Rollback` naming the newest good checkpoint before
it (the train program restores it and skips the batches of the rolled-back steps), or, past
`max_rollbacks` or without a good checkpoint, `TrainingError`; either way the checkpoints newer
than the good one are moved to `MODEL_DIR/rolled_back_<n>/` (kept, never resumed), so a rerun
resumes from the good one.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import statistics
from pathlib import Path

import jax

from t5lite import distributed
from t5lite.checkpoint import CheckpointManager
from t5lite.checkpoint.layout import read_extra
from t5lite.programs import metrics_writer as mw
from t5lite.programs.configs import RecoveryConfig
from t5lite.programs.train_hooks import StallDetector
from t5lite.programs.train_loop import StepMetrics, TrainingError

EXTRA_KEY = "good_checkpoints"
MIN_SPIKE_HISTORY = 20


@dataclasses.dataclass
class Rollback(Exception):
    """Go back to checkpoint `to` and skip `skip` batches after it (bad step: `bad_step`)."""

    bad_step: int
    to: int
    skip: int
    why: str


class GoodCheckpoints:
    """The steps of the checkpoints known to be good. Each checkpoint records those known when
    it was written (extra `good_checkpoints`); a run starts from its latest checkpoint's record.

    A checkpoint written before that record existed: every committed checkpoint but the newest
    counts as good (the run went on past each, through the finite check), and the newest is
    judged by the steps after it.
    """

    def __init__(self, ckpt: CheckpointManager):
        self.ckpt = ckpt
        steps = ckpt.all_steps()
        extra = read_extra(ckpt.step_dir(steps[-1])) if steps else {}
        self.steps = set(extra.get(EXTRA_KEY, steps[:-1])) & set(steps)
        self._protect()

    def _protect(self) -> None:
        """The newest good checkpoint outlives the keep policy: newer, unconfirmed ones must
        not push out the one a rollback goes back to."""
        self.ckpt.protected = frozenset([max(self.steps)] if self.steps else [])

    def add(self, step: int) -> None:
        self.steps.add(step)
        self._protect()

    def record(self) -> dict[str, list[int]]:
        """What a checkpoint written now records (what the keep policy deleted forgotten; a
        save still in flight is newer than every committed step)."""
        committed = self.ckpt.all_steps()
        newest = committed[-1] if committed else -1
        self.steps = {s for s in self.steps if s in committed or s > newest}
        return {EXTRA_KEY: sorted(self.steps)}

    def newest_before(self, step: int) -> int | None:
        """The newest committed good checkpoint before `step`."""
        committed = set(self.ckpt.all_steps())
        good = [s for s in self.steps if s < step and s in committed]
        return max(good, default=None)


class HealthCheck:
    """The metrics hook that judges each step (see the module docstring)."""

    def __init__(
        self,
        config: RecoveryConfig,
        ckpt: CheckpointManager,
        param_paths: list[str],
        stall: StallDetector,
        writer: mw.MetricsWriter,
    ):
        self.config, self.ckpt, self.param_paths = config, ckpt, param_paths
        self.stall, self.writer = stall, writer
        self.is_chief = jax.process_index() == 0
        self.good = GoodCheckpoints(ckpt)
        self.losses: collections.deque[float] = collections.deque(maxlen=config.spike_window)
        self.healthy_after: dict[int, int] = {}  # checkpoint step -> healthy steps since
        self.rollbacks = 0

    def started(self, step: int) -> None:
        """The loop starts (or restarts) from checkpoint `step`: the steps after it judge it."""
        self.losses.clear()  # the median of another trajectory says nothing here
        self.healthy_after = {}
        if step in self.ckpt.all_steps() and step not in self.good.steps:
            self.healthy_after[step] = 0

    def saved(self, step: int) -> None:
        """Checkpoint `step` was written: the steps after it judge it."""
        self.healthy_after[step] = 0

    def __call__(self, m: StepMetrics) -> None:
        why = self._bad(m)
        if why is not None:
            self._bad_step(m.step, why)
        if self.stall.is_stalled(m.values):
            return  # not bad, not healthy: confirms no checkpoint
        self.losses.append(m.values["loss"])
        for step in [s for s in self.healthy_after if s < m.step]:
            self.healthy_after[step] += 1
            if self.healthy_after[step] >= self.config.good_after_steps:
                del self.healthy_after[step]
                self.good.add(step)

    def _bad(self, m: StepMetrics) -> str | None:
        """Why step `m` is bad (the error text), or None."""
        v = m.values
        if not (m.params_finite.all() and all(math.isfinite(x) for x in v.values())):
            bad = [p for p, ok in zip(self.param_paths, m.params_finite) if not ok]
            what = [f"loss {v['loss']:.4g}"]
            if "grad_norm" in v:
                what.append(f"gradient norm {v['grad_norm']:.4g}")
            if bad:
                what.append(f"{len(bad)} non-finite parameter arrays, first 'params/{bad[0]}'")
            return f"step {m.step} is not finite ({', '.join(what)})"
        k = self.config.spike_factor
        if k is None or len(self.losses) < min(MIN_SPIKE_HISTORY, self.config.spike_window):
            return None
        median = statistics.median(self.losses)
        if v["loss"] > k * median:
            return (
                f"step {m.step} is a loss spike (loss {v['loss']:.4g} > {k:g} x the median "
                f"{median:.4g} of the last {len(self.losses)} healthy steps)"
            )
        return None

    def _bad_step(self, step: int, why: str) -> None:
        self.ckpt.wait()  # a save in flight commits first: it is judged like the others
        _sync(f"t5lite_bad_step_{step}_{self.rollbacks}")  # every process sees it committed
        good = self.good.newest_before(step)
        if good is not None and self.rollbacks < self.config.max_rollbacks:
            self.rollbacks += 1
            moved = self._move_aside_after(good)
            skip = step - good + self.config.skip_batches
            self.writer.info(
                f"warning: {why}; rollback {self.rollbacks} of {self.config.max_rollbacks}: "
                f"back to {self.ckpt.step_dir(good)}, skipping {skip} batches"
                + (f" (newer checkpoints moved to {moved})" if moved else "")
            )
            raise Rollback(step, good, skip, why)
        n = self.rollbacks
        tried = f" after {n} rollback{'s' if n > 1 else ''}" if n else ""
        raise TrainingError(
            f"{why}{tried}; it was not saved. The last good checkpoint is "
            f"{self._stop_at(good)}; lower the learning rate or clip more strongly"
        )

    def stop_text(self, since: int) -> str:
        """For a run that stops at a stall that began at step `since`: names the newest good
        checkpoint before it, moving the newer ones aside."""
        self.ckpt.wait()
        _sync(f"t5lite_stalled_{since}")
        return "the last good checkpoint is " + self._stop_at(self.good.newest_before(since))

    def _stop_at(self, good: int | None) -> str:
        """The run stops: moves the checkpoints newer than `good` aside; says where a rerun
        starts."""
        moved = self._move_aside_after(good)
        if good is None:
            if moved is None:
                return "none (no save yet): a rerun starts afresh"
            return (
                f"none (none was followed by a healthy step; moved to {moved}): a rerun "
                "starts afresh"
            )
        aside = f" (newer checkpoints moved to {moved})" if moved else ""
        return f"{self.ckpt.step_dir(good)}{aside}: a rerun resumes from it"

    def _move_aside_after(self, good: int | None) -> Path | None:
        """Moves the committed checkpoints newer than `good` (None: all) to a new
        `rolled_back_<n>/` (process 0), so that they are neither resumed nor overwritten;
        returns it."""
        newer = [s for s in self.ckpt.all_steps() if good is None or s > good]
        if not newer:
            return None
        directory = Path(self.ckpt.directory)
        n = 1 + sum(1 for p in directory.glob("rolled_back_*"))
        dest = directory / f"rolled_back_{n}"
        _sync(f"t5lite_listed_{newer[-1]}_{self.rollbacks}")  # listed before any is moved
        if self.is_chief:
            dest.mkdir()
            for s in newer:
                os.rename(self.ckpt.step_dir(s), dest / self.ckpt.step_dir(s).name)
        _sync(f"t5lite_moved_{newer[-1]}_{self.rollbacks}")
        return dest


def _sync(name: str) -> None:
    """All processes of a multi-process run reach this point before any goes on."""
    distributed.barrier(name)
