"""Metrics and the Evaluator.

Metric functions follow seqio: `fn(targets, predictions) -> {name: value}` for metrics on
generated output, `fn(targets, scores) -> {name: value}` for metrics on model scores (e.g. log
likelihoods); a score metric that also takes `num_tokens` gets each example's target length. The
`Evaluator` tells them apart by their parameter names, runs the model's
`predict_fn` / `score_fn` over a task's eval split, postprocesses, and returns the metrics.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from seqio_lite import dataset_providers as dp
from seqio_lite import feature_converters as fc
from seqio_lite import loader

MetricFn = Callable[..., Mapping[str, float]]
# batch -> token ids per row (predict) or one float per row (score)
PredictFn = Callable[[Mapping[str, np.ndarray]], Sequence[Sequence[int]]]
ScoreFn = Callable[[Mapping[str, np.ndarray]], Sequence[float]]

# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def accuracy(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
    """Percentage of predictions equal to their target."""
    _check_lengths(targets, predictions)
    hits = sum(_equal(t, p) for t, p in zip(targets, predictions))
    return {"accuracy": 100.0 * hits / max(len(targets), 1)}


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Percentage of predictions that match their target exactly (after stripping spaces)."""
    _check_lengths(targets, predictions)
    hits = sum(str(t).strip() == str(p).strip() for t, p in zip(targets, predictions))
    return {"exact_match": 100.0 * hits / max(len(targets), 1)}


def sequence_accuracy(
    targets: Sequence[Sequence[Any]], predictions: Sequence[Sequence[Any]]
) -> dict[str, float]:
    """Percentage of sequences whose every element matches (seqio's `sequence_accuracy`)."""
    _check_lengths(targets, predictions)
    hits = sum(
        len(t) == len(p) and all(_equal(a, b) for a, b in zip(t, p))
        for t, p in zip(targets, predictions)
    )
    return {"sequence_accuracy": 100.0 * hits / max(len(targets), 1)}


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU with sacrebleu's defaults (13a tokenisation, exponential smoothing)."""
    import sacrebleu

    _check_lengths(targets, predictions)
    return {"bleu": float(sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score)}


def rouge(
    targets: Sequence[str],
    predictions: Sequence[str],
    score_keys: Sequence[str] = ("rouge1", "rouge2", "rougeLsum"),
) -> dict[str, float]:
    """Mean ROUGE F-measures (x100) with rouge-score, stemming on, as T5 reports them."""
    from rouge_score import rouge_scorer

    _check_lengths(targets, predictions)
    scorer = rouge_scorer.RougeScorer(list(score_keys), use_stemmer=True)
    totals = dict.fromkeys(score_keys, 0.0)
    for t, p in zip(targets, predictions):
        # rougeLsum splits summaries on newlines; T5 puts each sentence on its own line.
        scores = scorer.score(t.replace(". ", ".\n"), p.replace(". ", ".\n"))
        for k in score_keys:
            totals[k] += scores[k].fmeasure
    n = max(len(targets), 1)
    return {k: 100.0 * v / n for k, v in totals.items()}


def log_likelihood(targets: Sequence[Any], scores: Sequence[float]) -> dict[str, float]:
    """Mean log-likelihood of the targets per example (nats; `score_fn`'s sums)."""
    _check_lengths(targets, scores)
    return {"log_likelihood": float(np.mean(scores)) if len(scores) else 0.0}


def perplexity(
    targets: Sequence[Any], scores: Sequence[float], num_tokens: Sequence[int]
) -> dict[str, float]:
    """Per-token perplexity of the targets: exp(-sum of log-likelihoods / target tokens).

    Target tokens include EOS, as in the training loss. The `Evaluator` passes `num_tokens`.
    """
    _check_lengths(targets, scores)
    total = max(int(np.sum(num_tokens)), 1)
    return {"perplexity": float(np.exp(-float(np.sum(scores)) / total))}


def rank_classification(
    targets: Sequence[tuple[int, bool]],
    scores: Sequence[float],
    num_tokens: Sequence[int] | None = None,
    normalize_by_target_length: bool = False,
) -> dict[str, float]:
    """Multiple choice by scoring: each example's best-scoring candidate is its answer.

    As seqio's `rank_classification`: the eval split holds one row per (example, candidate);
    the task's postprocessing turns each row's target into `(example index, is_correct)`.
    Returns the percentage of examples whose highest-scoring candidate is a correct one
    (ties go to the first candidate). `normalize_by_target_length` ranks by log-likelihood
    per target token instead of the sum.
    """
    _check_lengths(targets, scores)
    best: dict[int, tuple[float, bool]] = {}
    for i, ((example, correct), score) in enumerate(zip(targets, scores)):
        if normalize_by_target_length and num_tokens is not None:
            score = score / max(int(num_tokens[i]), 1)
        if example not in best or score > best[example][0]:
            best[example] = (float(score), bool(correct))
    hits = sum(correct for _, correct in best.values())
    return {"accuracy": 100.0 * hits / max(len(best), 1)}


METRICS: dict[str, MetricFn] = {
    "accuracy": accuracy,
    "bleu": bleu,
    "exact_match": exact_match,
    "log_likelihood": log_likelihood,
    "perplexity": perplexity,
    "rank_classification": rank_classification,
    "rouge": rouge,
    "sequence_accuracy": sequence_accuracy,
}
"""The metrics a configured task can name (`JsonlTask.metrics = ['exact_match', 'bleu']`)."""


