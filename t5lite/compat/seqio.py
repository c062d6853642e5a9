"""seqio's argument names for `seqio_lite.get_dataset`, for code ported from seqio, and the
`seqio.SentencePieceVocabulary` a t5x model gin file names.

`seqio_lite.Task` already takes seqio's arguments (name, source, output_features, preprocessors,
postprocess_fn, metric_fns); only `get_dataset` names its arguments differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import seqio_lite


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """seqio's `ShardInfo`: this process's shard of the data."""

    index: int
    num_shards: int


def get_dataset(
    mixture_or_task_name: str | seqio_lite.Task | seqio_lite.Mixture,
    task_feature_lengths: Mapping[str, int],
    dataset_split: str = "train",
    shuffle: bool = True,
    num_epochs: int | None = 1,
    feature_converter: Any = None,
    shard_info: ShardInfo | None = None,
    verbose: bool = True,
    seed: int | None = None,
    batch_size: int | None = None,
    trim_output_features: bool = True,
) -> seqio_lite.DataIterator:
    """`seqio.get_dataset`'s signature over `seqio_lite.get_dataset`.

    Differences: the result is a resumable iterator of numpy batches, not a `tf.data.Dataset`,
    so `batch_size` is required (seqio: None = unbatched); `seed=None` means 0, not a fresh
    random seed (seqio_lite pipelines are deterministic); `feature_converter=None` picks
    encoder-decoder or LM by the task's features (seqio: a pass-through converter, which
    seqio_lite lacks); over-long features are always trimmed; `verbose` is ignored.
    """
    del verbose
    if batch_size is None:
        raise ValueError("get_dataset: seqio_lite yields batches; give batch_size")
    if not trim_output_features:
        raise ValueError("get_dataset: seqio_lite always trims features to their lengths")
    shard = shard_info or ShardInfo(0, 1)
    return seqio_lite.get_dataset(
        mixture_or_task_name,
        dict(task_feature_lengths),
        dataset_split,
        batch_size,
        shard_id=shard.index,
        num_shards=shard.num_shards,
        seed=0 if seed is None else seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        feature_converter=feature_converter,
    )


@dataclasses.dataclass(frozen=True)
class SentencePieceVocabulary:
    """seqio's `SentencePieceVocabulary(sentencepiece_model_file, extra_ids)` as t5x's model gin
    files bind it (`VOCABULARY = @seqio.SentencePieceVocabulary()`), read when asked (`load`).

    t5lite's models decode with the task's vocabulary, not the model's, so the file t5x's
    configs name (a gs:// path) is never opened unless something calls `load`.
    """

    sentencepiece_model_file: str
    extra_ids: int = 0

    def load(self) -> seqio_lite.SentencePieceVocabulary:
        return seqio_lite.SentencePieceVocabulary(self.sentencepiece_model_file, self.extra_ids)
