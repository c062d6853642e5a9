"""Reading the offline cache that `cache_tasks` writes: where caches live, the fingerprint that
says whether one is current, and a completed cache as a random-access `DataSource`.

The loader reads caches through this module (`get_dataset(..., use_cached=True)`); the cache job
writes them with the same paths and fingerprint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from seqio_lite import dataset_providers as dp
from seqio_lite import sources

_CACHE_DIRS: list[str] = []
COMPLETED = "COMPLETED"


def add_global_cache_dirs(dirs: Sequence[str]) -> None:
    """Adds folders in which `use_cached=True` looks for `<dir>/<task name>/COMPLETED`."""
    for d in dirs:
        if d not in _CACHE_DIRS:
            _CACHE_DIRS.append(os.fspath(d))


def get_global_cache_dirs() -> list[str]:
    """Registered cache folders, then those of `$SEQIO_LITE_CACHE_DIRS`."""
    env = [d for d in os.environ.get("SEQIO_LITE_CACHE_DIRS", "").split(os.pathsep) if d]
    return _CACHE_DIRS + [d for d in env if d not in _CACHE_DIRS]


def pre_cache_fingerprint(task: dp.Task, split: str) -> str:
    """Identity of what the cache holds: the source split and the pre-cache steps."""
    procs = [dp.preprocessor_name(p) for p in task.pre_cache_preprocessors]
    vocabs = sorted((k, f.vocabulary.fingerprint) for k, f in task.output_features.items())
    return sources._hash(task.name, task.source.fingerprint(split), procs, vocabs)


def shard_path(task_dir: str, split: str, shard: int, num_shards: int) -> str:
    """The file of one shard of a cached split."""
    return os.path.join(task_dir, f"{split}.array_record-{shard:05d}-of-{num_shards:05d}")


class _CachedSplit(sources.SplitData):
    def __init__(self, files: list[str], num_examples: int, fingerprint: str):
        self._files = files
        self._n = num_examples
        self._fingerprint = fingerprint
        self._readers: list[Any] | None = None

    def _open_readers(self) -> list[Any]:
        from array_record.python.array_record_module import ArrayRecordReader

        if self._readers is None:
            self._readers = [ArrayRecordReader(f) for f in self._files]
        return self._readers

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} cached examples")
        n = len(self._files)
        record = self._open_readers()[index % n].read([index // n])[0]
        return sources.decode_example(record)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict:
        return {"files": self._files, "n": self._n, "fp": self._fingerprint}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["files"], state["n"], state["fp"])


class CachedSource(sources.DataSource):
    """The output of this job for one task, as a random-access source."""

    def __init__(self, task_dir: str):
        super().__init__(f"cache:{task_dir}")
        self.task_dir = task_dir
        with open(os.path.join(task_dir, "info.json")) as f:
            self.info = json.load(f)

    @property
    def splits(self) -> Sequence[str]:
        return list(self.info["splits"])

    def _open(self, split: str) -> sources.SplitData:
        meta = self.info["splits"][split]
        files = [
            shard_path(self.task_dir, split, s, meta["num_shards"])
            for s in range(meta["num_shards"])
        ]
        fp = sources._hash("cache", meta["fingerprint"], meta["num_examples"])
        return _CachedSplit(files, meta["num_examples"], fp)


def cached_source(task: dp.Task) -> CachedSource:
    """The completed cache of `task` in the global cache dirs; a clear error if there is none."""
    dirs = get_global_cache_dirs()
    for d in dirs:
        task_dir = os.path.join(d, task.name)
        if os.path.exists(os.path.join(task_dir, COMPLETED)):
            src = CachedSource(task_dir)
            for split in src.splits:
                expected = src.info["splits"][split]["fingerprint"]
                if expected != pre_cache_fingerprint(task, split):
                    raise ValueError(
                        f"Cache of task {task.name!r} in {task_dir} is stale for split {split!r}: "
                        "its source or pre-cache preprocessors changed; rerun cache_tasks"
                    )
            return src
    raise FileNotFoundError(
        f"No completed cache for task {task.name!r} in cache dirs {dirs}; run `python -m "
        f"seqio_lite.cache_tasks --task={task.name} --output_dir=DIR` and "
        "add_global_cache_dirs([DIR])"
    )
