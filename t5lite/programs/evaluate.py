"""The `eval` program: a checkpoint's task metrics, and the evaluation train() runs."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import jax

import seqio_lite
from seqio_lite.evaluation import metric_kind
from t5lite.checkpoint import CheckpointManager
from t5lite.model.models import BaseModel
from t5lite.partitioning import Partitioner
from t5lite.programs import harness as harness_lib
from t5lite.programs import metrics_writer as mw
from t5lite.programs.configs import DataConfig, split_of
from t5lite.programs.harness import HarnessConfig
from t5lite.trainer import Trainer


def check_task_and_model(task: str, model: BaseModel, lengths: Mapping[str, int]) -> None:
    """The task exists, its features and lengths suit the model's feature converter, and its
    token ids fit the vocabulary (ids beyond it would silently give NaN or garbage)."""
    converter = model.feature_converter_name
    setting = (
        f"DecoderOnlyModel.feature_converter = {converter!r}"
        if converter != "enc_dec"
        else "an encoder-decoder model"
    )
    wants_inputs = converter in ("enc_dec", "prefix_lm")
    if wants_inputs and "inputs" not in lengths:
        raise ValueError(
            f"DataConfig.task_feature_lengths = {dict(lengths)}: {setting} needs a length "
            "for 'inputs'"
        )
    if not wants_inputs and "inputs" in lengths:
        raise ValueError(
            f"DataConfig.task_feature_lengths = {dict(lengths)} has 'inputs' but {setting} "
            "reads only 'targets': set DecoderOnlyModel.feature_converter = 'prefix_lm' to "
            "train on inputs and targets, or drop the 'inputs' length"
        )
    obj = seqio_lite.get_task_or_mixture(task)
    tasks = obj.tasks if isinstance(obj, seqio_lite.Mixture) else [obj]
    model_vocab = model.network_config.vocab_size
    for t in tasks:
        has_inputs = "inputs" in t.output_features
        if has_inputs != wants_inputs:
            hint = (
                "set DecoderOnlyModel.feature_converter = 'prefix_lm' to train on inputs "
                "and targets"
                if has_inputs
                else "it needs a task with 'inputs'"
            )
            raise ValueError(
                f"task {t.name!r} has features {sorted(t.output_features)} but {setting} "
                f"{'would drop its inputs' if has_inputs else 'reads inputs and targets'}: "
                f"{hint}"
            )
        for name, feature in t.output_features.items():
            size = feature.vocabulary.vocab_size
            if size > model_vocab:
                raise ValueError(
                    f"task {t.name!r} feature {name!r} has a vocabulary of {size} ids but the "
                    f"model's vocab_size is {model_vocab}"
                )


_CONVERTERS = {
    "enc_dec": seqio_lite.EncDecFeatureConverter,
    "lm": seqio_lite.LMFeatureConverter,
    "prefix_lm": seqio_lite.PrefixLMFeatureConverter,
}


def feature_converter(model: BaseModel, pack: bool) -> seqio_lite.FeatureConverter:
    """The converter whose features `model` reads; decoder inputs start with the model's own
    `decoder_start_token_id` (0 for T5; an imported Llama's BOS), as its decoding does."""
    converter = _CONVERTERS[model.feature_converter_name]
    return converter(pack=pack, bos_id=model.decoder_start_token_id)


def make_evaluator(
    model: BaseModel,
    task: str,
    lengths: dict[str, int],
    *,
    split: str,
    num_examples: int | None,
    batch_size: int,
) -> seqio_lite.Evaluator:
    """A seqio_lite evaluator whose batches have the model's features."""
    return seqio_lite.Evaluator(
        task,
        lengths,
        split=split,
        batch_size=batch_size,
        feature_converter=feature_converter(model, pack=False),
        num_examples=num_examples,
    )


def data_evaluator(model: BaseModel, data: DataConfig) -> seqio_lite.Evaluator:
    """`make_evaluator` for `data`'s task, lengths, examples and batch size, on `data.split`
    (default: 'validation')."""
    return make_evaluator(
        model,
        data.task,
        dict(data.task_feature_lengths),
        split=split_of(data, "validation"),
        num_examples=data.num_examples,
        batch_size=data.batch_size,
    )


def run_evaluation(
    evaluator: seqio_lite.Evaluator,
    trainer: Trainer,
    params: Any,
    *,
    decode_len: int,
    writer: mw.MetricsWriter,
    step: int,
    num_to_print: int = 3,
) -> dict[str, Any]:
    """The tasks' metrics: predict metrics on KV-cached decodes, score metrics on the targets'
    log-likelihoods; written to metrics.jsonl, TensorBoard and, one line per task, appended to
    `eval/<task>/<split>.jsonl` in the model directory (see `read_eval_results`). Prints a few
    predictions."""
    kinds = {metric_kind(m) for t in evaluator.tasks for m in t.metric_fns}
    predict_fn = trainer.predict_fn(params, decode_len) if "predictions" in kinds else None
    score_fn = trainer.score_fn(params) if "scores" in kinds else None
    results = evaluator.evaluate(predict_fn=predict_fn, score_fn=score_fn)
    out: dict[str, Any] = {}
    shown: list[str] = []
    for task_name, metrics in results.items():
        out.update({f"{task_name}/{k}": v for k, v in metrics.items()})
        task = next(t for t in evaluator.tasks if t.name == task_name)
        exs = evaluator.examples(task_name)[:num_to_print]
        wants_predictions = any(metric_kind(m) == "predictions" for m in task.metric_fns)
        if exs and predict_fn is not None and wants_predictions:
            batch, _ = evaluator.batches(task_name)[0]
            vocab = task.output_features["targets"].vocabulary
            for ex, row in zip(exs, predict_fn(batch)):
                src = ex.get("inputs_pretokenized", "")
                tgt = ex.get("targets_pretokenized", "")
                shown.append(f"  {src!s:>20} -> {vocab.decode(row)!s:<20} (target {tgt})")
    writer.write(step, out, prefix="eval")
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for task_name, metrics in results.items():
        record = {"step": step, "task": task_name, "split": evaluator.split, "metrics": metrics}
        writer.append_jsonl(_results_file(task_name, evaluator.split), {**record, "time": when})
    if shown:
        writer.info("predictions:\n" + "\n".join(shown))
    return out


def _results_file(task: str, split: str) -> str:
    return os.path.join("eval", task, f"{split}.jsonl")


def read_eval_results(
    model_dir: str | os.PathLike, task: str, split: str = "validation"
) -> list[dict[str, Any]]:
    """Every evaluation of `task` on `split` recorded in `model_dir`, oldest first.

    Like seqio's `JSONLogger` (`<task>-metrics.jsonl`), each evaluation appends one record
    `{"step", "task", "split", "metrics", "time"}` to `MODEL_DIR/eval/<task>/<split>.jsonl`: a
    mixture's tasks, other splits and a second `t5lite eval` of the same checkpoint each add
    their own record, and nothing is ever replaced (an evaluation of the same step again, e.g.
    with another batch size, is a second record of that step).
    """
    path = os.path.join(os.fspath(model_dir), _results_file(task, split))
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def restored_trainer(
    model: BaseModel,
    partitioner: Partitioner | None,
    data: DataConfig,
    model_dir: str,
    checkpoint_step: int | None,
) -> tuple[Trainer, Any, int]:
    """A trainer for `data.batch_size` rows, and the parameters and step of a committed
    checkpoint. Only the parameters are read, so the optimizer the checkpoint was trained with
    need not be configured to evaluate it."""
    trainer = Trainer(
        model,
        partitioner or Partitioner(),
        batch_size=data.batch_size,
        lengths=data.task_feature_lengths,
    )
    abstract = trainer.abstract_state()
    ckpt = CheckpointManager(model_dir)
    try:
        restored, _ = ckpt.restore(
            {"params": abstract.params, "step": abstract.step},
            step=checkpoint_step,
            with_extra=False,
        )
    finally:
        ckpt.close()
    return trainer, restored["params"], int(restored["step"])


def evaluate(
    *,
    model_dir: str,
    model: BaseModel,
    data: DataConfig | None = None,
    partitioner: Partitioner | None = None,
    checkpoint_step: int | None = None,
    max_decode_length: int | None = None,
    harness: HarnessConfig | None = None,
) -> dict[str, Any]:
    """Evaluates a checkpoint (latest by default) with the task's metrics; returns them.

    Args:
      model_dir, checkpoint_step: the checkpoint (the latest committed one by default).
      model, partitioner: what to run on which mesh.
      data: the examples (`split` defaults to 'validation'; `num_examples` the first N); None:
        only the `harness` tasks.
      max_decode_length: decode length for predict metrics (default: the targets length).
      harness: lm-evaluation-harness tasks to run as well (see `harness.py`; the [eval] extra).
    """
    if data is None and harness is None:
        raise ValueError(
            "evaluate needs evaluate.data (a task) or evaluate.harness (lm-eval tasks)"
        )
    prepared = harness_lib.prepare(harness) if harness is not None else None  # before the slow
    out: dict[str, Any] = {}
    if data is not None:
        out.update(
            _evaluate_task(model_dir, model, data, partitioner, checkpoint_step, max_decode_length)
        )
    if harness is not None:
        out.update(
            harness_lib.evaluate_checkpoint(
                model_dir=model_dir,
                model=model,
                partitioner=partitioner or Partitioner(),
                config=harness,
                checkpoint_step=checkpoint_step,
                prepared=prepared,
            )
        )
    return out


def _evaluate_task(
    model_dir: str,
    model: BaseModel,
    data: DataConfig,
    partitioner: Partitioner | None,
    checkpoint_step: int | None,
    max_decode_length: int | None,
) -> dict[str, Any]:
    check_task_and_model(data.task, model, data.task_feature_lengths)
    trainer, params, step = restored_trainer(model, partitioner, data, model_dir, checkpoint_step)
    evaluator = data_evaluator(model, data)
    writer = mw.MetricsWriter(model_dir, total_steps=step, enabled=jax.process_index() == 0)
    try:
        return run_evaluation(
            evaluator,
            trainer,
            params,
            writer=writer,
            step=step,
            decode_len=max_decode_length or data.task_feature_lengths["targets"],
        )
    finally:
        writer.close()
