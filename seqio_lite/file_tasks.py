"""Tasks defined by configuration alone: a user's files, fields, objective, vocabulary, metrics.

`jsonl_task`, `text_lines_task`, `parquet_task` and `hf_dataset_task` build a `Task` over local
files, register it and return its name; `mixture` does the same for a `Mixture` with rates. The
CLI registers them in gin as `JsonlTask`, `TextLinesTask`, `ParquetTask`, `HFDatasetTask` and
`Mixture`, so a gin file alone defines the data of a run:

    TASK = @qa/JsonlTask()
    qa/JsonlTask.name = 'qa'
    qa/JsonlTask.files = {'train': 'data/train-*.jsonl', 'validation': 'data/valid.jsonl'}
    qa/JsonlTask.inputs_field = 'question'
    qa/JsonlTask.targets_field = 'answer'
    qa/JsonlTask.metrics = ['exact_match', 'bleu']

The objective turns the fields into features:

| objective | fields | features |
| --- | --- | --- |
| `inputs_targets` | `inputs_field`, `targets_field` | inputs, targets |
| `lm` | `text_field` (or `targets_field`) | targets: a random window per epoch |
| `prefix_lm` | `text_field` | inputs, targets: a random window split at a random point |
| `span_corruption` | `text_field` | inputs, targets: T5's span corruption (sentinel ids) |
| `rank_classification` | `inputs_field`, `choices_field`, `label_field` | inputs, targets |

The default objective is `rank_classification` when choices and label fields are given,
`inputs_targets` when inputs and targets fields are, else `lm`.
`rank_classification` is seqio's multiple choice: in the 'train' split each example becomes
(inputs, its correct choice); in every other split it becomes one row per choice, which the
`rank_classification` metric scores and ranks. Every task tokenizes before its cache
placeholder, so `t5lite cache` can tokenize it once.

Bad data is refused when the task is defined, before anything slow: a pattern that matches no
file, a malformed line, and a record without a named field (JSONL: file and line; Parquet and
`datasets`: file and column) each get one line naming them.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from seqio_lite import dataset_providers as dp
from seqio_lite import evaluation, sources
from seqio_lite import preprocessors as prep
from seqio_lite import vocabularies as vocabs

OBJECTIVES = ("inputs_targets", "lm", "prefix_lm", "span_corruption", "rank_classification")
_DEFAULT_METRICS = {
    "inputs_targets": ("exact_match",),
    "lm": ("perplexity",),
    "prefix_lm": ("perplexity",),
    "span_corruption": ("perplexity",),
    "rank_classification": ("rank_classification",),
}
_SPAN_CORRUPTION_EXTRA_IDS = 100  # T5's sentinel count
_defined: dict[str, tuple] = {}  # task / mixture name -> the settings that defined it


@dataclasses.dataclass(frozen=True)
class TrainedSentencePiece:
    """A SentencePiece vocabulary trained on the task's 'train' split when the task is defined.

    The model is trained once with T5's special ids (`vocabularies.train_sentencepiece`,
    deterministic) on the text of the task's fields and reused while the data and settings stay
    the same; `t5lite train` copies it into `<model_dir>/vocabulary/`, beside the model.

    Attributes:
      vocab_size: pieces, special ids included (`extra_ids` come on top).
      model_file: where to write the `.model` file (default: a file named after the task and a
        hash of its data and these settings, under `$SEQIO_LITE_HOME` or `~/.cache/seqio_lite`).
      model_type: "unigram" (T5's) or "bpe".
      extra_ids: sentinel ids on top of the pieces (span corruption needs 100; added then).
      character_coverage: fraction of characters the pieces cover.
      max_examples: train on at most the first N examples.
    """

    vocab_size: int = 1000
    model_file: str | None = None
    model_type: str = "unigram"
    extra_ids: int = 0
    character_coverage: float = 1.0
    max_examples: int = 100_000


def jsonl_task(
    name: str,
    files: Mapping[str, str | Sequence[str]],
    *,
    inputs_field: str | None = None,
    targets_field: str | None = None,
    text_field: str | None = None,
    choices_field: str | None = None,
    label_field: str | None = None,
    objective: str | None = None,
    vocabulary: vocabs.Vocabulary | TrainedSentencePiece | None = None,
    metrics: Sequence[str | Callable[..., Mapping[str, float]]] | None = None,
    skip_malformed: bool = False,
) -> str:
    """A task over JSON Lines files (`{split: glob or list of globs}`); returns its name.

    See the module docstring for the fields and objectives. `skip_malformed` skips (and
    counts) malformed lines and lines without the fields instead of refusing the file.
    """
    spec = _Spec.make(name, locals())
    source = sources.JsonlSource(
        files,
        skip_malformed=skip_malformed,
        name=name,
        required_fields=spec.field_types(),
    )
    return _define(spec, source)


def text_lines_task(
    name: str,
    files: Mapping[str, str | Sequence[str]],
    *,
    objective: str = "lm",
    vocabulary: vocabs.Vocabulary | TrainedSentencePiece | None = None,
    metrics: Sequence[str | Callable[..., Mapping[str, float]]] | None = None,
) -> str:
    """A task over plain-text files, one document per non-empty line (the field `text`).

    Objectives: `lm` (default), `prefix_lm` or `span_corruption`.
    """
    spec = _Spec.make(name, {**locals(), "text_field": "text"})
    return _define(spec, sources.TextLineSource(files, name=name))


def parquet_task(
    name: str,
    files: Mapping[str, str | Sequence[str]],
    *,
    inputs_field: str | None = None,
    targets_field: str | None = None,
    text_field: str | None = None,
    choices_field: str | None = None,
    label_field: str | None = None,
    objective: str | None = None,
    vocabulary: vocabs.Vocabulary | TrainedSentencePiece | None = None,
    metrics: Sequence[str | Callable[..., Mapping[str, float]]] | None = None,
) -> str:
    """A task over Parquet files (`{split: glob or list of globs}`); columns are the fields."""
    spec = _Spec.make(name, locals())
    fields = list(spec.field_types())
    source = sources.ParquetSource(files, columns=fields, name=name, required_fields=fields)
    return _define(spec, source)


def hf_dataset_task(
    name: str,
    path: str,
    *,
    inputs_field: str | None = None,
    targets_field: str | None = None,
    text_field: str | None = None,
    choices_field: str | None = None,
    label_field: str | None = None,
    objective: str | None = None,
    vocabulary: vocabs.Vocabulary | TrainedSentencePiece | None = None,
    metrics: Sequence[str | Callable[..., Mapping[str, float]]] | None = None,
) -> str:
    """A task over a local Hugging Face dataset folder (`DatasetDict.save_to_disk`)."""
    spec = _Spec.make(name, locals())
    source = sources.HFDatasetSource(path, name=name, required_fields=list(spec.field_types()))
    return _define(spec, source)


def mixture(
    name: str,
    tasks: Sequence[str | tuple[str, float]],
    default_rate: float | None = None,
) -> str:
    """Registers a mixture of tasks (names, or `(name, rate)` pairs); returns its name.

    Rates are relative (they are normalised); examples are drawn in exact proportions, as in
    `seqio_lite.get_dataset`.
    """
    key = ("mixture", tuple(tuple(t) if isinstance(t, list) else t for t in tasks), default_rate)
    if _defined.get(name) == key:
        return name
    _check_new_name(name)
    entries = [tuple(t) if isinstance(t, list) else t for t in tasks]
    for entry in entries:
        task_name = entry[0] if isinstance(entry, tuple) else entry
        dp.get_task_or_mixture(task_name)  # unknown names fail here, with suggestions
    mix = dp.Mixture(name, entries, default_rate=default_rate)
    mix.tasks_and_rates()  # bad rates fail here, not at the first batch
    dp.MixtureRegistry.add(mix, overwrite=True)
    _defined[name] = key
    return name


# --------------------------------------------------------------------------------------------
# Settings -> Task
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The validated settings of a configured task."""

    name: str
    objective: str
    inputs_field: str | None
    targets_field: str | None
    text_field: str | None
    choices_field: str | None
    label_field: str | None
    vocabulary: vocabs.Vocabulary | TrainedSentencePiece
    metrics: tuple[Callable[..., Mapping[str, float]], ...]
    key: tuple

    @classmethod
    def make(cls, name: str, args: Mapping[str, Any]) -> _Spec:
        fields = {
            k: args.get(k)
            for k in ("inputs_field", "targets_field", "text_field", "choices_field", "label_field")
        }
        objective = args.get("objective") or _default_objective(fields)
        if objective not in OBJECTIVES:
            raise ValueError(
                f"task {name!r}: objective {objective!r}{_suggest(objective, OBJECTIVES)}"
            )
        _check_fields(name, objective, fields)
        vocabulary = args.get("vocabulary")
        if vocabulary is None:
            extra = _SPAN_CORRUPTION_EXTRA_IDS if objective == "span_corruption" else 0
            vocabulary = vocabs.ByteVocabulary(extra_ids=extra)
        trained = isinstance(vocabulary, TrainedSentencePiece)  # gets T5's 100 sentinels
        if objective == "span_corruption" and not trained and vocabulary.extra_ids == 0:
            raise ValueError(
                f"task {name!r}: span_corruption needs sentinel ids but the vocabulary has "
                "extra_ids = 0 (set it to 100, as T5 does)"
            )
        metric_names = args.get("metrics")
        metric_fns = tuple(
            _metric(name, m)
            for m in (_DEFAULT_METRICS[objective] if metric_names is None else metric_names)
        )
        vocab_key = (
            vocabulary.fingerprint if isinstance(vocabulary, vocabs.Vocabulary) else vocabulary
        )
        key = (
            tuple(sorted((k, repr(v)) for k, v in args.items() if k not in ("vocabulary", "name"))),
            objective,
            vocab_key,
            tuple(_metric_id(m) for m in metric_fns),
        )
        return cls(name, objective, **fields, vocabulary=vocabulary, metrics=metric_fns, key=key)

    def field_types(self) -> dict[str, type | tuple[type, ...]]:
        """Each named field and the JSON type it must have."""
        out: dict[str, type | tuple[type, ...]] = {}
        for f in (self.inputs_field, self.targets_field, self.text_field):
            if f:
                out[f] = str
        if self.choices_field:
            out[self.choices_field] = list
        if self.label_field:
            out[self.label_field] = int
        return out


def _default_objective(fields: Mapping[str, str | None]) -> str:
    if fields["choices_field"] and fields["label_field"]:
        return "rank_classification"
    if fields["inputs_field"] and fields["targets_field"]:
        return "inputs_targets"
    return "lm"


def _check_fields(name: str, objective: str, fields: Mapping[str, str | None]) -> None:
    needs = {
        "inputs_targets": ("inputs_field", "targets_field"),
        "lm": (),
        "prefix_lm": ("text_field",),
        "span_corruption": ("text_field",),
        "rank_classification": ("inputs_field", "choices_field", "label_field"),
    }[objective]
    missing = [f for f in needs if not fields[f]]
    if objective == "lm" and not (fields["text_field"] or fields["targets_field"]):
        missing = ["text_field"]
    if missing:
        raise ValueError(f"task {name!r}: objective {objective!r} needs {missing[0]}")
    used = set(needs) | ({"text_field", "targets_field"} if objective == "lm" else set())
    unused = [k for k, v in fields.items() if v and k not in used]
    if unused:
        raise ValueError(
            f"task {name!r}: {unused[0]} = {fields[unused[0]]!r} is not read by objective "
            f"{objective!r} (it reads {sorted(used)})"
        )


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f" is unknown{hint}; one of {list(choices)}"


def _metric(task: str, m: str | Callable[..., Mapping[str, float]]) -> Callable:
    if callable(m):
        evaluation.metric_kind(m)  # a clear error for a function of the wrong shape
        return m
    if m not in evaluation.METRICS:
        raise ValueError(f"task {task!r}: metric {m!r}{_suggest(m, sorted(evaluation.METRICS))}")
    return evaluation.METRICS[m]


def _metric_id(m: Callable) -> str:
    return f"{getattr(m, '__module__', '')}.{getattr(m, '__qualname__', repr(m))}"


def _check_new_name(name: str) -> None:
    # Redefining a configured name replaces it (a notebook re-reading its edited gin file);
    # taking the name of a task registered in Python would silently train on other data.
    if name in _defined:
        return
    if name in dp.TaskRegistry or name in dp.MixtureRegistry:
        raise ValueError(
            f"{name!r} is already registered (by seqio_lite or a module); choose another name"
        )


def _define(spec: _Spec, source: sources.DataSource) -> str:
    """Builds and registers the task (once per name and settings); returns its name."""
    if _defined.get(spec.name) == spec.key:
        return spec.name
    _check_new_name(spec.name)
    for split in source.splits:
        source.open(split)  # bad files fail now, naming file and line, before anything slow
    if spec.objective == "rank_classification":
        source = _CandidateSource(source, spec.choices_field, spec.label_field)  # type: ignore[arg-type]
        for split in source.splits:
            source.open(split)
    vocabulary = spec.vocabulary
    if isinstance(vocabulary, TrainedSentencePiece):
        vocabulary = _train_vocabulary(spec, source, vocabulary)
    text_features = ("targets",) if spec.objective == "lm" else ("inputs", "targets")
    task = dp.Task(
        spec.name,
        source,
        output_features={k: dp.Feature(vocabulary) for k in text_features},
        preprocessors=_preprocessors(spec),
        postprocess_fn=(
            rank_classification_targets
            if spec.objective == "rank_classification"
            else evaluation_text
        ),
        metric_fns=spec.metrics,
    )
    dp.TaskRegistry.add(task, overwrite=True)
    _defined[spec.name] = spec.key
    return spec.name


def _preprocessors(spec: _Spec) -> list:
    obj = spec.objective
    if obj == "inputs_targets":
        key_map = {"inputs": spec.inputs_field, "targets": spec.targets_field}
    elif obj == "rank_classification":
        key_map = {"inputs": spec.inputs_field, "targets": _CandidateSource.CHOICE}
    elif obj == "lm":
        key_map = {"targets": spec.text_field or spec.targets_field}
    else:
        key_map = {"targets": spec.text_field}
    keep = ("example_index", "is_correct") if obj == "rank_classification" else ()
    steps: list = [
        functools.partial(select_fields, key_map=key_map, keep=keep),
        prep.tokenize,
        dp.CacheDatasetPlaceholder(),
    ]
    if obj == "lm":
        steps.append(prep.random_crop)
    elif obj == "prefix_lm":
        steps.append(prep.prefix_lm)
    elif obj == "span_corruption":
        steps.append(prep.span_corruption)
    steps.append(prep.append_eos_after_trim)
    return steps


def select_fields(
    example: Mapping[str, Any], key_map: Mapping[str, str], keep: Sequence[str] = ()
) -> dict[str, Any]:
    """`{feature: example[field]}` for the task's fields, plus the `keep` keys as they are."""
    out = {feature: example[field] for feature, field in key_map.items()}
    out.update({k: example[k] for k in keep})
    return out


def evaluation_text(text: str) -> str:
    """Postprocessing of decoded text and targets: surrounding whitespace is not the answer."""
    return text.strip()


def rank_classification_targets(value: Any, example: Mapping[str, Any], is_target: bool) -> Any:
    """A candidate row's target for `rank_classification`: (example index, is it correct)."""
    if is_target:
        return int(example["example_index"]), bool(example["is_correct"])
    return value


class _CandidateSource(sources.DataSource):
    """Multiple-choice examples as candidate rows: one per choice (the correct one in 'train').

    Row fields: the example's own, plus `CHOICE` (the candidate text), `example_index` and
    `is_correct`.
    """

    CHOICE = "_candidate"

    def __init__(self, base: sources.DataSource, choices_field: str, label_field: str):
        super().__init__(base.name)
        self.base, self.choices_field, self.label_field = base, choices_field, label_field

    @property
    def splits(self) -> Sequence[str]:
        return self.base.splits

    def _open(self, split: str) -> sources.SplitData:
        return _CandidateSplit(self.base.open(split), self, split)


class _CandidateSplit(sources.SplitData):
    def __init__(self, base: sources.SplitData, owner: _CandidateSource, split: str):
        self.base, self.owner, self.train = base, owner, split == "train"
        counts = []
        for i in range(len(base)):
            ex = base[i]
            n, label = len(ex[owner.choices_field]), ex[owner.label_field]
            if not 0 <= label < n:
                raise ValueError(
                    f"task {owner.name!r} split {split!r} example {i}: {owner.label_field} = "
                    f"{label} but it has {n} choices ({owner.choices_field})"
                )
            counts.append(1 if self.train else n)
        self._starts = np.cumsum([0, *counts]).tolist()
        self._fingerprint = sources._hash("candidates", base.fingerprint, self.train)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = bisect.bisect_right(self._starts, index) - 1
        ex = self.base[i]
        label = int(ex[self.owner.label_field])
        j = label if self.train else index - self._starts[i]
        choice = ex[self.owner.choices_field][j]
        return {
            **ex,
            _CandidateSource.CHOICE: str(choice),
            "example_index": i,
            "is_correct": j == label,
        }

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


# --------------------------------------------------------------------------------------------
# A SentencePiece vocabulary trained on the task's data
# --------------------------------------------------------------------------------------------


def _train_vocabulary(
    spec: _Spec, source: sources.DataSource, settings: TrainedSentencePiece
) -> vocabs.SentencePieceVocabulary:
    if "train" not in source.splits:
        raise ValueError(f"task {spec.name!r}: TrainedSentencePiece needs a 'train' split")
    data = source.open("train")
    fields = [f for f in (spec.inputs_field, spec.targets_field, spec.text_field) if f]
    if spec.objective == "rank_classification":
        fields.append(_CandidateSource.CHOICE)
    digest = hashlib.sha256(repr((data.fingerprint, fields, settings)).encode()).hexdigest()[:12]
    model_file = settings.model_file or os.path.join(
        os.environ.get("SEQIO_LITE_HOME", os.path.expanduser("~/.cache/seqio_lite")),
        "sentencepiece",
        f"{spec.name}-{digest}.model",
    )
    extra_ids = settings.extra_ids or (
        _SPAN_CORRUPTION_EXTRA_IDS if spec.objective == "span_corruption" else 0
    )
    stamp = model_file + ".trained_on"
    if not (os.path.exists(model_file) and _read(stamp) == digest):
        os.makedirs(os.path.dirname(os.path.abspath(model_file)), exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            text = os.path.join(tmp, "text.txt")
            with open(text, "w", encoding="utf-8") as f:
                for i in range(min(len(data), settings.max_examples)):
                    ex = data[i]
                    for field in fields:
                        f.write(str(ex[field]).replace("\n", " ") + "\n")
            try:
                trained = vocabs.train_sentencepiece(
                    [text],
                    os.path.join(tmp, "spm"),
                    settings.vocab_size,
                    model_type=settings.model_type,
                    character_coverage=settings.character_coverage,
                )
            except RuntimeError as e:  # sentencepiece's own words, e.g. a vocabulary too large
                limit = re.search(r"value <= (\d+)", str(e))
                reason = (
                    f"is too large for this data (at most {limit.group(1)})"
                    if limit
                    else f"failed: {str(e).splitlines()[0]}"
                )
                raise ValueError(
                    f"task {spec.name!r}: TrainedSentencePiece.vocab_size = "
                    f"{settings.vocab_size} {reason}"
                ) from None
            # Copy beside, then rename: a reader never sees half a model.
            tmp_copy = f"{model_file}.tmp{os.getpid()}"  # processes may train it at once
            shutil.copyfile(trained, tmp_copy)
            os.replace(tmp_copy, model_file)
        with open(stamp, "w") as f:
            f.write(digest)
    return vocabs.SentencePieceVocabulary(model_file, extra_ids=extra_ids)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
