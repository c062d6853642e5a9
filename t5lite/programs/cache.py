"""The `cache` program: a task's pre-cache preprocessing (tokenization) run once, offline.

`t5lite cache --gin_file=RUN.gin` reads the same `DataConfig` as `t5lite train` and runs
`seqio_lite.cache_tasks` (an Apache Beam pipeline; DirectRunner unless Beam flags such as
`--runner=FlinkRunner` follow) for the task, or for every member of a mixture, writing
ArrayRecord shards under `DataConfig.cache_dir`. `DataConfig.use_cached = True` then trains from
them, with the same global shuffle and exact resume as the uncached pipeline. What runs after
the cache placeholder (random crops, span corruption, packing) still runs per epoch at load time,
so every epoch still differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import seqio_lite
from seqio_lite import cache_tasks
from t5lite.programs.configs import DataConfig


def cache(
    *,
    data: DataConfig,
    num_shards: int = 8,
    splits: Sequence[str] | None = None,
    overwrite: bool = False,
    pipeline_args: Sequence[str] = (),
) -> list[str]:
    """Caches `data.task` (each task of a mixture) in `data.cache_dir`; returns the folders.

    Args:
      data: the task and `cache_dir` (other fields are what training will use, unread here).
      num_shards: ArrayRecord files per split.
      splits: the splits to cache (default: all of each task's).
      overwrite: replace a completed cache (otherwise an existing one is refused, never lost).
      pipeline_args: Beam pipeline options, e.g. `['--runner=FlinkRunner', ...]`.
    """
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        raise ValueError(
            "t5lite cache needs Apache Beam, the [beam] extra: "
            "pip install -c constraints.txt -e '.[beam]'"
        ) from None
    if not data.cache_dir:
        raise ValueError("t5lite cache needs DataConfig.cache_dir (where the cache is written)")
    obj = seqio_lite.get_task_or_mixture(data.task)
    tasks = obj.tasks if isinstance(obj, seqio_lite.Mixture) else [obj]
    cacheable = [t for t in tasks if t.supports_caching]
    if not cacheable:
        raise ValueError(
            f"{data.task!r} has no task with a CacheDatasetPlaceholder: nothing to cache"
        )
    out = []
    for task in cacheable:
        path = cache_tasks.run_cache_job(
            task.name,
            data.cache_dir,
            splits,
            num_shards,
            overwrite=overwrite,
            pipeline_args=pipeline_args,
        )
        print(f"cached {task.name} -> {path}")
        out.append(path)
    return out
