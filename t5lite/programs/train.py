"""The `train` program: steps, checkpoints, evaluation and logs for one model directory.

An ordinary function a notebook can call with the grouped configs of `configs.py`; the CLI
binds the same arguments with gin.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import jax
import numpy as np

import seqio_lite
from seqio_lite import cache_tasks
from t5lite.checkpoint import CheckpointManager, restore_checkpoint
from t5lite.checkpoint.checks import check_against_metadata
from t5lite.checkpoint.layout import read_extra
from t5lite.distributed import ProgressWatchdog
from t5lite.insight.hardware import peak_flops
from t5lite.insight.sharding import format_bytes
from t5lite.model import lora
from t5lite.model.config import config_record
from t5lite.model.models import BaseModel
from t5lite.partitioning import Partitioner, Placement
from t5lite.programs import metrics_writer as mw
from t5lite.programs.configs import CheckpointConfig, DataConfig, EvalConfig, LogConfig, split_of
from t5lite.programs.evaluate import (
    check_task_and_model,
    feature_converter,
    make_evaluator,
    run_evaluation,
)
from t5lite.programs.run_lock import RunLock, RunLockError
from t5lite.trainer import Trainer, TrainState, inexact_leaf_paths, summarize


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, model too large); the message says why."""


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
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )  # fmt: skip
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
    log: LogConfig = LogConfig(),  # noqa: B008 (frozen)
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
      log: printed-log period and optional metrics.
      stop_after_steps: stop (with a checkpoint) after this many steps of this invocation,
        as a preemption would; for tests and time-boxed jobs.
      step_timeout_s: exit with an error when no step completes for this long (after the
        first, compiled step): a multi-process run whose peer died stops instead of hanging.
      max_stalled_steps: stop with an error when the model has predicted the uniform
        distribution (cross-entropy ln(vocab_size), zero gradient norm where it is logged) for
        this many consecutive steps: a run that diverged silently. 0: never stop for it.
      operative_config: returns the text written to `model_dir/config.gin` once the run is set
        up (the CLI passes gin's operative config).

    Returns:
      The last train metrics and the last eval metrics.
    """
    with contextlib.ExitStack() as stack:  # closed in reverse: watchdog, checkpoints, log, lock
        partitioner = partitioner or Partitioner()
        # An unknown task, lengths or vocabulary that do not suit the model: before any write.
        check_task_and_model(data.task, model, data.task_feature_lengths)
        is_chief = jax.process_index() == 0
        _acquire_lock(model_dir, is_chief, stack)  # before anything slow: one run per directory
        trainer = Trainer(
            model, partitioner, batch_size=data.batch_size, lengths=data.task_feature_lengths,
            num_microbatches=num_microbatches, seed=seed, log_grad_norm=log.grad_norm,
        )  # fmt: skip
        writer = mw.MetricsWriter(model_dir, total_steps=num_steps, enabled=is_chief,
                                  log_period=log.period)  # fmt: skip
        stack.callback(writer.close)
        dataset = _train_dataset(data, model, partitioner, seed, writer)
        stack.callback(dataset.close)  # the data process, where there is one
        ckpt = CheckpointManager(
            model_dir, save_period=checkpoint.period, keep=checkpoint.keep,
            keep_period=checkpoint.keep_period,
        )  # fmt: skip
        stack.callback(ckpt.close)  # also on errors: the last save committed or cleaned up
        ckpt.install_preemption_handler()
        _check_start_checkpoint(ckpt, checkpoint.init_checkpoint, trainer)
        _check_fits(trainer, trainer.abstract_state())
        _warn_replicated(trainer, writer)
        state = _restore_or_init(trainer, ckpt, dataset, checkpoint.init_checkpoint, writer)
        if is_chief:  # config.gin and the vocabulary files: the model directory stands alone
            _write_run_files(model_dir, operative_config, data.task)
        evaluate = _periodic_evaluation(trainer, data, evaluation, writer)
        throughput = _throughput(model, data.batch_size)
        stall = _StallDetector(model.network_config.vocab_size, max_stalled_steps, ckpt)
        # Saved with every checkpoint: what `t5lite convert` and a reader of the checkpoint need.
        run_info = _run_info(seed, model, checkpoint.init_checkpoint)

        start = int(state.step)
        writer.info(_start_line(model_dir, start, num_steps))
        report = _StepReport(ckpt, writer, stall, throughput, trainer, stack, step_timeout_s)
        with _setup_frozen():
            last, eval_metrics = _run_steps(
                trainer, state, start, num_steps, _Batches(dataset, trainer), report, ckpt,
                evaluate, run_info, stop_after_steps,
            )  # fmt: skip
        if start < num_steps:
            writer.info(_done_line(ckpt, time.time() - report.t0))
        return {"train": last, "eval": eval_metrics}


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


def _run_steps(
    trainer: Trainer,
    state: TrainState,
    start: int,
    num_steps: int,
    batches: _Batches,
    report: _StepReport,
    ckpt: CheckpointManager,
    evaluate: _Evaluation | None,
    run_info: dict[str, Any],
    stop_after_steps: int | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Steps `start + 1` to `num_steps` (or until stopped); returns the last train and eval
    metrics.

    The host never waits for a step while the device has nothing queued: step N is dispatched
    first, then (while it runs) step N-1's metrics are read, checked and logged, and last step
    N+1's batch is read and put on the devices. Last, because putting it ends in a device
    program (splitting the stacked features) and XLA:CPU runs a program only once the one
    before it is done, holding the thread that dispatched it: whatever the host does after
    that, the devices wait for (measured: ~1 ms per step on the quickstart, 2 CPU cores).
    A step's metrics are read at once only where that step saves, evaluates or ends the run,
    so a step is always checked (finite, still learning) before its state is saved or
    evaluated. Bounded lag: a non-finite step N-1 is reported while step N runs; step N's
    state is discarded with it, never saved.
    """
    last: dict[str, Any] = {}
    eval_metrics: dict[str, Any] = {}
    pending = None  # (step, device metrics) dispatched but not read yet
    for step in range(start + 1, num_steps + 1):
        batch, data_state, local = batches.take()
        # Returns before the step has run (on XLA:CPU: once the step before it is done).
        state, metrics = trainer.train_step(state, batch)
        is_final = step == num_steps
        stop_now = stop_after_steps is not None and step - start >= stop_after_steps
        if pending is not None:
            last = report(*pending)
            pending = None
        # Asked once per step: with several processes it is a sync point all of them reach.
        preempted = ckpt.reached_preemption(step)
        saves = ckpt.should_save(step, is_final or stop_now, preempted)
        evaluates = evaluate is not None and evaluate.due(step, is_final)
        if not (is_final or stop_now or preempted):
            batches.prefetch()
        if saves or evaluates or is_final or stop_now:
            last = report(step, metrics, local)
        else:
            pending = (step, metrics, local)
        extra = {"data": data_state, "step": step, **run_info}
        ckpt.maybe_save(step, state, extra=extra, logical_axes=trainer.state_axes,
                        is_final=is_final or stop_now, preempted=preempted)  # fmt: skip
        if evaluates:
            eval_metrics = evaluate(state, step) or eval_metrics
        if preempted or stop_now:
            report.writer.info(f"stopped at step {step}; checkpoint committed")
            break
    return last, eval_metrics


# A step's global batch, the data iterator's state after it, and this process's numpy rows.
_Prepared = tuple[dict[str, jax.Array], dict[str, Any], dict[str, np.ndarray]]


class _Batches:
    """The global batch of the next step, prepared (read, packed, put on the devices) while the
    current step runs, with the data iterator's state right after it: what that step's
    checkpoint records, so a resume continues with the batch after it whatever was prefetched."""

    def __init__(self, dataset: Any, trainer: Trainer):
        self.dataset = dataset
        self.trainer = trainer
        self._next: _Prepared | None = None

    def prefetch(self) -> None:
        if self._next is None:
            local = next(self.dataset)  # numpy, this process's rows: throughput counts its tokens
            self._next = (self.trainer.global_batch(local), self.dataset.get_state(), local)

    def take(self) -> _Prepared:
        self.prefetch()
        out, self._next = self._next, None
        assert out is not None
        return out


class _StepReport:
    """Reads one step's metrics on the host: the finite and stall checks, the log line, the
    watchdog's ping."""

    def __init__(
        self,
        ckpt: CheckpointManager,
        writer: mw.MetricsWriter,
        stall: _StallDetector,
        throughput: mw.Throughput,
        trainer: Trainer,
        stack: contextlib.ExitStack,
        step_timeout_s: float | None,
    ):
        self.ckpt, self.writer, self.stall, self.throughput = ckpt, writer, stall, throughput
        self.param_paths = inexact_leaf_paths(trainer.state_abstract.params)
        self.stack, self.step_timeout_s = stack, step_timeout_s
        self.watchdog: ProgressWatchdog | None = None
        self.t0 = time.time()

    def __call__(
        self, step: int, metrics: dict[str, jax.Array], local_batch: dict[str, np.ndarray]
    ) -> dict[str, Any]:
        raw = jax.device_get(metrics)
        m = summarize(raw)
        if self.watchdog is None:  # armed after the first step: compilation time is unbounded
            self.watchdog = self.stack.enter_context(
                contextlib.closing(ProgressWatchdog(self.step_timeout_s))
            )
            self.writer.info(f"compiled; the first step took {time.time() - self.t0:.1f} s")
        self.watchdog.ping()
        flags = np.asarray(raw["params_finite"])
        if not (flags.all() and all(math.isfinite(v) for v in m.values())):
            bad = [p for p, ok in zip(self.param_paths, flags) if not ok]
            _stop_non_finite(self.ckpt, step, m, bad)
        self.stall.check(step, m)
        last = {**m, **self.throughput.measure(local_batch)}
        self.writer.write(step, last)
        return last


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


def _run_info(seed: int, model: Any, init_checkpoint: str | None) -> dict[str, Any]:
    # The token ids are what `t5lite convert` writes back as the HF pad / EOS / start ids.
    ids = {k: getattr(model, k) for k in ("pad_id", "eos_id", "decoder_start_token_id")}
    info = {"seed": seed, "network_config": config_record(model.network_config), "token_ids": ids}
    if model.lora is not None:  # what `t5lite convert` needs to merge the adapters on export
        info["lora"] = asdict(model.lora)
    if init_checkpoint:  # an imported model's HF ids, written back as they were on export
        hf_ids = read_extra(pathlib.Path(init_checkpoint)).get("hf_token_ids")
        info.update({"hf_token_ids": hf_ids} if hf_ids is not None else {})
    return info


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
        p for p in jax.tree_util.tree_leaves(placements, is_leaf=lambda x: isinstance(x, Placement))
        if p.replicated_despite_rule
    ]  # fmt: skip
    if flagged:
        first = flagged[0]
        writer.info(
            f"warning: {len(flagged)} parameter arrays keep a dimension replicated although a "
            f"rule names it (first: params/{first.path} {list(first.replicated_despite_rule)} "
            f"under {first.spec}); `t5lite inspect` lists them"
        )


