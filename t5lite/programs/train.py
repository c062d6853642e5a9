"""The `train` program: steps, checkpoints, evaluation and logs for one model directory.

An ordinary function a notebook can call with the grouped configs of `configs.py`; the CLI
binds the same arguments with gin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

import seqio_lite
from seqio_lite import cache_tasks
from t5lite.checkpoint import CheckpointManager, restore_checkpoint
from t5lite.checkpoint.checks import check_against_metadata
from t5lite.insight.hardware import peak_flops
from t5lite.insight.sharding import format_bytes
from t5lite.model import lora
from t5lite.model.models import BaseModel
from t5lite.partitioning import Partitioner, Placement
from t5lite.programs import harness as harness_lib
from t5lite.programs import metrics_writer as mw
from t5lite.programs import recovery as recovery_lib
from t5lite.programs import run_dir
from t5lite.programs import train_hooks as hooks
from t5lite.programs.configs import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    RecoveryConfig,
    split_of,
)
from t5lite.programs.evaluate import check_task_and_model, feature_converter, make_evaluator
from t5lite.programs.harness import HarnessConfig
from t5lite.programs.train_loop import Batches, LoopConfig, StepInfo, TrainingError, TrainLoop
from t5lite.trainer import Trainer, TrainState, inexact_leaf_paths

__all__ = ["TrainingError", "train"]


def _check_fits(trainer: Trainer, state_abstract: Any) -> None:
    """Fails early, naming the memory needed, when the train step cannot fit on the device."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return  # CPU: no fixed device memory to compare against
    compiled = trainer.partitioner.compile(
        trainer.train_step, state_abstract, trainer.batch_abstract
    )
    mem = compiled.memory_analysis()
    need = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    if need > limit:
        raise TrainingError(
            f"the train step needs {format_bytes(need)} per device but {device.device_kind} "
            f"has {format_bytes(limit)}: shard more (see `t5lite plan`) or use smaller batches"
        )


