"""Offline cache job: run a Task's pre-cache preprocessors once, write sharded ArrayRecord files.

    python -m seqio_lite.cache_tasks --task=tiny_corpus_span_corruption --output_dir=/tmp/cache \
        [--splits=train,validation] [--num_shards=8] [--module=my.tasks] [--overwrite] \
        [beam pipeline options, e.g. --runner=DataflowRunner --project=...]

It is an Apache Beam pipeline (DirectRunner by default); the same pipeline runs on Dataflow,
Flink or Spark by passing the runner's options. Output, under `<output_dir>/<task>/`:

- `<split>.array_record-SSSSS-of-NNNNN`: msgpack-encoded examples; example `i` (in source
  order, filtered ones removed) is record `i // N` of shard `i % N`, so each group of readers can
  own an exclusive set of files and random access stays O(1);
- `info.json`: task name, fingerprint of the source and pre-cache steps, shards and counts;
- `stats.<split>.json`: example count and token counts / max lengths per feature;
- `COMPLETED`: written last; a cache without it is never read.

Read the cache with `get_dataset(..., use_cached=True)` after `add_global_cache_dirs([dir])`
(or with the environment variable `SEQIO_LITE_CACHE_DIRS=dir1:dir2`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from seqio_lite import dataset_providers as dp
from seqio_lite import sources
from seqio_lite.cache import COMPLETED, pre_cache_fingerprint, shard_path

# Where callers have always found them (`cache_tasks.add_global_cache_dirs([dir])`); they live in
# `cache.py`, the reading side that the loader imports.
from seqio_lite.cache import CachedSource as CachedSource
from seqio_lite.cache import add_global_cache_dirs as add_global_cache_dirs
from seqio_lite.cache import cached_source as cached_source
from seqio_lite.cache import get_global_cache_dirs as get_global_cache_dirs

# --------------------------------------------------------------------------------------------
# The Beam pipeline
# --------------------------------------------------------------------------------------------


_opened_splits: dict[tuple[str, str], sources.SplitData] = {}  # per worker process


def _process_chunk(chunk: tuple[int, int, int], task: dp.Task, split: str) -> Iterable:
    """(chunk id, start, end) -> [(chunk id, [encoded kept examples, in source order])].

    The task travels with the pipeline (pickled), so tasks defined in gin or in a notebook
    work on any runner whose workers have seqio_lite installed.
    """
    chunk_id, start, end = chunk
    key = (task.name, split)
    if key not in _opened_splits:  # opening may scan files: once per worker, not per chunk
        _opened_splits[key] = task.source.open(split)
    data = _opened_splits[key]
    kept = []
    for i in range(start, end):
        ex = task.preprocess_pre_cache(data[i], i)
        if ex is not None:
            kept.append(sources.encode_example(ex))
    yield chunk_id, kept


def _assign_indices(item: tuple[int, list[bytes]], offsets: dict, num_shards: int) -> Iterable:
    """Gives each record its global index; keys it by shard (index modulo shards)."""
    chunk_id, records = item
    base = offsets[chunk_id]
    for j, rec in enumerate(records):
        idx = base + j
        yield idx % num_shards, (idx, rec)


def _offsets(counts: dict[int, int]) -> dict[int, int]:
    out, total = {}, 0
    for cid in sorted(counts):
        out[cid] = total
        total += counts[cid]
    return out


def _write_shard(item: tuple[int, Iterable], task_dir: str, split: str, num_shards: int) -> dict:
    """Writes one shard in index order; returns its stats."""
    from array_record.python.array_record_module import ArrayRecordWriter

    shard, records = item
    records = sorted(records, key=lambda r: r[0])
    path = shard_path(task_dir, split, shard, num_shards)
    tmp = path + ".tmp"
    # group_size:1 keeps random access to one record cheap.
    writer = ArrayRecordWriter(tmp, "group_size:1")
    stats: dict[str, Any] = {"examples": 0, "tokens": {}, "max_length": {}}
    for _, rec in records:
        writer.write(rec)
        stats["examples"] += 1
        for k, v in sources.decode_example(rec).items():
            if isinstance(v, np.ndarray) and v.dtype.kind in "iu":
                stats["tokens"][k] = stats["tokens"].get(k, 0) + int(v.size)
                stats["max_length"][k] = max(stats["max_length"].get(k, 0), int(v.size))
    writer.close()
    os.replace(tmp, path)
    return stats


def _merge_stats(all_stats: Iterable[dict]) -> dict:
    out: dict[str, Any] = {"examples": 0, "tokens": {}, "max_length": {}}
    for s in all_stats:
        out["examples"] += s["examples"]
        for k, v in s["tokens"].items():
            out["tokens"][k] = out["tokens"].get(k, 0) + v
        for k, v in s["max_length"].items():
            out["max_length"][k] = max(out["max_length"].get(k, 0), v)
    return out


def run_cache_job(
    task_name: str,
    output_dir: str,
    splits: Sequence[str] | None = None,
    num_shards: int = 4,
    chunk_size: int = 1000,
    overwrite: bool = False,
    pipeline_args: Sequence[str] = (),
) -> str:
    """Builds and runs the cache pipeline for one task; returns the task's cache folder.

    Args:
      task_name: a registered task with a `CacheDatasetPlaceholder`.
      output_dir: the cache root; the task's files go to `<output_dir>/<task_name>/`.
      splits: splits to cache (default: all of the source's).
      num_shards: ArrayRecord files per split.
      chunk_size: source examples per Beam work item.
      overwrite: replace a completed cache (otherwise refused: good data is never clobbered).
      pipeline_args: Beam pipeline options (`--runner=...` etc.); DirectRunner when empty.
    """
    # The `[beam]` extra: only running the job needs it, not reading a cache.
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    task, task_dir = _cacheable(task_name, output_dir, overwrite)
    completed = os.path.join(task_dir, COMPLETED)
    if os.path.exists(completed):
        os.remove(completed)  # the cache is invalid from here until the job finishes
    splits = list(splits or task.splits)
    sizes = {s: task.num_input_examples(s) for s in splits}

    stats: dict[str, Any] = {}
    with beam.Pipeline(options=PipelineOptions(list(pipeline_args))) as p:
        for split in splits:
            chunks = [
                (c, start, min(start + chunk_size, sizes[split]))
                for c, start in enumerate(range(0, sizes[split], chunk_size))
            ]
            processed = (
                p
                | f"Chunks[{split}]" >> beam.Create(chunks)
                | f"Preprocess[{split}]" >> beam.FlatMap(_process_chunk, task, split)
            )
            offsets = (
                processed
                | f"Count[{split}]" >> beam.Map(lambda kv: (kv[0], len(kv[1])))
                | f"Counts[{split}]" >> beam.combiners.ToDict()
                | f"Offsets[{split}]" >> beam.Map(_offsets)
            )
            shard_stats = (
                processed
                | f"Index[{split}]"
                >> beam.FlatMap(_assign_indices, beam.pvalue.AsSingleton(offsets), num_shards)
                | f"GroupByShard[{split}]" >> beam.GroupByKey()
                | f"Write[{split}]" >> beam.Map(_write_shard, task_dir, split, num_shards)
            )
            (
                shard_stats
                | f"MergeStats[{split}]" >> beam.combiners.ToList()
                | f"WriteStats[{split}]" >> beam.Map(_write_stats, task_dir, split)
            )

    _opened_splits.clear()  # an in-process runner's workers: the next job may see new files
    info: dict[str, Any] = {"task": task_name, "splits": {}}
    for split in splits:
        with open(os.path.join(task_dir, f"stats.{split}.json")) as f:
            stats[split] = json.load(f)
        for s in range(num_shards):  # shards that got no example still exist, empty
            path = shard_path(task_dir, split, s, num_shards)
            if not os.path.exists(path):
                _write_shard((s, []), task_dir, split, num_shards)
        if stats[split]["examples"] == 0:
            raise ValueError(f"Task {task_name!r} split {split!r}: every example was filtered out")
        info["splits"][split] = {
            "num_shards": num_shards,
            "num_examples": stats[split]["examples"],
            "num_input_examples": sizes[split],
            "fingerprint": pre_cache_fingerprint(task, split),
        }
    with open(os.path.join(task_dir, "info.json"), "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
    with open(completed, "w") as f:
        f.write("")
    return task_dir


def _cacheable(task_name: str, output_dir: str, overwrite: bool) -> tuple[dp.Task, str]:
    """The task and its (created) cache folder, or one clear error before any work."""
    task = dp.get_task_or_mixture(task_name)
    if not isinstance(task, dp.Task):
        raise ValueError(f"{task_name!r} is a mixture; cache its tasks one by one")
    if not task.supports_caching:
        raise ValueError(f"Task {task_name!r} has no CacheDatasetPlaceholder; nothing to cache")
    task_dir = os.path.join(output_dir, task_name)
    if os.path.exists(os.path.join(task_dir, COMPLETED)) and not overwrite:
        raise FileExistsError(f"{task_dir} already holds a completed cache; pass --overwrite")
    os.makedirs(task_dir, exist_ok=True)
    return task, task_dir


def _write_stats(shard_stats: list[dict], task_dir: str, split: str) -> None:
    with open(os.path.join(task_dir, f"stats.{split}.json"), "w") as f:
        json.dump(_merge_stats(shard_stats), f, indent=2, sort_keys=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; unknown flags are passed to Beam as pipeline options."""
    parser = argparse.ArgumentParser(prog="python -m seqio_lite.cache_tasks", description=__doc__)
    parser.add_argument("--task", required=True, action="append", help="task name (repeatable)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--splits", default="", help="comma-separated; default: all")
    parser.add_argument("--num_shards", type=int, default=4)
    parser.add_argument("--chunk_size", type=int, default=1000)
    parser.add_argument("--module", action="append", default=[], help="module registering tasks")
    parser.add_argument("--overwrite", action="store_true")
    args, beam_args = parser.parse_known_args(argv)
    # The embedded tasks are registered already: importing any `seqio_lite.*` module (this one
    # too, also under `python -m`) runs the package's `__init__`, which registers them.
    for m in args.module:
        importlib.import_module(m)
    splits = [s for s in args.splits.split(",") if s] or None
    try:
        for name in args.task:
            path = run_cache_job(
                name,
                args.output_dir,
                splits,
                args.num_shards,
                args.chunk_size,
                args.overwrite,
                beam_args,
            )
            print(f"cached {name} -> {path}")
    except (ValueError, KeyError, FileExistsError, FileNotFoundError) as e:
        print(f"cache_tasks: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
