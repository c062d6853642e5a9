"""Direct zarr3 chunk reads: the restore's fast path, the mirror of `zarr_writer`.

Why not TensorStore for the reads: with the `crc32c` codec it decodes every chunk into a buffer
of its own, checksums it there and copies it again into the destination, all on a few threads
of a shared pool, so checksums slow a restore down (docs/performance.md has the figures).
Here each chunk file is read once, with one `preadv`, straight into the destination shard's
memory wherever the chunk is one contiguous block of it (else into a scratch buffer the chunk's
part is copied out of), and its crc32c is computed over those same bytes by the thread that
read them (the `crc32c` package releases the GIL on large buffers, so threads checksum in
parallel).

Only the format `zarr_writer` and TensorStore write for t5lite is read here (`bytes` little
endian, optionally followed by `crc32c`, regular grid, default `c/i/j` keys, full-size edge
chunks); `array_info` returns None for anything else (another codec, 0-d or empty arrays,
unknown metadata), which `tensorstore_io.read_arrays` then reads through TensorStore. A missing,
truncated or corrupt chunk is a ValueError naming the chunk file, as TensorStore's would be.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Sequence

import crc32c
import jax.numpy as jnp
import numpy as np

from t5lite.checkpoint.zarr_format import DTYPES, Index, chunk_key, chunk_overlaps

# Buffers one `preadv` takes (Linux's IOV_MAX); a chunk made of more blocks is read in batches.
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16

# `zarr.json` keys that do not change how chunk bytes decode.
_INERT_KEYS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "codecs",
    "chunk_key_encoding",
    "fill_value",
    "attributes",
    "dimension_names",
}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What decoding one stored array's chunks needs."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    crc: bool

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize


def array_info(path: str) -> ArrayInfo | None:
    """Parses `path/zarr.json`; None when the array is not in the format read here (or the file
    cannot be read: TensorStore then reports why)."""
    try:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            meta = json.loads(f.read())
        if set(meta) - _INERT_KEYS or meta.get("zarr_format") != 3:
            return None
        if meta.get("node_type") != "array" or meta["data_type"] not in DTYPES:
            return None
        grid = meta["chunk_grid"]
        keys = meta.get("chunk_key_encoding", {"name": "default"})
        if grid["name"] != "regular" or keys.get("name") != "default":
            return None
        if keys.get("configuration", {}).get("separator", "/") != "/":
            return None
        dtype = np.dtype(jnp.dtype(meta["data_type"]))
        codecs = meta["codecs"]
        if not codecs or codecs[0].get("name") != "bytes":
            return None
        endian = codecs[0].get("configuration", {}).get("endian")
        if endian != "little" and not (endian is None and dtype.itemsize == 1):
            return None
        crc = codecs[1:] == [{"name": "crc32c"}]
        if len(codecs) > 1 and not crc:
            return None
        shape = tuple(int(d) for d in meta["shape"])
        chunks = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
        if not shape or 0 in shape or len(chunks) != len(shape) or min(chunks) < 1:
            return None
        return ArrayInfo(path, shape, dtype, chunks, crc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclasses.dataclass
class ChunkRead:
    """One chunk file, and where its part of `index` goes in `dest` (a buffer of that range)."""

    info: ArrayInfo
    key: str
    src: tuple[slice, ...]  # the part, in chunk coordinates
    dst: tuple[slice, ...]  # the same part, in `dest` coordinates
    dest: np.ndarray
    direct: bool  # the part is the whole chunk: read straight into `dest`
    check_finite: bool = False  # also say whether the placed values are all finite


def finite_checkable(dtype: np.dtype) -> bool:
    """Whether `all_finite` checks this dtype (others are left to the caller's own check)."""
    return dtype in (np.float16, np.float32, np.float64) or dtype == jnp.bfloat16


def all_finite(x: np.ndarray) -> bool:
    """No NaN or Inf in `x` (a dtype `finite_checkable` accepts)."""
    if x.dtype == jnp.bfloat16:
        # ml_dtypes' isfinite loops element by element, far slower than numpy's: test the
        # exponent bits, all ones exactly for Inf and NaN.
        u = x.view(np.uint16)
        return not bool(np.any(np.bitwise_and(u, 0x7F80) == 0x7F80))
    return bool(np.isfinite(x).all())


def plan_reads(
    info: ArrayInfo, index: Index, dest: np.ndarray, check_finite: bool = False
) -> list[ChunkRead]:
    """The chunk reads that fill `dest` (C-order, shape of `index`) with the array's `index`;
    with `check_finite`, each also checks the values it places (see `read_chunk`)."""
    out = []
    for pos, src, dst in chunk_overlaps(index, info.chunks):
        # Direct when the part is the whole chunk (not clipped by the range or padded at the
        # array's edge): it is read straight into `dest`.
        direct = tuple(s.stop - s.start for s in src) == info.chunks
        out.append(ChunkRead(info, chunk_key(pos), src, dst, dest, direct, check_finite))
    return out


def _runs(region: np.ndarray) -> list[np.ndarray]:
    """`region` (a view into a C-order array) as the contiguous blocks it is made of, in C
    order: one per index of its leading dimensions, as few of them as make each block
    contiguous."""
    lead = next(i for i in range(region.ndim + 1) if region[(0,) * i].flags.c_contiguous)
    return [region[idx].reshape(-1) for idx in np.ndindex(*region.shape[:lead])]


# Per reader thread, a scratch buffer for chunks read whole and copied out in part: fresh
# memory for each would cost a page fault per 4 KiB again and again.
_scratch = threading.local()


def _scratch_bytes(n: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < n:
        buf = _scratch.buf = np.empty(n, np.uint8)
    return buf[:n]


def read_chunk(r: ChunkRead) -> tuple[float, float, float, float, bool]:
    """Reads, verifies and places one chunk; returns seconds (reading, checksumming, copying,
    checking finiteness) and whether the placed values are all finite (True unless
    `r.check_finite`): checked here, while the chunk is in this core's cache, at a fraction of
    a second pass over the restored arrays.

    A whole chunk is read straight into its place in `dest` (one `preadv` with a buffer per
    contiguous block of it, e.g. a row of a chunk narrower than its shard), the rest into a
    scratch buffer and copied out.

    Raises:
      ValueError: the chunk file is missing, has the wrong size, or fails its checksum.
    """
    info, name = r.info, os.path.join(r.info.path, r.key)
    n = info.chunk_nbytes
    t0 = time.perf_counter()
    region = r.dest[r.dst] if r.direct else None
    # Bytes, not elements: buffer views of ml_dtypes (bfloat16) are refused by memoryview.
    runs = [b.view(np.uint8) for b in _runs(region)] if r.direct else [_scratch_bytes(n)]
    tail = bytearray(4 if info.crc else 0)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError(f"chunk {name} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != n + len(tail):
            raise ValueError(
                f"chunk {name} has {size} bytes, expected {n + len(tail)} (truncated or not a "
                "t5lite chunk)"
            )
        views, got = [memoryview(b) for b in runs] + [memoryview(tail)], 0
        while got < size:  # short reads (rare on local files), or more buffers than IOV_MAX
            done = os.preadv(fd, _skip(views, got)[:_IOV_MAX], got)
            if done == 0:
                raise ValueError(f"chunk {name} is truncated (file shrank while read)")
            got += done
    finally:
        os.close(fd)
    t1 = time.perf_counter()
    if info.crc:
        computed = 0
        for b in runs:
            computed = crc32c.crc32c(b, computed)
        stored = int.from_bytes(tail, "little")
        if stored != computed:
            raise ValueError(
                f"chunk {name}: crc32c digest mismatch (stored {stored:#010x}, computed "
                f"{computed:#010x}): the file is corrupt"
            )
    t2 = time.perf_counter()
    if r.direct:
        part = region
    else:
        part = runs[0].view(info.dtype).reshape(info.chunks)[r.src]
        r.dest[r.dst] = part
    t3 = time.perf_counter()
    finite = all_finite(part) if r.check_finite else True
    return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, finite


def _skip(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """`views` without their first `n` bytes."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out