def train(
    *,
    model_dir: str,
    model: BaseModel,
    data: DataConfig,
    num_steps: int,
    partitioner: Partitioner | None = None,
    num_microbatches: int = 1,
    seed: int = 0,
    checkpoint: CheckpointConfig = CheckpointConfig(),  # noqa: B008 (frozen)
    evaluation: EvalConfig | None = None,
    harness: HarnessConfig | None = None,
    log: LogConfig = LogConfig(),  # noqa: B008 (frozen)
    recovery: RecoveryConfig = RecoveryConfig(),  # noqa: B008 (frozen)
    stop_after_steps: int | None = None,
    step_timeout_s: float | None = 600.0,
    max_stalled_steps: int = 200,
    operative_config: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Trains `model` on `data`, resuming from the latest checkpoint in `model_dir`.

    Args:
      model_dir: checkpoints, `config.gin`, `metrics.jsonl` and TensorBoard events go here.
      model, partitioner: what to train and on which mesh with which rules.
      data: task, feature lengths, global batch size and pipeline options.
      num_steps: total steps (a resumed run continues up to it).
      num_microbatches: splits each batch for gradient accumulation.
      seed: initialisation, data order and dropout (`fold_in(seed, step)`).
      checkpoint: save period and retention, and an optional checkpoint to start from (a
        checkpoint is also written at the final step and on SIGTERM).
      evaluation: evaluate during and after training (None: never).
      harness: lm-evaluation-harness tasks to run during and after training (None: never;
        see `harness.py`, the [eval] extra); their metrics join the eval metrics.
      log: printed-log period and optional metrics.
      recovery: at a non-finite or spiking step, roll back to a checkpoint known to be good
        and skip the batches around it, a limited number of times; then stop, naming that
        checkpoint (a rerun resumes from it). See `recovery.py`.
      stop_after_steps: stop (with a checkpoint) after this many steps of this invocation,
        as a preemption would; for tests and time-boxed jobs.
      step_timeout_s: exit with an error when no step completes for this long (after the
        first, compiled step): a multi-process run whose peer died stops instead of hanging.
      max_stalled_steps: stop with an error when the model has predicted the uniform
        distribution (cross-entropy ln(vocab_size), zero gradient norm where it is logged) for
        this many consecutive steps: a run that diverged silently. 0: never stop for it. A run
        whose last two or more steps are stalled ends with that error too, however short (the
        last step's metrics record has `stalled_since`); with 0, or when the run only stops
        (preemption, `stop_after_steps`), it ends with a warning instead.
      operative_config: returns the text written to `model_dir/config.gin` once the run is set
        up (the CLI passes gin's operative config).

    Returns:
      The last train metrics and the last eval metrics.
    """
    with contextlib.ExitStack() as stack:  # closed in reverse: watchdog, checkpoints, log, lock
        partitioner = partitioner or Partitioner()
        # An unknown task, lengths or vocabulary that do not suit the model: before any write.
        check_task_and_model(data.task, model, data.task_feature_lengths)
        prepared = harness_lib.prepare(harness) if harness is not None else None
        run_dir.acquire_lock(model_dir, stack)  # before anything slow: one run per directory
        trainer = Trainer(
            model,
            partitioner,
            batch_size=data.batch_size,
            lengths=data.task_feature_lengths,
            num_microbatches=num_microbatches,
            seed=seed,
            log_grad_norm=log.grad_norm,
            packed=data.pack,
        )
        is_chief = jax.process_index() == 0
        writer = mw.MetricsWriter(
            model_dir, total_steps=num_steps, enabled=is_chief, log_period=log.period
        )
        stack.callback(writer.close)
        dataset = _train_dataset(data, model, partitioner, seed, writer)
        stack.callback(dataset.close)  # the data process, where there is one
        ckpt = _checkpoint_manager(model_dir, checkpoint, stack)
        _check_start_checkpoint(ckpt, checkpoint.init_checkpoint, trainer)
        _check_fits(trainer, trainer.abstract_state())
        _warn_replicated(trainer, writer)
        state = _restore_or_init(trainer, ckpt, dataset, checkpoint.init_checkpoint, writer)
        if is_chief:  # config.gin and the vocabulary files: the model directory stands alone
            run_dir.write_run_files(model_dir, operative_config, data.task)

        start = int(state.step)
        writer.info(_start_line(model_dir, start, num_steps))
        loop = TrainLoop(
            trainer.train_step,
            Batches(dataset, trainer.global_batch),
            LoopConfig(start, num_steps, stop_after_steps),
        )
        watchdog = hooks.Watchdog(step_timeout_s, stack, writer)
        loop.add_hook(watchdog)
        stall = hooks.StallDetector(model.network_config.vocab_size, max_stalled_steps, ckpt)
        params_paths = inexact_leaf_paths(trainer.state_abstract.params)
        health = recovery_lib.HealthCheck(recovery, ckpt, params_paths, stall, writer)
        stall.stop_text = health.stop_text
        loop.add_hook(health)
        loop.add_hook(stall)
        log_step = hooks.LogStep(writer, _throughput(model, data.batch_size), stall.annotation)
        loop.add_hook(log_step)
        loop.add_stop_hook(hooks.preemption(ckpt))
        # Saved with every checkpoint: what `t5lite convert` and a reader of the checkpoint need.
        info = run_dir.run_info(seed, model, checkpoint.init_checkpoint)
        loop.add_state_hook(hooks.SaveCheckpoint(ckpt, trainer.state_axes, info, health))
        evaluate = _periodic_evaluation(trainer, data, evaluation, writer)
        if evaluate is not None:
            loop.add_state_hook(evaluate)
        lm_eval = _harness_evaluation(loop, harness, prepared, trainer, data.task, writer)
        with _setup_frozen():
            _run(loop, state, _Recovery(trainer, ckpt, dataset, health, stall, writer))
        if start < num_steps:
            writer.info(_done_line(ckpt, time.time() - watchdog.t0))
        return {"train": log_step.last, "eval": _last_eval(evaluate, lm_eval)}


def _checkpoint_manager(
    model_dir: str, checkpoint: CheckpointConfig, stack: contextlib.ExitStack
) -> CheckpointManager:
    """The run's checkpoints, closed with `stack`, saving on SIGTERM."""
    ckpt = CheckpointManager(
        model_dir,
        save_period=checkpoint.period,
        keep=checkpoint.keep,
        keep_period=checkpoint.keep_period,
    )
    stack.callback(ckpt.close)  # also on errors: the last save committed or cleaned up
    ckpt.install_preemption_handler()
    return ckpt


@dataclasses.dataclass(frozen=True)
class _Recovery:
    """What a rollback restores, repositions and resets."""

    trainer: Trainer
    ckpt: CheckpointManager
    dataset: Any
    health: recovery_lib.HealthCheck
    stall: hooks.StallDetector
    writer: mw.MetricsWriter

    def roll_back(self, loop: TrainLoop, r: recovery_lib.Rollback) -> TrainState:
        """Restores checkpoint `r.to` with its data position, skips `r.skip` batches."""
        state, extra = self.ckpt.restore(self.trainer.abstract_state(), step=r.to)
        self.dataset.set_state(extra["data"])
        for _ in range(r.skip):
            next(self.dataset)
        loop.batches.reset()
        self.stall.since = self.stall.streak_since = None
        return state


def _run(loop: TrainLoop, state: TrainState, recovery: _Recovery) -> None:
    """Runs the loop's steps, rolling back at bad steps (`recovery.HealthCheck`); says so when
    it stops before the run's last step, or ends stalled."""
    first, stop_after = loop.config.start, loop.config.stop_after_steps
    last: StepInfo | None = None
    while True:
        recovery.health.started(loop.config.start)
        try:
            for info in loop.steps(state):
                last = info
            break
        except recovery_lib.Rollback as r:
            state = recovery.roll_back(loop, r)
            # `stop_after_steps` still counts from where this invocation started.
            remaining = None if stop_after is None else max(1, first + stop_after - r.to)
            loop.config = dataclasses.replace(loop.config, start=r.to, stop_after_steps=remaining)
    if last is None:
        return
    recovery.stall.end_of_run(last.final, recovery.writer)
    if last.preempted or last.stopping:
        recovery.writer.info(f"stopped at step {last.step}; checkpoint committed")


@contextlib.contextmanager
def _setup_frozen() -> Iterator[None]:
    """The objects that exist before the first step (JAX's, Flax's and gin's state, the model:
    ~400k) out of the garbage collector's sight while the steps run. A full collection walks
    every tracked object: on that heap it paused the thread that feeds the devices for ~0.3 s
    every couple of hundred steps (the device idles once its queued step is done). Garbage the
    loop makes is still collected; what is frozen is released to the collector afterwards."""
    gc.collect()  # garbage of the set-up is freed now, not kept frozen for the whole run
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_start_checkpoint(
    ckpt: CheckpointManager, init_checkpoint: str | None, trainer: Trainer
) -> None:
    """Before anything compiles: the checkpoint the run starts from fits this model."""
    latest = ckpt.latest_step()
    if latest is not None:
        check_against_metadata(ckpt.step_dir(latest), trainer.state_abstract)
    elif init_checkpoint:
        # A LoRA fine-tune starts from a checkpoint without adapters: they start fresh.
        params = lora.without_factors(trainer.state_abstract.params)
        check_against_metadata(init_checkpoint, {"params": params}, params_only=True)


def _done_line(ckpt: CheckpointManager, seconds: float) -> str:
    ckpt.wait()  # the final save is committed before it is announced
    latest = ckpt.latest_step()
    where = ckpt.step_dir(latest) if latest is not None else "no checkpoint"
    return f"done: step {latest}, {where}, {seconds:.0f} s"


def _start_line(model_dir: str, start: int, num_steps: int) -> str:
    if start >= num_steps:
        return f"{model_dir} is complete: trained to step {start} of {num_steps}; nothing to do"
    return f"compiling the train step, then steps {start + 1} to {num_steps}"


def _warn_replicated(trainer: Trainer, writer: mw.MetricsWriter) -> None:
    """One line when a rule names a parameter dimension that still stays replicated (its mesh
    axis was taken by another dimension of the same array), as `t5lite inspect` marks with !."""
    placements = trainer.partitioner.placements(trainer.state_abstract.params, trainer.params_axes)
    flagged = [
        p
        for p in jax.tree_util.tree_leaves(placements, is_leaf=lambda x: isinstance(x, Placement))
        if p.replicated_despite_rule
    ]
    if flagged:
        first = flagged[0]
        writer.info(
            f"warning: {len(flagged)} parameter arrays keep a dimension replicated although a "
            f"rule names it (first: params/{first.path} {list(first.replicated_despite_rule)} "
            f"under {first.spec}); `t5lite inspect` lists them"
        )


def _train_dataset(
    data: DataConfig,
    model: BaseModel,
    partitioner: Partitioner,
    seed: int,
    writer: mw.MetricsWriter,
):
    """This process's shard of the training examples, in the model's features; read by a data
    process (`DataConfig.data_process`). It starts now, so on a fresh run its start-up (~1 s)
    overlaps the initialisation; a resume starts it again at the checkpoint's position."""
    layout = partitioner.get_data_layout(data.batch_size)
    if data.use_cached and data.cache_dir:
        cache_tasks.add_global_cache_dirs([data.cache_dir])
    iterator = seqio_lite.get_dataset(
        data.task,
        dict(data.task_feature_lengths),
        split_of(data, "train"),
        layout.per_process_batch_size,
        shard_id=layout.shard_id,
        num_shards=layout.num_shards,
        seed=seed,
        feature_converter=feature_converter(model, data.pack),
        use_cached=data.use_cached,
    )
    if not data.data_process:
        return iterator
    return seqio_lite.BackgroundIterator(iterator, on_fallback=writer.info)


def _restore_or_init(
    trainer: Trainer,
    ckpt: CheckpointManager,
    dataset: Any,
    init_checkpoint: str | None,
    writer: mw.MetricsWriter,
) -> TrainState:
    """The latest checkpoint of the run (with the data iterator's position), or a fresh state,
    or fresh with the parameters of `init_checkpoint` (fine-tuning)."""
    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(trainer.abstract_state())
        dataset.set_state(extra["data"])
        writer.info(f"resumed from {ckpt.step_dir(int(state.step))}")
        return state
    state = trainer.init_state()
    if init_checkpoint:
        # Parameters from the checkpoint (cast and resharded); optimizer state stays fresh.
        fresh = [(rf"params/{lora.FACTOR_PATTERN}", None)]  # adapters keep their init
        state, _ = restore_checkpoint(
            init_checkpoint, state, with_extra=False, params_only=True, assignment_map=fresh
        )
        writer.info(f"initialised parameters from {init_checkpoint}")
    return state


def _periodic_evaluation(
    trainer: Trainer,
    data: DataConfig,
    evaluation: EvalConfig | None,
    writer: mw.MetricsWriter,
) -> hooks.Evaluate | None:
    """Evaluation during training as `evaluation` says (None: never)."""
    if evaluation is None:
        return None
    lengths = dict(data.task_feature_lengths)
    batch_size = evaluation.batch_size or data.batch_size
    evaluator = make_evaluator(
        trainer.model,
        evaluation.task or data.task,
        lengths,
        split=evaluation.split,
        num_examples=evaluation.num_examples,
        batch_size=batch_size,
    )
    eval_trainer = trainer
    if batch_size != trainer.batch_size:  # predict functions compile for their batch size
        eval_trainer = Trainer(
            trainer.model,
            trainer.partitioner,
            batch_size=batch_size,
            lengths=lengths,
            seed=trainer.seed,
        )
    decode_len = evaluation.max_decode_length or lengths["targets"]
    return hooks.Evaluate(evaluation, evaluator, eval_trainer, decode_len, writer)


def _harness_evaluation(
    loop: TrainLoop,
    config: HarnessConfig | None,
    prepared: harness_lib.PreparedTasks | None,
    trainer: Trainer,
    task: str,
    writer: mw.MetricsWriter,
) -> harness_lib.HarnessEvaluate | None:
    """The lm-eval tasks as a state hook of `loop` (None: no harness tasks)."""
    if config is None or prepared is None:
        return None
    hook = harness_lib.train_hook(
        config, prepared, trainer.model, trainer.partitioner, task, writer, trainer.seed
    )
    loop.add_state_hook(hook)
    return hook


def _last_eval(*hooks: Any) -> dict[str, Any]:
    """The newest metrics of the evaluation hooks that run (seqio tasks, harness tasks)."""
    return {k: v for h in hooks if h is not None for k, v in h.last.items()}


def _throughput(model: BaseModel, batch_size: int) -> mw.Throughput:
    """Rates and MFU against the peak of every device of the run (hardware.py's table)."""
    peak = peak_flops(jax.devices()[0].device_kind)
    return mw.Throughput(
        model.network_config,
        batch_size,
        peak * jax.device_count() if peak else None,
        process_count=jax.process_count(),
    )
