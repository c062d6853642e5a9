"""The train / eval / infer programs that the CLI runs (gin binds their arguments).

Each is an ordinary function a notebook can call; `main.py` only parses flags and gin.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

import seqio_lite
from t5lite import metrics_writer as mw
from t5lite.checkpoints import CheckpointManager, restore_checkpoint
from t5lite.distributed import ProgressWatchdog
from t5lite.insight.sharding import format_bytes
from t5lite.models import BaseModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer, TrainState, summarize


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, model too large); the message says why."""


def _converter_name(model: BaseModel) -> str:
    return "enc_dec" if isinstance(model, EncoderDecoderModel) else "lm"


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


def _check_vocab(task: str, model: BaseModel) -> None:
    """Token ids beyond the model's vocabulary would silently give NaN or garbage."""
    obj = seqio_lite.get_task_or_mixture(task)
    tasks = obj.tasks if isinstance(obj, seqio_lite.Mixture) else [obj]
    model_vocab = model.network_config.vocab_size
    for t in tasks:
        for name, feature in t.output_features.items():
            size = feature.vocabulary.vocab_size
            if size > model_vocab:
                raise ValueError(
                    f"task {t.name!r} feature {name!r} has a vocabulary of {size} ids but the "
                    f"model's vocab_size is {model_vocab}"
                )


