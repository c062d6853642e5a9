"""Deterministic, sharded, resumable loading of tasks and mixtures into numpy batches.

How a batch is made (all steps are index-based grain `MapDataset`s, so element `i` of every stage
is a pure function of `i` and the seed):

1. each task's split is read from its source (or its offline cache), pre-cache preprocessors
   run keyed on the *source index*;
2. a global shuffle (`seed`), then `repeat(num_epochs)` which reshuffles every epoch;
3. the remaining preprocessors and the feature converter's per-example step run with an rng
   keyed on the element's *global position*;
4. a mixture interleaves its tasks with an exactly proportional, deterministic schedule;
5. data-parallel process `shard_id` of `num_shards` reads global positions
   `shard_id, shard_id + num_shards, ...`: exclusive, and together the whole stream;
6. the process packs (or pads) consecutive examples greedily into `[batch_size, length]` rows.

The iterator state is a small JSON-able dict: essentially the global position of the next
example this process reads. Restoring recomputes from there (no replay).

Changing the number of processes: the state is *elastic* (restorable with another
`num_shards` / `shard_id`) when every process has consumed the same number of examples, i.e.
`pack=False` and no example was filtered or dropped; then the union of all processes stands at
one global position and any new layout continues exactly from it. With packing, each process
consumes a data-dependent number of examples per batch, so the state is per process and
restoring it under another `num_shards` is refused with a clear error. Batch size may change
on restore in both cases.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import grain
import numpy as np

from seqio_lite import cache
from seqio_lite import dataset_providers as dp
from seqio_lite import feature_converters as fc

STATE_FORMAT = "seqio_lite.iterator/v1"
_FILTERED: dict = {}  # marker for an example dropped by a preprocessor or the converter


def _derive_seed(*parts: Any) -> int:
    """A 31-bit seed from any hashable description (stable across runs and machines)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _source_dataset(task: dp.Task, split: str, use_cached: bool) -> grain.MapDataset:
    """The task's examples after the pre-cache preprocessors (filtered ones are `{}`)."""
    if use_cached:
        return SourceMapDataset(cache.cached_source(task).open(split))
    data = task.source.open(split)

    def pre_cache(index: int, example: dict) -> dict:
        out = task.preprocess_pre_cache(example, index)
        return _FILTERED if out is None else out

    ds = SourceMapDataset(data)
    return ds.map_with_index(pre_cache) if task.pre_cache_preprocessors else ds


class SourceMapDataset(grain.MapDataset):
    """A split's examples by index, as `grain.MapDataset.source` gives them (index modulo the
    length), without its per-element statistics and Prometheus metrics: those cost twice the
    reading of a synthetic example, on the host thread that also feeds the devices."""

    def __init__(self, source: Any):
        super().__init__()
        self._source = source
        self._n = len(source)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self.slice(index)
        return self._source[index % self._n]

    def _getitems(self, indices: Sequence[int]) -> list:
        source, n = self._source, self._n
        return [source[i % n] for i in indices]

    def __str__(self) -> str:
        return f"SourceMapDataset(source={type(self._source).__name__})"


def task_examples(
    task: dp.Task,
    split: str,
    sequence_length: Mapping[str, int] | None,
    use_cached: bool,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    converter: fc.FeatureConverter | None = None,
) -> grain.MapDataset:
    """Steps 1-3 for one task: a `MapDataset` of converted examples (`{}` where dropped)."""
    if use_cached and not task.supports_caching:
        raise ValueError(f"Task {task.name!r} has no CacheDatasetPlaceholder; it cannot be cached")
    ds = _source_dataset(task, split, use_cached)
    if shuffle and len(ds) <= _MAX_PERMUTATION:
        ds = EpochShuffleMapDataset(ds, _derive_seed(seed, task.name, "shuffle"), num_epochs)
    else:
        if shuffle:
            ds = ds.shuffle(seed=_derive_seed(seed, task.name, "shuffle"))
        if num_epochs is None or num_epochs > 1:
            ds = ds.repeat(num_epochs)

    preprocess = task.post_cache_fn(sequence_length)

    def post(example: dict, rng: np.random.Generator | None = None) -> dict:
        if not example:
            return _FILTERED
        out = preprocess(example, rng)
        if out is None:
            return _FILTERED
        if converter is not None:
            return converter.convert_example(out, sequence_length)
        return out

    if not task.post_cache_uses_rng:
        # Nothing would draw from the element's generator: setting one up per element cost as
        # much host time as reading a synthetic example. Same output, same order.
        return ds.map(post)
    return ds.random_map(post, seed=_derive_seed(seed, task.name, "preprocess"))


