"""The on-disk array format, shared by the writers and readers (a leaf: imports no sibling).

One checkpoint array is a plain zarr v3 array, readable with `tensorstore` alone:
  - driver `zarr3`, codecs `bytes` (little endian, uncompressed) + `crc32c` (a checksum per chunk,
    so a flipped bit or a truncated chunk is an error instead of silently wrong weights);
  - chunk shape derived from the array's shape and dtype only (see `chunk_shape_for`), never from
    the mesh, so any mesh can read what any other mesh wrote;
  - a regular chunk grid with the default `c/i/j` keys (`chunk_key`), edge chunks stored at full
    size, padded with the fill value (0);
  - every chunk is written: readers open with `fill_missing_data_reads=False`, so a deleted chunk
    file is an error rather than a block of zeros.

    >>> ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": ".../arrays/params.w"}})
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

Index = tuple[tuple[int, int], ...]  # per dimension [start, stop)

# Dtypes whose in-memory little-endian bytes are exactly zarr3's encoding of them: the ones the
# direct chunk writer and reader handle (TensorStore handles the rest).
DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
    }
)

# Chunks of at most 4 MiB: large enough that per-file costs stay small against disk bandwidth,
# small enough (and square enough, see `chunk_shape_for`) that the shards of common meshes are
# whole numbers of chunks, so no chunk is read-modified-written on save or over-read on restore.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


def chunk_shape_for(
    shape: Sequence[int], itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[int]:
    """A mesh-independent chunk shape: halve the largest dimension until a chunk fits.

    Even dimensions are halved first, so for power-of-two shard counts every shard boundary is
    also a chunk boundary (no two processes ever write the same chunk).

    Args:
      shape: array shape.
      itemsize: bytes per element.
      target_bytes: upper bound on one chunk's size (unless a single element row exceeds it).

    Returns:
      The chunk shape, one entry ≥ 1 per dimension.
    """
    chunk = [max(1, int(d)) for d in shape]
    while int(np.prod(chunk, dtype=np.int64)) * itemsize > target_bytes:
        even = [i for i, c in enumerate(chunk) if c > 1 and c % 2 == 0]
        odd = [i for i, c in enumerate(chunk) if c > 1]
        if not odd:
            break
        i = max(even or odd, key=lambda j: chunk[j])
        chunk[i] = (chunk[i] + 1) // 2
    return chunk


def array_spec(path: str, shape: Sequence[int] | None = None, dtype: Any = None, **kw) -> dict:
    """The TensorStore spec of one checkpoint array at directory `path`.

    Args:
      path: local directory of the array.
      shape: when given (with `dtype`), the spec creates the array with a derived chunk shape.
      dtype: numpy-compatible dtype of the array to create.
      **kw: `chunk_bytes` to override `DEFAULT_CHUNK_BYTES`; `checksum=False` to drop the crc32c
        codec (faster on slow CPUs; a flipped bit then goes undetected).

    Returns:
      A JSON spec for `ts.open`.
    """
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "fill_missing_data_reads": False,
        # NOTE: zarr skips chunks equal to the fill value (all zeros) by default; since a missing
        # chunk is an error on read, such chunks must be stored too (fresh optimizer state,
        # zero biases).
        "store_data_equal_to_fill_value": True,
    }
    if shape is not None:
        dt = np.dtype(dtype)
        chunks = chunk_shape_for(shape, dt.itemsize, kw.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        spec["metadata"] = {
            "shape": list(shape),
            "data_type": dt.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]
            + ([{"name": "crc32c"}] if kw.get("checksum", True) else []),
        }
    return spec


def shard_ranges(idx: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """Turns a shard's tuple of slices into concrete [start, stop) pairs."""
    out = []
    for s, d in zip(idx, shape):
        start, stop, _ = s.indices(d)
        out.append((start, stop))
    return tuple(out)


def chunk_key(pos: Sequence[int]) -> str:
    """The file of the chunk at grid position `pos`, relative to the array's directory."""
    return "c/" + "/".join(map(str, pos))


def chunk_overlaps(
    index: Index, chunks: Sequence[int]
) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]]:
    """For every chunk that the range `index` touches: (grid position, the overlap in the
    chunk's coordinates, the same overlap in the coordinates of a buffer holding `index`)."""
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(index, chunks)]
    for pos in itertools.product(*ranges):
        # The overlap of chunk `pos` and the range, in array coordinates.
        lo = [max(i * c, a) for i, c, (a, _) in zip(pos, chunks, index)]
        hi = [min((i + 1) * c, b) for i, c, (_, b) in zip(pos, chunks, index)]
        in_chunk = tuple(slice(x - i * c, y - i * c) for x, y, i, c in zip(lo, hi, pos, chunks))
        in_range = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, index))
        yield pos, in_chunk, in_range
