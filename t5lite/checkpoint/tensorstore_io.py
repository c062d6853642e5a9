"""Raw array I/O on TensorStore: one jax.Array <-> one zarr3 array on disk.

This module knows nothing about steps, commits or trees (that is `manager.py`); it only turns
sharded arrays into chunk writes and chunk reads back into sharded arrays.

The on-disk array format (plain zarr v3) is `zarr_format.py`'s.

Writes: each process writes only its addressable shards whose `replica_id == 0` (staged by
`staging.py`), so no element is written twice. Reads: each process reads only the index ranges
its own devices need, once per distinct range (replicas share one read). Both go straight to
the chunk files where they can (`zarr_writer`, `zarr_reader`: the same bytes TensorStore writes
and reads), and through TensorStore otherwise (chunks shared between processes on save, other
formats on restore).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from t5lite.checkpoint import zarr_reader as zr
from t5lite.checkpoint import zarr_writer as zw
from t5lite.checkpoint.staging import HostShards
from t5lite.checkpoint.threads import parallel_map
from t5lite.checkpoint.zarr_format import (
    DEFAULT_CHUNK_BYTES,
    Index,
    array_spec,
    chunk_shape_for,
    shard_ranges,
)

# Writer threads of the direct chunk path: enough fsyncs in flight for the file system to batch
# its journal commits; the copies and checksums they also run release the GIL.
WRITE_THREADS = 8

# Reader threads of the direct chunk path: `preadv` from the page cache and crc32c both release
# the GIL, so a few threads per core keep both cores busy while others wait on the disk.
READ_THREADS = 8


def make_context(concurrency: int = 128, sync: bool = False) -> ts.Context:
    """A TensorStore context shared by all arrays of one save or restore.

    Args:
      concurrency: limit on concurrent file operations.
      sync: fsync each chunk file as TensorStore writes it. Off by default: `write_arrays`
        fsyncs each array's files in parallel once its writes are done, which lets the file
        system batch journal commits; either way data is durable before the caller writes a
        commit marker.

    Returns:
      A `ts.Context`.
    """
    return ts.Context(
        {
            "file_io_concurrency": {"limit": concurrency},
            # Copies and crc32c run here; a few threads per core hide the file reads they wait on.
            "data_copy_concurrency": {"limit": max(16, 2 * (os.cpu_count() or 1))},
            "file_io_sync": sync,
            # Checkpoint data is read or written once: caching it only costs memory.
            "cache_pool": {"total_bytes_limit": 0},
        }
    )


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def write_arrays(
    items: Sequence[tuple[str, HostShards]],
    context: ts.Context,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: bool = True,
    stats: dict[str, float] | None = None,
    threads: int = WRITE_THREADS,
) -> None:
    """Creates (or joins, across processes) each array and writes this process's pieces.

    Arrays whose every chunk lies inside one of this process's pieces (the usual case: shard
    boundaries of power-of-two meshes are chunk boundaries, see `chunk_shape_for`) are written by
    `zarr_writer` straight from the staged buffers, each chunk file fsynced by the thread that
    wrote it; process 0 writes their `zarr.json`. The rest go through TensorStore (which merges
    chunks shared by pieces) and are fsynced file by file as each array's writes finish. When
    this returns, every file and directory under the array directories, and the directories
    holding them, is durable.

    Args:
      items: (array directory, host shards) pairs.
      context: from `make_context` (used by the TensorStore path).
      chunk_bytes: chunk size bound passed to `chunk_shape_for`.
      checksum: store a crc32c per chunk (verified on every read).
      stats: when given, filled with where the time went (seconds, counts): `plan_s` (chunk
        plans, `zarr.json` files, directories, TensorStore opens), `prepare_s`, `write_s`,
        `fsync_s` (summed over the writer threads, which overlap them: copies of non-contiguous
        or edge chunks and checksums, `writev` calls, per-file fsyncs), `written_s` (wall time
        until every chunk is written and fsynced), `dirs_fsync_s` (the directories, then their
        parents), `files` fsynced, `chunk_writes`, `direct_arrays`, `tensorstore_arrays`,
        `bytes`.
      threads: writer threads of the direct path.
    """
    t_start = time.perf_counter()
    metadata_here = jax.process_index() == 0
    direct, fallback, jobs = [], [], []
    for path, h in items:
        grid = chunk_shape_for(h.shape, h.dtype.itemsize, chunk_bytes)  # as `array_spec` makes
        plan = zw.plan_chunks(h.shape, h.dtype, grid, h.pieces)
        if plan is None:
            fallback.append((path, h))
            continue
        if metadata_here:
            zw.write_metadata(path, h.shape, h.dtype, grid, checksum)
        direct.append((path, zw.chunk_dirs(path, [k for k, _ in plan])))
        jobs += [(path, key, parts, grid, h.dtype) for key, parts in plan]
    ts_writes = _start_tensorstore_writes(fallback, context, chunk_bytes, checksum)
    t_planned = time.perf_counter()
    done = parallel_map(lambda j: zw.write_chunk(*j, checksum), jobs, threads)
    ts_files = _finish_tensorstore_writes(fallback, ts_writes)
    t_written = time.perf_counter()
    # Directories after the files they name: children first, then the array directories, then
    # the directories holding those.
    dirs = [d for _, ds in direct for d in reversed(ds)] + [p for p, _ in direct]
    parallel_map(_fsync_path, dirs, 8)
    parents = sorted({os.path.dirname(os.path.abspath(path)) for path, _ in items})
    parallel_map(_fsync_path, parents, 8)
    if stats is not None:
        sums = [sum(x) for x in zip(*done)] if done else [0, 0.0, 0.0, 0.0]
        chunks = len(jobs) + sum(_chunk_count(h, chunk_bytes) for _, h in fallback)
        stats.update(
            plan_s=t_planned - t_start,
            prepare_s=sums[1],
            write_s=sums[2],
            fsync_s=sums[3],
            written_s=t_written - t_planned,
            dirs_fsync_s=time.perf_counter() - t_written,
            files=len(jobs) + len(direct) * metadata_here + len(dirs) + ts_files + len(parents),
            chunk_writes=chunks,
            direct_arrays=len(direct),
            tensorstore_arrays=len(fallback),
            bytes=sum(h.nbytes for _, h in items),
        )


def _chunk_count(h: HostShards, chunk_bytes: int) -> int:
    """Chunk writes of `h`'s pieces: each piece once per chunk it touches."""
    grid = chunk_shape_for(h.shape, h.dtype.itemsize, chunk_bytes)
    return sum(
        math.prod(-(-(b - a) // c) for (a, b), c in zip(index, grid)) for index, _ in h.pieces
    )


def _start_tensorstore_writes(
    items: Sequence[tuple[str, HostShards]], context: ts.Context, chunk_bytes: int, checksum: bool
) -> list[list[Any]]:
    """Opens every array and issues every write before any is awaited, so TensorStore overlaps
    them."""
    opens = [
        ts.open(
            array_spec(path, h.shape, h.dtype, chunk_bytes=chunk_bytes, checksum=checksum),
            create=True,
            # Several processes create the same array with identical metadata; TensorStore's
            # conditional writes make the second create an open.
            open=True,
            context=context,
        )
        for path, h in items
    ]
    writes = []
    for fut, (_, h) in zip(opens, items):
        store = fut.result()
        # NOTE: TensorStore copies the pieces (no `can_reference_source_data_indefinitely`): the
        # manager refills them at the next save, and TensorStore may keep references past a
        # write's commit.
        writes.append([store[_slices(index)].write(piece) for index, piece in h.pieces])
    return writes


def _finish_tensorstore_writes(
    items: Sequence[tuple[str, HostShards]], writes: list[list[Any]]
) -> int:
    """Waits for the writes and fsyncs each array's files as soon as its own writes are done
    (the disk flushes early arrays while later ones are still being encoded); returns how many
    files and directories were fsynced."""
    files = [0] * len(items)

    def finish(k: int) -> None:
        for w in writes[k]:
            w.result()
        files[k] = fsync_tree([items[k][0]], threads=8)

    try:
        parallel_map(finish, range(len(items)), 4)
    except BaseException:
        # Let every write settle before the caller may clean up or retry the directory.
        for w in (w for ws in writes for w in ws):
            with contextlib.suppress(Exception):
                w.result()
        raise
    return sum(files)


def fsync_tree(paths: Sequence[str], threads: int = 32) -> int:
    """fsyncs every file and directory under `paths`, in parallel; returns how many."""
    todo = []
    for root in paths:
        for d, _, files in os.walk(root):
            todo.append(d)
            todo.extend(os.path.join(d, f) for f in files)

    parallel_map(_fsync_path, todo, threads)
    return len(todo)


def _fsync_path(p: str) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        # Another process writing the same array removed one of its transient files (e.g.
        # TensorStore's `.__lock` files) after the walk listed it: nothing of ours to sync.
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def aligned_empty(shape: Sequence[int], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised C-order array whose data starts on an `align`-byte boundary.

    XLA's CPU client adopts such host memory as a device buffer without copying it; numpy's own
    arrays are only 16-byte aligned.
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset : offset + n].view(dtype).reshape(tuple(shape))


def read_arrays(
    items: Sequence[tuple[str, tuple[int, ...], Any, jax.sharding.Sharding | None]],
    context: ts.Context,
    threads: int = READ_THREADS,
    stats: dict[str, float] | None = None,
    finite: list[bool | None] | None = None,
) -> list[Any]:
    """Reads arrays onto shardings; each process reads only what its devices hold.

    Arrays in the format `zarr_reader` knows (everything t5lite writes, except 0-d arrays) are
    read chunk file by chunk file on `threads` threads, each chunk once, checksummed and placed
    from the same buffer; the rest through TensorStore, whose reads run alongside. Either way a
    range needed by several devices (replicas) is read once, into a 64-byte aligned buffer that
    `device_put` on CPU adopts without a copy.

    Args:
      items: (array directory, expected shape, target dtype, target sharding or None). With a
        sharding the result is a global jax.Array; with None, a host numpy array of the whole
        array. The stored dtype is cast to the target dtype after reading.
      context: from `make_context` (used by the TensorStore reads).
      threads: reader threads of the direct path.
      stats: when given, filled with where the time went (seconds, counts): `plan_s` (metadata,
        buffers, TensorStore opens), `read_s`, `crc_s`, `copy_s` (summed over the reader threads,
        which overlap them: `preadv` calls, crc32c, copies of chunks that are not one contiguous
        block of their shard), `chunks_s` (wall time until every chunk is read and checked, and
        TensorStore's reads are done), `cast_s`, `device_put_s`, `chunks`, `chunks_copied`,
        `direct_arrays`, `tensorstore_arrays`, `bytes`; and `finite_s` (thread-summed).
      finite: when given, set to one entry per item: whether the values this process read are
        all finite, checked by the reader threads on each chunk as it lands, or None where
        this was not checked (TensorStore reads, non-float dtypes, stored dtype cast to
        another).

    Returns:
      One array per item, in order.

    Raises:
      ValueError: for a missing, truncated or corrupt array or chunk (naming the chunk file).
    """
    t_start = time.perf_counter()
    infos = [zr.array_info(path) for path, *_ in items]
    # TensorStore's opens and reads are issued first: they run on its own threads meanwhile.
    stores = {
        k: ts.open(array_spec(path), open=True, read=True, context=context)
        for k, (path, *_) in enumerate(items)
        if infos[k] is None
    }
    plans, jobs, owner = _plan_reads(items, infos, stores, finite is not None, context)
    t_planned = time.perf_counter()
    try:
        done = parallel_map(zr.read_chunk, jobs, threads)
    finally:
        # Let TensorStore's reads settle before the buffers go (or an error propagates).
        for _, reads in plans:
            for _, fut in reads.values():
                if fut is not None:
                    with contextlib.suppress(Exception):
                        fut.result()
    for _, reads in plans:
        for _, fut in reads.values():
            if fut is not None:
                fut.result()
    t_read = time.perf_counter()
    out: list[Any] = [None] * len(items)
    puts, put_devices = [], []
    for k, ((dev_index, reads), (_, _, dtype, sharding)) in enumerate(zip(plans, items)):
        # An overflowing cast (fp32 -> fp16) gives Inf, which the restore's NaN/Inf check names.
        with np.errstate(over="ignore"):
            host = {idx: buf.astype(dtype, copy=False) for idx, (buf, _) in reads.items()}
        if sharding is None:
            out[k] = next(iter(host.values()))
        else:
            puts += [host[dev_index[d]] for d in dev_index]
            put_devices += list(dev_index)
    t_cast = time.perf_counter()
    # One `device_put` for every shard of every array: on CPU each aligned buffer is adopted, so
    # this is bookkeeping; elsewhere the runtime batches the transfers.
    on_device = iter(jax.device_put(puts, put_devices) if puts else [])
    for k, ((dev_index, _), (_, shape, _, sharding)) in enumerate(zip(plans, items)):
        if sharding is not None:
            bufs = [next(on_device) for _ in dev_index]
            out[k] = jax.make_array_from_single_device_arrays(shape, sharding, bufs)
    if finite is not None:
        checked = {k for k, j in zip(owner, jobs) if j.check_finite}
        finite[:] = [True if k in checked else None for k in range(len(items))]
        for k, r in zip(owner, done):
            if k in checked and not r[4]:
                finite[k] = False
    if stats is not None:
        sums = [sum(x) for x in zip(*done)] if done else [0.0] * 5
        stats.update(
            plan_s=t_planned - t_start,
            read_s=sums[0],
            crc_s=sums[1],
            copy_s=sums[2],
            finite_s=sums[3],
            chunks_s=t_read - t_planned,
            cast_s=t_cast - t_read,
            device_put_s=time.perf_counter() - t_cast,
            chunks=len(jobs),
            chunks_copied=sum(not j.direct for j in jobs),
            direct_arrays=sum(i is not None for i in infos),
            tensorstore_arrays=len(stores),
            bytes=sum(buf.nbytes for _, reads in plans for buf, _ in reads.values()),
        )
    return out


def _plan_reads(items, infos, stores, check_finite: bool, context: ts.Context):
    """Per item (device -> range, range -> (aligned buffer, TensorStore read or None)), the
    direct path's chunk jobs and the item each job belongs to. TensorStore's reads are issued
    here and land while the direct jobs run."""
    plans, jobs, owner = [], [], []
    for k, (_, shape, dtype, sharding) in enumerate(items):
        info = infos[k]
        check = (
            check_finite
            and info is not None
            and info.dtype == np.dtype(dtype)  # casts (fp32 -> fp16) can overflow: not here
            and zr.finite_checkable(info.dtype)
        )
        store = stores[k].result() if info is None else None
        stored_shape = tuple(info.shape if store is None else store.shape)
        if stored_shape != tuple(shape):
            raise ValueError(f"stored shape {stored_shape} != expected {tuple(shape)}")
        if sharding is None:
            dev_index = {None: tuple((0, d) for d in shape)}
        else:
            dev_index = {
                d: shard_ranges(i, shape)
                for d, i in sharding.addressable_devices_indices_map(shape).items()
            }
        stored = info.dtype if store is None else store.dtype.numpy_dtype
        reads = {}
        for idx in set(dev_index.values()):
            buf = aligned_empty(tuple(b - a for a, b in idx), stored)
            if store is None:
                planned = zr.plan_reads(info, idx, buf, check)
                jobs += planned
                owner += [k] * len(planned)
                reads[idx] = (buf, None)
            else:
                # TensorStore copies each chunk straight into our aligned buffer (`store.read()`
                # returns unaligned arrays, fresh each time).
                dst = ts.array(buf, copy=False, write=True, context=context)
                reads[idx] = (buf, dst.write(store[_slices(idx)]))
        plans.append((dev_index, reads))
    return plans, jobs, owner