def train(
    *,
    model_dir: str,
    model: BaseModel,
    task: str,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    num_steps: int,
    partitioner: Partitioner | None = None,
    num_microbatches: int = 1,
    seed: int = 0,
    pack: bool = True,
    use_cached: bool = False,
    checkpoint_period: int = 1000,
    keep_checkpoints: int | None = 3,
    keep_period: int | None = None,
    eval_period: int = 0,
    eval_task: str | None = None,
    eval_split: str = "validation",
    num_eval_examples: int | None = 256,
    eval_batch_size: int | None = None,
    max_decode_length: int | None = None,
    num_predictions_to_print: int = 3,
    log_period: int = 10,
    stop_after_steps: int | None = None,
    step_timeout_s: float | None = 600.0,
    init_checkpoint: str | None = None,
    log_grad_norm: bool | None = None,
) -> dict[str, Any]:
    """Trains `model` on `task`, resuming from the latest checkpoint in `model_dir`.

    Args:
      model_dir: checkpoints, `config.gin`, `metrics.jsonl` and TensorBoard events go here.
      model, partitioner: what to train and on which mesh with which rules.
      task: a seqio_lite task or mixture name; task_feature_lengths its lengths.
      batch_size: global examples per step; num_microbatches splits it for accumulation.
      num_steps: total steps (a resumed run continues up to it).
      seed: initialisation, data order and dropout (`fold_in(seed, step)`).
      pack, use_cached: data pipeline options.
      checkpoint_period, keep_checkpoints, keep_period: checkpoint policy (a checkpoint is also
        written at the final step and on SIGTERM).
      eval_period: evaluate every this many steps (0: only at the end, if an eval task is set).
      eval_task, eval_split, num_eval_examples, eval_batch_size: the evaluation set.
      max_decode_length: decoding length for predict metrics (default: the targets length).
      num_predictions_to_print: predictions shown after each evaluation.
      log_period: steps between printed log lines.
      stop_after_steps: stop (with a checkpoint) after this many steps of this invocation,
        as a preemption would; for tests and time-boxed jobs.
      init_checkpoint: a checkpoint directory whose parameters start a fresh run (fine-tuning,
        e.g. one written by `t5lite convert`); ignored when `model_dir` has a checkpoint.
      step_timeout_s: exit with an error when no step completes for this long (after the
        first, compiled step): a multi-process run whose peer died stops instead of hanging.
      log_grad_norm: log the global gradient norm (default: when the optimizer clips, where
        it costs nothing; see `Trainer`).

    Returns:
      The last train metrics and the last eval metrics.
    """
    partitioner = partitioner or Partitioner()
    _check_vocab(task, model)
    trainer = Trainer(
        model, partitioner, batch_size=batch_size, lengths=task_feature_lengths,
        num_microbatches=num_microbatches, seed=seed, log_grad_norm=log_grad_norm,
    )  # fmt: skip
    is_chief = jax.process_index() == 0
    writer = mw.MetricsWriter(model_dir, total_steps=num_steps, enabled=is_chief,
                              log_period=log_period)  # fmt: skip
    layout = partitioner.get_data_layout(batch_size)
    data = seqio_lite.get_dataset(
        task, task_feature_lengths, "train", layout.per_process_batch_size,
        shard_id=layout.shard_id, num_shards=layout.num_shards, seed=seed,
        feature_converter=_converter_name(model), pack=pack, use_cached=use_cached,
    )  # fmt: skip
    ckpt = CheckpointManager(
        model_dir, save_period=checkpoint_period, keep=keep_checkpoints, keep_period=keep_period
    )
    ckpt.install_preemption_handler()
    _check_fits(trainer, trainer.abstract_state())

    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(trainer.abstract_state())
        data.set_state(extra["data"])
        writer.info(f"resumed from {ckpt.step_dir(int(state.step))}")
    else:
        state = trainer.init_state()
        if init_checkpoint:
            # Parameters from the checkpoint (cast and resharded); optimizer state stays fresh.
            state, _ = restore_checkpoint(init_checkpoint, state, extra=False, params_only=True)
            writer.info(f"initialised parameters from {init_checkpoint}")
    _write_operative_config(model_dir, is_chief)

    evaluator = None
    if eval_task or eval_period:
        evaluator = _make_evaluator(
            eval_task or task, task_feature_lengths, eval_split, num_eval_examples,
            eval_batch_size or batch_size, model,
        )  # fmt: skip
    decode_len = max_decode_length or task_feature_lengths["targets"]
    flops = mw.transformer_train_flops(
        model.network_config, task_feature_lengths.get("inputs", 0), task_feature_lengths["targets"]
    )
    peak = mw.peak_flops(jax.devices()[0].device_kind)

    net_cfg = {"type": type(model.network_config).__name__,
               **dataclasses.asdict(model.network_config)}  # fmt: skip
    start = int(state.step)
    last: dict[str, Any] = {}
    eval_metrics: dict[str, Any] = {}
    t_prev = time.time()
    watchdog = None
    for step in range(start + 1, num_steps + 1):
        batch = trainer.global_batch(next(data))
        state, metrics = trainer.train_step(state, batch)
        m = summarize(jax.device_get(metrics))
        if watchdog is None:  # armed after the first step: compilation time is unbounded
            watchdog = ProgressWatchdog(step_timeout_s)
        watchdog.ping()
        if not math.isfinite(m["loss"]):
            latest = ckpt.latest_step()
            watchdog.close()
            ckpt.close()
            raise TrainingError(
                f"loss is {m['loss']} at step {step}; stopping. The last good checkpoint is "
                + (str(ckpt.step_dir(latest)) if latest is not None else "none (no save yet)")
            )
        now = time.time()
        dt, t_prev = now - t_prev, now
        m["step_time_s"] = dt
        m["seqs_per_s"] = batch_size / dt
        m["tokens_per_s"] = batch_size * sum(task_feature_lengths.values()) / dt
        m["mfu"] = (flops * batch_size / dt / (peak * jax.device_count())) if peak else "n/a (CPU)"
        writer.write(step, m)
        last = m
        is_final = step == num_steps
        stop_now = stop_after_steps is not None and step - start >= stop_after_steps
        extra = {"data": data.get_state(), "step": step, "seed": seed, "network_config": net_cfg}
        preempted = ckpt.maybe_save(
            step, state, extra=extra, logical_axes=trainer.state_axes,
            is_final=is_final or stop_now,
        )  # fmt: skip
        if evaluator and ((eval_period and step % eval_period == 0) or is_final):
            eval_metrics = _evaluate(
                evaluator, trainer, state, decode_len, writer, step, num_predictions_to_print
            )
        if preempted or stop_now:
            writer.info(f"stopped at step {step}; checkpoint committed")
            break
    if watchdog is not None:
        watchdog.close()
    ckpt.close()
    writer.close()
    return {"train": last, "eval": eval_metrics}


def _make_evaluator(task, lengths, split, num_examples, batch_size, model):
    return seqio_lite.Evaluator(
        task, lengths, split=split, batch_size=batch_size,
        feature_converter=_converter_name(model), num_examples=num_examples,
    )  # fmt: skip


def _evaluate(evaluator, trainer: Trainer, state: TrainState, decode_len: int, writer, step: int,
              num_to_print: int) -> dict[str, Any]:  # fmt: skip
    """The tasks' predict metrics on KV-cached decodes; prints a few predictions."""
    predict_fn = _predict_fn(trainer, state.params, decode_len)
    shown: list[str] = []
    results = evaluator.evaluate(predict_fn=predict_fn)
    out: dict[str, Any] = {}
    for task_name, metrics in results.items():
        out.update({f"{task_name}/{k}": v for k, v in metrics.items()})
        exs = evaluator.examples(task_name)[:num_to_print]
        if exs:
            batch, _ = evaluator.batches(task_name)[0]
            ids = predict_fn(batch)
            task = next(t for t in evaluator.tasks if t.name == task_name)
            vocab = task.output_features["targets"].vocabulary
            for ex, row in zip(exs, ids):
                src = ex.get("inputs_pretokenized", "")
                tgt = ex.get("targets_pretokenized", "")
                shown.append(f"  {src!s:>20} -> {vocab.decode(row)!s:<20} (target {tgt})")
    writer.write(step, out, prefix="eval")
    if shown:
        writer.info("predictions:\n" + "\n".join(shown))
    return out


