"""Direct zarr3 chunk writes: the save's fast path, straight from the staged host buffers.

Why not TensorStore for the writes: its write path copies the source, encodes every chunk into
a buffer of its own and commits each chunk file through its own locking, which keeps a save
well below the disk's fsync'd rate (docs/performance.md has the figures). The format
(`zarr_format.py`: `bytes` little endian, then `crc32c`, regular chunk grid, default `c/i/j`
keys, full-size edge chunks padded with the fill value) is simple enough to write by hand: each
chunk is one `writev` of the staged shard's own memory (a copy only where a chunk is not one
contiguous block of one piece) and its checksum, and one `fsync`. What lands on disk is byte for
byte what TensorStore writes (`zarr.json` comes from TensorStore itself, see `_metadata_bytes`;
tested), and restore reads it with TensorStore.

Arrays with a chunk that this process's pieces do not fill (it is shared with another process's
shards), 0-d or empty arrays, and dtypes outside `zarr_format.DTYPES` are left to TensorStore, whose
read-modify-write merges shared chunks: `plan_chunks` returns None for them.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
import tensorstore as ts

from t5lite.checkpoint.zarr_format import DTYPES, Index, array_spec, chunk_key, chunk_overlaps


@functools.lru_cache(maxsize=256)
def _metadata_bytes(
    shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...], crc: bool
) -> bytes:
    """`zarr.json` exactly as TensorStore writes it (created in memory, never on disk)."""
    spec = array_spec("", shape, dtype)
    spec["metadata"]["chunk_grid"]["configuration"]["chunk_shape"] = list(chunks)
    if not crc:
        spec["metadata"]["codecs"] = spec["metadata"]["codecs"][:1]
    spec["kvstore"] = {"driver": "memory"}
    store = ts.open(spec, create=True, context=ts.Context()).result()
    return store.kvstore.read("zarr.json").result().value


Part = tuple[tuple[slice, ...], np.ndarray]  # (where in the chunk, the data from one piece)


def plan_chunks(
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunks: Sequence[int],
    pieces: Sequence[tuple[Index, np.ndarray]],
) -> list[tuple[str, list[Part]]] | None:
    """(chunk key, the parts of this process's pieces that fill it) for every chunk they touch.

    A chunk may take parts of several pieces (chunks larger than shards: the chunk shape does
    not depend on the mesh), but together they must fill it: returns None when some chunk is
    shared with another process's pieces (TensorStore must merge it), or the array is 0-d, empty
    or of a dtype this writer does not encode.
    """
    if not shape or 0 in shape or dtype.name not in DTYPES or dtype.byteorder == ">":
        return None
    by_chunk: dict[tuple[int, ...], list[Part]] = {}
    for index, piece in pieces:
        for pos, in_chunk, in_piece in chunk_overlaps(index, chunks):
            by_chunk.setdefault(pos, []).append((in_chunk, piece[in_piece]))
    out = []
    for pos, parts in by_chunk.items():
        # Pieces with replica_id == 0 never overlap, so volumes add up.
        filled = sum(math.prod(s.stop - s.start for s in dst) for dst, _ in parts)
        valid = math.prod(min(c, d - i * c) for i, c, d in zip(pos, chunks, shape))
        if filled != valid:
            return None
        out.append((chunk_key(pos), parts))
    return out


def _chunk_bytes(parts: Sequence[Part], chunks: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """The chunk's encoded data: the piece's own memory when one part is a whole C-order chunk,
    else a new buffer the parts are copied into."""
    chunks = tuple(chunks)
    if len(parts) == 1 and parts[0][1].shape == chunks and parts[0][1].flags.c_contiguous:
        return parts[0][1]
    filled = sum(math.prod(s.stop - s.start for s in dst) for dst, _ in parts)
    # Edge chunks are stored at full size, padded with the fill value (0).
    buf = np.empty(chunks, dtype) if filled == math.prod(chunks) else np.zeros(chunks, dtype)
    for dst, view in parts:
        buf[dst] = view
    return buf


def _write_file(path: str, parts: Sequence[Any], sync: bool) -> float:
    """Writes `parts` to a new file (one `writev`); returns the seconds its fsync took."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        total, done = sum(v.nbytes for v in views), os.writev(fd, views)
        if done < total:  # a short write (rare on local files): finish piece by piece
            rest = b"".join(bytes(v) for v in views)[done:]
            while rest:
                rest = rest[os.write(fd, rest) :]
        t0 = time.perf_counter()
        if sync:
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def write_metadata(path: str, shape: tuple[int, ...], dtype: np.dtype, chunks, crc: bool) -> None:
    """Writes `zarr.json` atomically (tmp + rename): another process's TensorStore may be
    creating the same array at the same moment, with identical content."""
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".zarr.json.{os.getpid()}.tmp")
    _write_file(tmp, [_metadata_bytes(tuple(shape), dtype.name, tuple(chunks), crc)], True)
    os.replace(tmp, os.path.join(path, "zarr.json"))


def write_chunk(
    path: str, key: str, parts: Sequence[Part], chunks, dtype: np.dtype, crc: bool
) -> tuple[float, ...]:
    """Encodes, writes and fsyncs one chunk file; returns (bytes written, seconds preparing,
    writing, fsyncing)."""
    t0 = time.perf_counter()
    # Bytes, not elements: buffer views of ml_dtypes (bfloat16) are refused by memoryview.
    data = _chunk_bytes(parts, chunks, dtype).reshape(-1).view(np.uint8)
    parts = [data]
    if crc:  # crc32c releases the GIL on large buffers, so threads checksum in parallel
        parts.append(crc32c.crc32c(data).to_bytes(4, "little"))
    t1 = time.perf_counter()
    fsync_s = _write_file(os.path.join(path, key), parts, sync=True)
    nbytes = sum(len(p) for p in parts)
    return nbytes, t1 - t0, time.perf_counter() - t1 - fsync_s, fsync_s


def chunk_dirs(path: str, keys: Sequence[str]) -> list[str]:
    """The directories holding `keys` under `path`, parents first (created if absent)."""
    dirs = sorted({os.path.join(path, os.path.dirname(k)) for k in keys}, key=len)
    all_dirs: list[str] = []
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        while d != path and d not in all_dirs:
            all_dirs.append(d)
            d = os.path.dirname(d)
    return sorted(set(all_dirs), key=len)
