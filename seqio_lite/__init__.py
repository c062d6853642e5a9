"""seqio_lite: seqio-style tasks and deterministic data pipelines without TensorFlow.

import seqio_lite
it = seqio_lite.get_dataset("synthetic_reverse", {"inputs": 32, "targets": 32},
                            batch_size=8, shard_id=0, num_shards=1, seed=0)
batch = next(it)            # {"encoder_input_tokens": int32[8, 32], ...}
state = it.get_state()      # small JSON-able dict; it.set_state(state) resumes
"""

from seqio_lite.background import BackgroundIterator
from seqio_lite.dataset_providers import (
    CacheDatasetPlaceholder,
    Feature,
    Mixture,
    MixtureRegistry,
    Task,
    TaskRegistry,
    get_task_or_mixture,
    rate_num_examples,
    rate_unsupervised,
)
from seqio_lite.evaluation import (
    Evaluator,
    accuracy,
    bleu,
    exact_match,
    rouge,
    sequence_accuracy,
)
from seqio_lite.feature_converters import (
    EncDecFeatureConverter,
    FeatureConverter,
    LMFeatureConverter,
    PrefixLMFeatureConverter,
)
from seqio_lite.file_tasks import (
    TrainedSentencePiece,
    hf_dataset_task,
    jsonl_task,
    parquet_task,
    text_lines_task,
)
from seqio_lite.loader import DataIterator, StateMismatchError, get_dataset, preprocessed_examples
from seqio_lite.sources import (
    ArrayRecordSource,
    DataSource,
    FunctionSource,
    HFDatasetSource,
    InMemorySource,
    JsonlSource,
    ParquetSource,
    TextLineSource,
)
from seqio_lite.tasks import register_embedded_tasks
from seqio_lite.vocabularies import (
    EOS_ID,
    PAD_ID,
    ByteVocabulary,
    PassThroughVocabulary,
    SentencePieceVocabulary,
    Vocabulary,
    train_sentencepiece,
)

register_embedded_tasks()

__all__ = [
    "EOS_ID",
    "PAD_ID",
    "ArrayRecordSource",
    "BackgroundIterator",
    "ByteVocabulary",
    "CacheDatasetPlaceholder",
    "DataIterator",
    "DataSource",
    "EncDecFeatureConverter",
    "Evaluator",
    "Feature",
    "FeatureConverter",
    "FunctionSource",
    "HFDatasetSource",
    "InMemorySource",
    "JsonlSource",
    "LMFeatureConverter",
    "Mixture",
    "MixtureRegistry",
    "ParquetSource",
    "PassThroughVocabulary",
    "PrefixLMFeatureConverter",
    "SentencePieceVocabulary",
    "StateMismatchError",
    "Task",
    "TaskRegistry",
    "TextLineSource",
    "TrainedSentencePiece",
    "Vocabulary",
    "accuracy",
    "bleu",
    "exact_match",
    "get_dataset",
    "get_task_or_mixture",
    "hf_dataset_task",
    "jsonl_task",
    "parquet_task",
    "preprocessed_examples",
    "rate_num_examples",
    "rate_unsupervised",
    "register_embedded_tasks",
    "rouge",
    "sequence_accuracy",
    "text_lines_task",
    "train_sentencepiece",
]