def _predict_fn(trainer: Trainer, params: Any, decode_len: int):
    """A numpy-in, token-lists-out predictor on the trainer's mesh (compiled once).

    Decodes with the model's KV-cached decoder as its `decoding_method` says. The returned
    `predict_fn(batch, rng_index=0)` samples with `fold_in(PRNGKey(seed), rng_index)`, so a
    batch decodes the same way in every run and on every process; outputs are replicated.
    """
    key = ("predict", decode_len)
    if key not in trainer.cache:
        model = trainer.model
        trainer.cache[key] = trainer.partitioner.partition(
            lambda p, b, rng: model.predict_batch(p, b, rng, max_decode_length=decode_len),
            in_axis_resources=(trainer.state_shardings.params, trainer.batch_shardings, None),
            out_axis_resources=None,
        )
    predict = trainer.cache[key]

    def predict_fn(batch: Mapping[str, np.ndarray], rng_index: int = 0) -> list[list[int]]:
        rows = len(next(iter(batch.values())))
        rng = jax.random.fold_in(jax.random.PRNGKey(trainer.seed), rng_index)
        global_batch = trainer.global_batch_from_full(_fit_batch(batch, trainer.batch_size))
        ids = jax.device_get(predict(params, global_batch, rng))
        return [_until_eos(r) for r in np.asarray(ids)[:rows]]

    return predict_fn


def _score_fn(trainer: Trainer, params: Any):
    """A numpy-in, log-likelihoods-out scorer on the trainer's mesh (compiled once)."""
    if "score" not in trainer.cache:
        trainer.cache["score"] = trainer.partitioner.partition(
            trainer.model.score_batch,
            in_axis_resources=(trainer.state_shardings.params, trainer.batch_shardings),
            out_axis_resources=None,
        )
    score = trainer.cache["score"]

    def score_fn(batch: Mapping[str, np.ndarray]) -> list[float]:
        rows = len(next(iter(batch.values())))
        out = jax.device_get(
            score(params, trainer.global_batch_from_full(_fit_batch(batch, trainer.batch_size)))
        )
        return [float(x) for x in np.asarray(out)[:rows]]

    return score_fn


