"""The grouped settings of the programs, as small frozen dataclasses gin binds.

Like t5x's `DatasetConfig` / `SaveCheckpointConfig`: `train.data = @DataConfig()` and
`DataConfig.batch_size = 128` read as one group in a gin file and in the operative config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which examples a program reads, how long they are and how many go in one step."""

    task: str
    """A registered seqio_lite task or mixture name."""
    task_feature_lengths: Mapping[str, int]
    """Tokens per feature, e.g. `{'inputs': 512, 'targets': 114}`."""
    batch_size: int
    """Global examples per step (all processes, all microbatches together)."""
    split: str | None = None
    """The split to read (None: 'train' for `train`, 'validation' for `evaluate` and `infer`)."""
    num_examples: int | None = None
    """Eval / infer: the first N examples of the split (None: all)."""
    pack: bool = True
    """Train: pack several examples per row. An unpacked iterator state restores under any
    process count; a packed one only under the same."""
    use_cached: bool = False
    """Train: read the task's offline cache, written by `t5lite cache` to `cache_dir`."""
    cache_dir: str | None = None
    """Where `t5lite cache` writes the task's cache and `use_cached` reads it (also searched:
    `$SEQIO_LITE_CACHE_DIRS`)."""
    data_process: bool = True
    """Train: read, preprocess and pack the batches in a separate low-priority process, a few
    steps ahead (`seqio_lite.BackgroundIterator`), so the pipeline's Python never takes the
    CPU or the interpreter lock of the process that dispatches the steps. False: read them in
    the training process."""

    def __post_init__(self) -> None:
        lengths = dict(self.task_feature_lengths)
        bad = {k: v for k, v in lengths.items() if not isinstance(v, int) or v < 1}
        if "targets" not in lengths or bad:
            raise ValueError(
                f"DataConfig.task_feature_lengths = {lengths}: needs a positive length for "
                "'targets' (and 'inputs' for encoder-decoder and prefix-LM models)"
            )
        if self.batch_size < 1:
            raise ValueError(f"DataConfig.batch_size = {self.batch_size}: must be positive")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written and which are kept."""

    period: int = 1000
    """Steps between saves (0: only at the end and on preemption)."""
    keep: int | None = 3
    """The newest N checkpoints are kept (None: all)."""
    keep_period: int | None = None
    """Also keep every checkpoint whose step is a multiple of this."""
    init_checkpoint: str | None = None
    """A checkpoint whose parameters start a fresh run (fine-tuning, e.g. one written by
    `t5lite convert`); ignored when the model directory has a checkpoint to resume."""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training."""

    task: str | None = None
    """Task or mixture to evaluate (None: the training task)."""
    split: str = "validation"
    num_examples: int | None = 256
    """The first N examples of the split (None: all)."""
    batch_size: int | None = None
    """Eval batch size (None: the training batch size)."""
    period: int = 0
    """Evaluate every this many steps (0: only after the last step)."""
    max_decode_length: int | None = None
    """Decode length for predict metrics (None: the targets length)."""
    num_predictions_to_print: int = 3


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What the train loop prints and records."""

    period: int = 10
    """Steps between printed log lines (metrics.jsonl and TensorBoard get every step)."""
    grad_norm: bool | None = None
    """Log the global gradient norm (None: when the optimizer clips, where it costs nothing;
    see `Trainer`)."""


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """What training does at a bad step, as large runs do it (PaLM, OPT): roll back to a
    checkpoint known to be good, skip the batches around the bad step, and go on.

    A step is bad when its loss, gradient norm or updated parameters are not finite, or its loss
    is a spike. A checkpoint is known good once `good_after_steps` healthy steps (finite, no
    spike, not stalled) have followed it; each checkpoint records which are (`good_checkpoints`).
    """

    max_rollbacks: int = 3
    """Rollbacks one invocation may make; at the bad step after them (or at the first with 0)
    the run stops, naming the newest good checkpoint, and moves the newer ones aside so that a
    rerun resumes from it."""
    spike_factor: float | None = None
    """A step whose loss exceeds this times the median of the recent healthy losses is a spike,
    e.g. 2.0 for a long pre-training run (None: only non-finite steps are bad). Off by default:
    once the loss is small (fine-tuning), a harder batch can double it without anything wrong."""
    spike_window: int = 100
    """How many recent healthy losses the median is taken over; no spike is called before
    `min(20, spike_window)` of them are seen in this invocation."""
    good_after_steps: int = 1
    """Healthy steps after a checkpoint that make it known good. The step after a checkpoint
    computes its loss with the checkpoint's parameters, so one already shows finite but huge
    parameters."""
    skip_batches: int = 0
    """Batches skipped after a rollback besides those of the rolled-back steps (from the
    checkpoint's next step to the bad step, which are always skipped)."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 0 or self.good_after_steps < 1 or self.skip_batches < 0:
            raise ValueError(
                f"{self}: max_rollbacks and skip_batches must be >= 0, good_after_steps >= 1"
            )
        if self.spike_factor is not None and self.spike_factor <= 1:
            raise ValueError(f"RecoveryConfig.spike_factor = {self.spike_factor}: must be > 1")


def split_of(data: DataConfig, default: str) -> str:
    """`data.split`, or the program's own default split when it is not set."""
    return data.split if data.split is not None else default