def preprocessed_examples(
    task: dp.Task,
    split: str,
    sequence_length: Mapping[str, int] | None = None,
    use_cached: bool = False,
    seed: int = 0,
) -> Iterable[dp.Example]:
    """Yields the fully preprocessed examples of `task`'s `split` in source order (for inspection
    and evaluation): steps 1-3 without shuffling, one epoch, dropped examples skipped."""
    ds = task_examples(task, split, sequence_length, use_cached, seed, shuffle=False, num_epochs=1)
    for i in range(len(ds)):
        ex = ds[i]
        if ex:
            yield ex


# Up to this many examples, an epoch's shuffle is one numpy permutation (4 bytes per example),
# much cheaper per element than grain's stateless index_shuffle; above it, grain's shuffle.
_MAX_PERMUTATION = 1 << 24


class EpochShuffleMapDataset(grain.MapDataset):
    """Global shuffle with a fresh permutation each epoch, repeated `num_epochs` (None = forever).

    Element `i` is `parent[perm_e[i % n]]` with `e = i // n` and `perm_e` drawn from
    `(seed, e)`: random access, deterministic, and independent of who reads it.
    """

    def __init__(self, parent: grain.MapDataset, seed: int, num_epochs: int | None):
        super().__init__(parent)
        self._n = len(parent)
        self._seed = seed
        self._length = self._n * num_epochs if num_epochs is not None else 2**62
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # readers move forward; keep the current and next epoch
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self._seed, epoch]).permutation(self._n)
            perm = self._perms[epoch] = perm.astype(np.int32)
        return perm

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self.slice(index)
        epoch, j = divmod(index, self._n)
        return self._parents[0][int(self._perm(epoch)[j])]

    def _getitems(self, indices: Sequence[int]) -> Sequence:
        # One read of the parent for a whole chunk (the in-process iterator reads in chunks).
        parent = [int(self._perm(i // self._n)[i % self._n]) for i in indices]
        return self._parents[0]._getitems(parent)

    def __getstate__(self) -> dict:
        # Worker processes recompute permutations rather than receive them.
        state = dict(self.__dict__)
        state["_perms"] = {}
        return state

    def __str__(self) -> str:
        return f"EpochShuffleMapDataset(n={self._n}, seed={self._seed})"


# --------------------------------------------------------------------------------------------
# Exactly proportional mixing
# --------------------------------------------------------------------------------------------


def integer_proportions(rates: Sequence[float], max_denominator: int = 10_000) -> list[int]:
    """Smallest integers in the ratio of `rates` (rates are rounded to 1/max_denominator)."""
    total = sum(rates)
    fracs = [Fraction(r / total).limit_denominator(max_denominator) for r in rates]
    lcm = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * lcm) for f in fracs]
    g = math.gcd(*ints)
    return [max(1, i // g) for i in ints]


def _select(k: int, proportions: Sequence[int]) -> tuple[int, int]:
    """(dataset, index within it) of mixed element `k`.

    Treats the mixture as nested two-way splits: dataset i takes, out of the elements left over
    by datasets < i, a share p_i / (p_i + ... + p_n) spread evenly with floor division. Every
    prefix of length m * sum(p) therefore holds exactly m * p_i elements of dataset i.
    """
    remaining = sum(proportions)
    k0, k1 = k, k + 1
    for i, p in enumerate(proportions):
        n0 = (k0 * (remaining - p)) // remaining
        n1 = (k1 * (remaining - p)) // remaining
        taken = k1 - n1
        if (k0 - n0) != taken:
            return i, taken - 1
        remaining -= p
        k0, k1 = n0, n1
    raise AssertionError("unreachable: proportions must be positive")


class ExactMixMapDataset(grain.MapDataset):
    """Interleaves datasets in exact integer proportions (random access, deterministic)."""

    def __init__(self, parents: Sequence[grain.MapDataset], proportions: Sequence[int]):
        super().__init__(list(parents))
        self._proportions = tuple(int(p) for p in proportions)
        total = sum(self._proportions)
        # Long enough that no parent element is read twice.
        self._length = min(
            min(len(d) * total // p for d, p in zip(parents, self._proportions)),
            2**62,
        )

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self.slice(index)
        d, j = _select(index, self._proportions)
        return self._parents[d][j]

    def __str__(self) -> str:
        return f"ExactMixMapDataset(proportions={self._proportions})"


# --------------------------------------------------------------------------------------------
# The iterator
# --------------------------------------------------------------------------------------------


class StateMismatchError(ValueError):
    """An iterator state was saved from a different pipeline."""


class DataIterator(Iterator[dict[str, np.ndarray]]):
    """Yields `{model feature: int32 [batch_size, length]}` batches for one process.

    Use `get_state()` / `set_state(state)` to save and resume; states are JSON-serialisable.
    """

    def __init__(
        self,
        dataset: grain.MapDataset,
        converter: fc.FeatureConverter,
        group_lengths: fc.GroupLengths,
        batch_size: int,
        shard_id: int,
        num_shards: int,
        config: Mapping[str, Any],
        num_workers: int = 0,
        drop_remainder: bool = False,
        read_threads: int = 0,
    ):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in [0, {num_shards}), got {shard_id}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._dataset = dataset
        self._conv = converter
        self._lengths = dict(group_lengths)
        self.batch_size = batch_size
        self.shard_id, self.num_shards = shard_id, num_shards
        self.config = dict(config)
        self.fingerprint = hashlib.sha256(
            json.dumps(self.config, sort_keys=True).encode()
        ).hexdigest()[:16]
        self._num_workers = num_workers
        self._read_threads = read_threads
        self._drop_remainder = drop_remainder
        self._next = shard_id  # global position of the next example this process reads
        self._dropped = 0
        self._batches = 0
        self._it: Iterator | None = None
        self._pending: dict | None = None

    # -- engine --------------------------------------------------------------------------------

    def _grain_iterator(self) -> Iterator:
        ds = self._dataset[self._next :: self.num_shards]
        it_ds = ds.to_iter_dataset(
            grain.ReadOptions(num_threads=self._read_threads, prefetch_buffer_size=256)
        )
        if self._num_workers > 0:
            _ensure_absl_flags_parsed()
            it_ds = it_ds.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=self._num_workers, per_worker_buffer_size=8
                )
            )
        return iter(it_ds)

    def _chunks(self) -> Iterator:
        """In-process reading: the examples at this process's positions from `_next` on, read a
        chunk at a time with one `_getitems` call per stage (grain's per-element iterator,
        prefetch and statistics layers cost more host time than the preprocessing itself)."""
        pos, step, n = self._next, self.num_shards, len(self._dataset)
        chunk = max(16, 2 * self.batch_size)  # about one packed batch of short examples
        while pos < n:
            stop = min(pos + chunk * step, n)
            yield from self._dataset._getitems(range(pos, stop, step))
            pos = stop + (pos - stop) % step  # the next position of this shard

    def _reset_engine(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        self._it, self._pending = None, None

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            in_process = self._num_workers == 0 and self._read_threads == 0
            self._it = self._chunks() if in_process else self._grain_iterator()
        packer = fc.RowPacker(self._conv, self.batch_size, self._lengths)
        exhausted = False
        while True:
            if not self._conv.pack and len(packer) == self.batch_size:
                break  # without packing the batch is full without peeking at the next example
            if self._pending is None:
                try:
                    self._pending = next(self._it)
                except StopIteration:
                    exhausted = True
                    break
                except Exception:
                    # A preprocessor's error: a chunk reader that raised is finished, so a
                    # caller that goes on restarts the reading at the example it stands at.
                    self._reset_engine()
                    raise
            ex = self._pending
            if ex and not packer.add(ex):
                break  # the batch is full; `ex` starts the next one
            if not ex:
                self._dropped += 1
            self._pending = None
            self._next += self.num_shards
        if len(packer) == 0 or (exhausted and self._drop_remainder):
            raise StopIteration
        self._batches += 1
        return packer.batch()

    def __iter__(self) -> DataIterator:
        return self

    def __getstate__(self) -> dict[str, Any]:
        # Without the reading engine (a generator or grain's workers, which do not pickle) and
        # the example it read ahead: `_next` still points at that example, so a copy restarts
        # the reading exactly there (a `BackgroundIterator`'s data process).
        return {**self.__dict__, "_it": None, "_pending": None}

    # -- state ---------------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """A small JSON-serialisable state; see the module docstring for when it is elastic."""
        return {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "next_index": self._next,
            "elastic": (not self._conv.pack) and self._dropped == 0,
            "batches": self._batches,
            "dropped": self._dropped,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resumes from `state` (from `get_state`, possibly of a run with another batch size).

        Raises:
          StateMismatchError: the state comes from another pipeline (different data, seed,
            lengths, ...) or from another process layout that it cannot be mapped onto.
        """
        if state.get("format") != STATE_FORMAT:
            raise StateMismatchError(f"Not a {STATE_FORMAT} state: format={state.get('format')!r}")
        if state["fingerprint"] != self.fingerprint:
            old = state.get("config", {})
            diff = sorted(
                k for k in set(old) | set(self.config) if old.get(k) != self.config.get(k)
            )
            details = "; ".join(
                f"{k}: saved {old.get(k)!r} vs now {self.config.get(k)!r}" for k in diff
            )
            raise StateMismatchError(
                f"Iterator state does not match this pipeline (differs in {diff}): {details}"
            )
        if state["num_shards"] == self.num_shards and state["shard_id"] == self.shard_id:
            next_index = int(state["next_index"])
        elif state["elastic"]:
            # All processes stood at the same global position `base`; continue from there.
            base = int(state["next_index"]) - int(state["shard_id"])
            next_index = base + self.shard_id
        else:
            raise StateMismatchError(
                f"Iterator state was saved by shard {state['shard_id']} of {state['num_shards']} "
                f"and is not elastic (packing or dropped examples make it per-process); it "
                f"cannot restore shard {self.shard_id} of {self.num_shards}"
            )
        self._reset_engine()
        self._next = next_index
        self._dropped = int(state.get("dropped", 0))
        self._batches = int(state.get("batches", 0))

    def close(self) -> None:
        """Stops worker processes, if any."""
        self._reset_engine()

    # -- shapes --------------------------------------------------------------------------------

    @property
    def feature_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """`{feature: (shape, dtype)}` of every batch, for building abstract model inputs."""
        empty = self._conv.make_batch([], self.batch_size, self._lengths)
        return {k: (v.shape, v.dtype) for k, v in empty.items()}


def _ensure_absl_flags_parsed() -> None:
    """grain reads absl flags in its workers; outside an absl app they were never parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


_CONVERTERS: dict[str, type[fc.FeatureConverter]] = {
    "enc_dec": fc.EncDecFeatureConverter,
    "lm": fc.LMFeatureConverter,
    "prefix_lm": fc.PrefixLMFeatureConverter,
}


def _resolve_converter(
    feature_converter: fc.FeatureConverter | type | str | None,
    tasks: Sequence[dp.Task],
    pack: bool | None,
) -> fc.FeatureConverter:
    if isinstance(feature_converter, fc.FeatureConverter):
        if pack is not None and pack != feature_converter.pack:
            raise ValueError(f"pack={pack} contradicts {feature_converter!r}")
        return feature_converter
    if feature_converter is None:
        feature_converter = "enc_dec" if "inputs" in tasks[0].output_features else "lm"
    if isinstance(feature_converter, str):
        if feature_converter not in _CONVERTERS:
            raise ValueError(
                f"Unknown feature_converter {feature_converter!r}; one of {sorted(_CONVERTERS)}"
            )
        feature_converter = _CONVERTERS[feature_converter]
    return feature_converter(pack=True if pack is None else pack)


def get_dataset(
    task_or_mixture: str | dp.Task | dp.Mixture,
    sequence_length: Mapping[str, int],
    split: str = "train",
    batch_size: int = 8,
    *,
    shard_id: int = 0,
    num_shards: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    feature_converter: fc.FeatureConverter | type | str | None = None,
    pack: bool | None = None,
    use_cached: bool = False,
    num_workers: int = 0,
    drop_remainder: bool = False,
) -> DataIterator:
    """The process-local batch iterator of a task or mixture.

    Args:
      task_or_mixture: a registered name, or a `Task` / `Mixture` object.
      sequence_length: task feature lengths, e.g. `{"inputs": 512, "targets": 128}`.
      split: source split.
      batch_size: rows per batch *on this process* (global batch = batch_size * num_shards).
      shard_id, num_shards: this data-parallel process and the number of them.
      seed: drives the shuffle, mixing-free randomness (span corruption etc.) of every epoch.
      shuffle: global shuffle, reshuffled each epoch.
      num_epochs: passes over the data; None repeats forever.
      feature_converter: a `FeatureConverter`, its class, or "enc_dec" | "lm" | "prefix_lm";
        default: enc_dec when the task has an "inputs" feature, else lm.
      pack: pack several examples per row (default True unless a converter instance says).
      use_cached: read the output of `cache_tasks` instead of running pre-cache preprocessors.
      num_workers: grain worker processes for reading and preprocessing (0 = in-process).
      drop_remainder: drop a final partial batch of a finite dataset (else it is padded).

    Returns:
      A `DataIterator` of `{feature: int32 [batch_size, length]}` dicts.
    """
    obj = dp.get_task_or_mixture(task_or_mixture)
    if isinstance(obj, dp.Mixture):
        tasks_rates = obj.tasks_and_rates()
    else:
        tasks_rates = [(obj, 1.0)]
    tasks = [t for t, _ in tasks_rates]
    converter = _resolve_converter(feature_converter, tasks, pack)
    group_lengths = converter.group_lengths(sequence_length)
    datasets = [
        task_examples(t, split, sequence_length, use_cached, seed, shuffle, num_epochs, converter)
        for t in tasks
    ]
    if len(datasets) == 1:
        dataset = datasets[0]
        proportions = [1]
    else:
        proportions = integer_proportions([r for _, r in tasks_rates])
        dataset = ExactMixMapDataset(datasets, proportions)
    config = {
        "name": obj.name,
        "tasks": [
            [t.name, t.fingerprint(split, cache.cached_source(t) if use_cached else None), p]
            for t, p in zip(tasks, proportions)
        ],
        "split": split,
        "seed": seed,
        "shuffle": shuffle,
        "num_epochs": num_epochs,
        "sequence_length": dict(sorted(sequence_length.items())),
        "feature_converter": converter.name,
        "use_cached": use_cached,
    }
    return DataIterator(
        dataset,
        converter,
        group_lengths,
        batch_size,
        shard_id,
        num_shards,
        config,
        num_workers=num_workers,
        drop_remainder=drop_remainder,
    )