def _fit_batch(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pads (or trims) an eval batch to the compiled batch size."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if v.shape[0] < rows:
            v = np.concatenate([v, np.zeros((rows - v.shape[0], *v.shape[1:]), v.dtype)])
        out[k] = v[:rows]
    return out


def _until_eos(ids: np.ndarray) -> list[int]:
    out = []
    for t in ids.tolist():
        if t == 0:
            break
        out.append(t)
        if t == 1:
            break
    return out


def _write_operative_config(model_dir: str, is_chief: bool) -> None:
    if not is_chief:
        return
    import gin

    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.gin"), "w") as f:
        f.write(gin.config_str())


def _restored_trainer(model, partitioner, lengths, batch_size, model_dir, checkpoint_step):
    """A trainer for `batch_size` rows and the parameters of a committed checkpoint."""
    trainer = Trainer(model, partitioner or Partitioner(), batch_size=batch_size, lengths=lengths)
    ckpt = CheckpointManager(model_dir)
    state, _ = ckpt.restore(trainer.abstract_state(), step=checkpoint_step, extra=False)
    ckpt.close()
    return trainer, state


def evaluate(
    *,
    model_dir: str,
    model: BaseModel,
    task: str,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    partitioner: Partitioner | None = None,
    split: str = "validation",
    num_examples: int | None = None,
    checkpoint_step: int | None = None,
    max_decode_length: int | None = None,
) -> dict[str, Any]:
    """Evaluates a checkpoint (latest by default) with the task's metrics; returns them."""
    trainer, state = _restored_trainer(
        model, partitioner, task_feature_lengths, batch_size, model_dir, checkpoint_step
    )
    evaluator = _make_evaluator(task, task_feature_lengths, split, num_examples, batch_size, model)
    writer = mw.MetricsWriter(model_dir, total_steps=int(state.step),
                              enabled=jax.process_index() == 0)  # fmt: skip
    out = _evaluate(evaluator, trainer, state,
                    max_decode_length or task_feature_lengths["targets"], writer,
                    int(state.step), 3)  # fmt: skip
    writer.close()
    return out


def infer(
    *,
    model_dir: str,
    model: BaseModel,
    task: str,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    output_file: str,
    mode: str = "predict",
    partitioner: Partitioner | None = None,
    split: str = "validation",
    num_examples: int | None = None,
    checkpoint_step: int | None = None,
    max_decode_length: int | None = None,
) -> str:
    """Writes one JSONL record per example: task, inputs, targets and the prediction (or score).

    Resumable: records are appended one batch at a time (flushed and fsynced), so a run that
    stops part way leaves a valid prefix; the same command then skips the examples already
    written and appends the rest. A complete output is never overwritten, and an output that
    does not match this task split (or ends mid-batch) is refused or cut back to its last
    whole batch, never rewritten otherwise. Every process runs the same global batches (its
    rows via `global_batch_from_full`); only process 0 reads and writes the file and tells the
    others where to resume.

    Args:
      model_dir, checkpoint_step: the checkpoint (latest by default).
      model, partitioner: what to run on which mesh; decoding as the model's
        `decoding_method` etc. say.
      task, task_feature_lengths, split, num_examples: the examples, in order.
      batch_size: global examples per batch.
      output_file: the JSONL file.
      mode: "predict" (decoded text) or "score" (log-likelihood of the targets).
      max_decode_length: decode length (default: the targets length).

    Returns:
      `output_file`.
    """
    if mode not in ("predict", "score"):
        raise ValueError(f"infer mode must be 'predict' or 'score', got {mode!r}")
    is_chief = jax.process_index() == 0
    evaluator = _make_evaluator(task, task_feature_lengths, split, num_examples, batch_size, model)
    expected = [
        (t.name, _text(ex, "inputs")) for t in evaluator.tasks for ex in evaluator.examples(t.name)
    ]
    # Batch boundaries (global record counts) at which a resumed run can start.
    boundaries, offset = {0}, 0
    for t in evaluator.tasks:
        for _, n in evaluator.batches(t.name):
            offset += n
            boundaries.add(offset)
    done = _resume_point(output_file, expected, boundaries) if is_chief else 0
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        done = int(multihost_utils.broadcast_one_to_all(np.int32(done)))
    if done < 0:
        raise FileExistsError(
            f"infer: {output_file} is complete ({len(expected)} records); refusing to overwrite it"
        )
    trainer, state = _restored_trainer(
        model, partitioner, task_feature_lengths, batch_size, model_dir, checkpoint_step
    )
    decode_len = max_decode_length or task_feature_lengths["targets"]
    offset = 0
    batch_index = 0
    for t in evaluator.tasks:
        vocab = t.output_features["targets"].vocabulary
        exs = evaluator.examples(t.name)
        for i, (batch, n) in enumerate(evaluator.batches(t.name)):
            batch_index += 1
            lo, offset = offset, offset + n
            if offset <= done:
                continue  # written by an earlier run
            if mode == "predict":
                ids = _predict_fn(trainer, state.params, decode_len)(batch, batch_index)
                outputs: list[Any] = [vocab.decode(r) for r in ids[:n]]
            else:
                outputs = _score_fn(trainer, state.params)(batch)[:n]
            chunk = exs[i * batch_size : i * batch_size + n]
            records = [
                {
                    "task": t.name,
                    "inputs": _text(ex, "inputs"),
                    "targets": _text(ex, "targets"),
                    "prediction" if mode == "predict" else "score": o,
                }
                for ex, o in zip(chunk, outputs)
            ]
            assert len(records) == offset - lo
            if is_chief:
                _append_records(output_file, records)
    return output_file


def _resume_point(output_file: str, expected: list[tuple[str, Any]], boundaries: set[int]) -> int:
    """Records of `output_file` to keep (a batch boundary), or -1 when it is complete.

    Raises ValueError (naming the file and line) when the file is not a prefix of this run's
    output. A torn last line or a partial last batch is cut off, atomically.
    """
    if not os.path.exists(output_file):
        return 0
    with open(output_file, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    records: list[dict] = []
    for lineno, line in enumerate(lines[:-1], 1):  # the text after the last newline is torn
        try:
            rec = json.loads(line)
        except ValueError:
            raise ValueError(f"infer: {output_file}:{lineno} is not a JSON record") from None
        if lineno > len(expected) or (rec.get("task"), rec.get("inputs")) != expected[lineno - 1]:
            raise ValueError(
                f"infer: {output_file}:{lineno} does not match example {lineno} of this task "
                "split; use another output_file"
            )
        records.append(rec)
    if len(records) == len(expected):
        return -1
    keep = max(b for b in boundaries if b <= len(records))
    if keep != len(records) or lines[-1]:
        tmp = output_file + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines[:keep]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output_file)
    return keep


def _append_records(output_file: str, records: list[dict]) -> None:
    """Appends whole lines in one write, then fsyncs: a crash tears at most the last line."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    fd = os.open(output_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _text(ex: Mapping[str, Any], key: str) -> Any:
    v = ex.get(f"{key}_pretokenized")
    if v is None:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)