def _acquire_lock(model_dir: str, is_chief: bool, stack: contextlib.ExitStack) -> None:
    """Process 0 takes the model directory's run lock (released when `stack` closes); every
    process learns whether it could."""
    lock, error = None, None
    if is_chief:
        try:
            lock = RunLock(model_dir).acquire()
        except RunLockError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            error = RunLockError(f"{model_dir} is in use by another run (see process 0)")
    if error is not None:
        raise error
    if lock is not None:
        stack.callback(lock.release)


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
        data.task, dict(data.task_feature_lengths), split_of(data, "train"),
        layout.per_process_batch_size, shard_id=layout.shard_id, num_shards=layout.num_shards,
        seed=seed, feature_converter=feature_converter(model, data.pack),
        use_cached=data.use_cached,
    )  # fmt: skip
    if not data.data_process:
        return iterator
    return seqio_lite.BackgroundIterator(iterator, on_fallback=writer.info)


def _stop_non_finite(
    ckpt: CheckpointManager, step: int, m: dict[str, float], bad: list[str]
) -> None:
    """Ends the run at a step whose loss, gradient norm or parameters (`bad`: the paths of its
    non-finite parameter arrays) are not finite.

    That step's state is never saved; the checkpoints already committed are all finite (each
    was saved only after its own step passed this check), so the newest one is the last good.
    """
    ckpt.wait()  # an earlier, finite step may still be committing: it is the last good one
    latest = ckpt.latest_step()
    what = [f"loss {m['loss']:.4g}"]
    if "grad_norm" in m:
        what.append(f"gradient norm {m['grad_norm']:.4g}")
    if bad:
        what.append(f"{len(bad)} non-finite parameter arrays, first 'params/{bad[0]}'")
    raise TrainingError(
        f"step {step} is not finite ({', '.join(what)}); it was not saved. The last good "
        "checkpoint is "
        + (str(ckpt.step_dir(latest)) if latest is not None else "none (no save yet)")
        + ": resume from it with a lower learning rate or stronger clipping"
    )