def _equal(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _check_lengths(targets: Sequence[Any], predictions: Sequence[Any]) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")


def metric_kind(fn: MetricFn) -> str:
    """Returns "predictions" or "scores" from the metric's parameter names, as seqio does."""
    params = inspect.signature(fn).parameters
    if "predictions" in params:
        return "predictions"
    if "scores" in params:
        return "scores"
    raise ValueError(
        f"Metric {getattr(fn, '__name__', fn)!r} must take (targets, predictions) or "
        f"(targets, scores); it takes {list(params)}"
    )


# --------------------------------------------------------------------------------------------
# Evaluator
# --------------------------------------------------------------------------------------------


def _postprocess(task: dp.Task, value: Any, example: Mapping[str, Any], is_target: bool) -> Any:
    fn = task.postprocess_fn
    if fn is None:
        return value
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "example" in params:
        kwargs["example"] = example
    if "is_target" in params:
        kwargs["is_target"] = is_target
    return fn(value, **kwargs)


class Evaluator:
    """Evaluates model functions on the eval split of a task or of a mixture's tasks.

    Batches are padded (not packed), in source order, one epoch; a final partial batch is padded
    with empty rows whose outputs are ignored.

    Args:
      task_or_mixture: name or object; a mixture evaluates each member task that has metrics.
      sequence_length: task feature lengths, as for training.
      split: the eval split.
      batch_size: rows per batch passed to `predict_fn` / `score_fn`.
      feature_converter: as in `loader.get_dataset` (packing is always off here).
      num_examples: evaluate only the first `num_examples` of each task (None = all).
    """

    def __init__(
        self,
        task_or_mixture: str | dp.Task | dp.Mixture,
        sequence_length: Mapping[str, int],
        split: str = "validation",
        batch_size: int = 32,
        feature_converter: fc.FeatureConverter | type | str | None = None,
        num_examples: int | None = None,
    ):
        obj = dp.get_task_or_mixture(task_or_mixture)
        tasks = obj.tasks if isinstance(obj, dp.Mixture) else [obj]
        self.tasks = [t for t in tasks if t.metric_fns]
        if not self.tasks:
            raise ValueError(f"{obj!r} has no task with metric_fns to evaluate")
        self.sequence_length = dict(sequence_length)
        self.split = split
        self.batch_size = batch_size
        self.converter = loader._resolve_converter(feature_converter, self.tasks, pack=False)
        self.group_lengths = self.converter.group_lengths(self.sequence_length)
        self._examples: dict[str, list[dict]] = {}
        for task in self.tasks:
            exs = []
            for ex in loader.preprocessed_examples(task, split, self.sequence_length):
                exs.append(ex)
                if num_examples is not None and len(exs) >= num_examples:
                    break
            self._examples[task.name] = exs

    def examples(self, task_name: str) -> list[dict]:
        """The preprocessed eval examples of one task, in order."""
        return self._examples[task_name]

    def batches(self, task_name: str) -> list[tuple[dict[str, np.ndarray], int]]:
        """`(batch, number of real rows)` pairs covering the task's eval examples in order."""
        exs = self._examples[task_name]
        out = []
        for start in range(0, len(exs), self.batch_size):
            chunk = exs[start : start + self.batch_size]
            rows = [[self.converter.convert_example(e, self.sequence_length)] for e in chunk]
            out.append(
                (self.converter.make_batch(rows, self.batch_size, self.group_lengths), len(chunk))
            )
        return out

    def evaluate(
        self,
        predict_fn: PredictFn | None = None,
        score_fn: ScoreFn | None = None,
    ) -> dict[str, dict[str, float]]:
        """Runs the model functions and the metrics; returns `{task: {metric: value}}`.

        `predict_fn(batch)` returns generated token ids per row; they are decoded with the
        `targets` vocabulary and postprocessed. `score_fn(batch)` returns one score per row.
        Metrics whose kind has no model function are skipped (with a log line).
        """
        results: dict[str, dict[str, float]] = {}
        for task in self.tasks:
            exs = self._examples[task.name]
            vocab = task.output_features["targets"].vocabulary
            targets = [_postprocess(task, _target_text(ex, vocab), ex, True) for ex in exs]
            predictions: list[Any] | None = None
            scores: list[float] | None = None
            kinds = {metric_kind(m) for m in task.metric_fns}
            if "predictions" in kinds and predict_fn is not None:
                predictions = []
                for batch, n in self.batches(task.name):
                    ids = list(predict_fn(batch))[:n]
                    for row, ex in zip(ids, exs[len(predictions) :]):
                        predictions.append(_postprocess(task, vocab.decode(row), ex, False))
            if "scores" in kinds and score_fn is not None:
                scores = []
                for batch, n in self.batches(task.name):
                    scores.extend(float(s) for s in list(score_fn(batch))[:n])
            metrics: dict[str, float] = {}
            for m in task.metric_fns:
                values = predictions if metric_kind(m) == "predictions" else scores
                name = getattr(m, "__name__", repr(m))
                if values is None:
                    logging.info("%s: skipping %s (no model function)", task.name, name)
                    continue
                extra = {}
                if "num_tokens" in inspect.signature(m).parameters:
                    extra["num_tokens"] = [int(np.size(ex["targets"])) for ex in exs]
                metrics.update(m(targets, values, **extra))
            for k, v in metrics.items():
                logging.info("eval %s/%s = %.4f", task.name, k, v)
            results[task.name] = metrics
        return results


def _target_text(example: Mapping[str, Any], vocab: Any) -> Any:
    """The target as text: the pretokenized copy when present, else the decoded ids."""
    if "targets_pretokenized" in example:
        return example["targets_pretokenized"]
    return vocab.decode(example["targets"])