class _StallDetector:
    """Notices a run that predicts the uniform distribution step after step (dead, diverged).

    Its cross-entropy is then ln(V) on every batch and its gradients are zero, so nothing will
    change however long it runs; finite-value checks cannot see it.
    """

    def __init__(self, vocab_size: int, patience: int, ckpt: CheckpointManager):
        self.uniform = math.log(vocab_size)
        self.patience = patience
        self.ckpt = ckpt
        self.since: int | None = None

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
) -> _Evaluation | None:
    """Evaluation during training as `evaluation` says (None: never)."""
    if evaluation is None:
        return None
    lengths = dict(data.task_feature_lengths)
    batch_size = evaluation.batch_size or data.batch_size
    evaluator = make_evaluator(
        trainer.model, evaluation.task or data.task, lengths, split=evaluation.split,
        num_examples=evaluation.num_examples, batch_size=batch_size,
    )  # fmt: skip
    eval_trainer = trainer
    if batch_size != trainer.batch_size:  # predict functions compile for their batch size
        eval_trainer = Trainer(trainer.model, trainer.partitioner, batch_size=batch_size,
                               lengths=lengths, seed=trainer.seed)  # fmt: skip
    decode_len = evaluation.max_decode_length or lengths["targets"]
    return _Evaluation(evaluation, evaluator, eval_trainer, decode_len, writer)


class _Evaluation:
    """`due(step, is_final)`: whether to evaluate at this step (every `period` steps and after
    the last); `evaluate(state, step)`: the eval metrics."""

    def __init__(self, config: EvalConfig, evaluator: Any, trainer: Trainer, decode_len: int,
                 writer: mw.MetricsWriter):  # fmt: skip
        self.config, self.evaluator, self.trainer = config, evaluator, trainer
        self.decode_len, self.writer = decode_len, writer

    def due(self, step: int, is_final: bool) -> bool:
        return is_final or bool(self.config.period and step % self.config.period == 0)

    def __call__(self, state: TrainState, step: int) -> dict[str, Any] | None:
        return run_evaluation(
            self.evaluator, self.trainer, state.params, decode_len=self.decode_len,
            writer=self.writer, step=step, num_to_print=self.config.num_predictions_to_print,
        )  # fmt: skip


def _throughput(model: BaseModel, batch_size: int) -> mw.Throughput:
    """Rates and MFU against the peak of every device of the run (hardware.py's table)."""
    peak = peak_flops(jax.devices()[0].device_kind)
    return mw.Throughput(
        model.network_config, batch_size, peak * jax.device_count() if peak else None,
        process_count=jax.process_count(),
    )  # fmt: skip


def _write_run_files(model_dir: str, operative_config: Callable[[], str] | None, task: str) -> None:
    """`config.gin`, and a copy of every SentencePiece model the task's features use under
    `vocabulary/`, so the model directory is usable without the files it was trained from."""
    os.makedirs(model_dir, exist_ok=True)
    if operative_config is not None:
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(operative_config())
    obj = seqio_lite.get_task_or_mixture(task)
    for t in obj.tasks if isinstance(obj, seqio_lite.Mixture) else [obj]:
        for feature in t.output_features.values():
            vocab = feature.vocabulary
            if not isinstance(vocab, seqio_lite.SentencePieceVocabulary):
                continue
            dest = os.path.join(model_dir, "vocabulary", os.path.basename(vocab.model_file))
            if os.path.exists(dest):
                with open(dest, "rb") as f:
                    if f.read() != vocab.model_bytes:  # never replace what the model learned
                        raise TrainingError(
                            f"{dest} differs from task {t.name!r}'s vocabulary "
                            f"{vocab.model_file}: this model was trained with another one"
                        )
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest + ".tmp", "wb") as f:
                f.write(vocab.model_bytes)
            os.replace(dest + ".tmp", dest)
