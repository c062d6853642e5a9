"""Restore: one committed checkpoint directory onto a target's shardings.

The counterpart of `CheckpointManager.save`; raw array reads live in `tensorstore_io.py` (and
its direct chunk reader, `zarr_reader.py`), the on-disk layout in `layout.py`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from t5lite.checkpoint import layout
from t5lite.checkpoint import tensorstore_io as tsio
from t5lite.checkpoint.checks import check_finite, checked_target, missing_array
from t5lite.checkpoint.layout import CheckpointError, read_metadata


def restore_checkpoint(
    path: str | os.PathLike,
    target: Any = None,
    *,
    with_extra: bool = True,
    strict: bool = True,
    assignment_map: Sequence[tuple[str, str | None]] | None = None,
    params_only: bool = False,
    params_key: str = "params",
    concurrency: int = 128,
    allow_non_finite: bool = False,
    stats: dict[str, float] | None = None,
) -> tuple[Any, dict | None]:
    """Restores one committed checkpoint directory onto the shardings of `target`.

    Args:
      path: a committed `checkpoint_<step>` directory.
      target: tree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (abstract) or arrays
        (concrete: their values are the fresh initialisation used where nothing is restored).
        Leaves with a sharding come back as global jax.Arrays with that sharding, on any mesh and
        process count; leaves without one (numpy, sharding=None) as numpy arrays. Stored floats
        are cast to the target dtype. None: a nested dict of numpy arrays, as stored.
      with_extra: also return the JSON state saved with the arrays (`save`'s `extra`).
      strict: a target leaf missing from the checkpoint is an error; otherwise it keeps its
        concrete target value (fresh initialisation).
      assignment_map: (regex, replacement) pairs; the first regex that fully matches a target
        path maps it to `re.sub(regex, replacement, path)` in the checkpoint, or, with None,
        keeps the target's value. Paths are '/'-joined keys, e.g. 'params/encoder/wi/kernel'.
      params_only: restore only leaves under `params_key`; the rest keep their target values and
        the extra state is not returned (fine-tuning from a pretrained checkpoint).
      params_key: first path component of the parameters.
      concurrency: TensorStore I/O concurrency.
      allow_non_finite: restore arrays holding NaN or Inf (by default an error naming the first
        such array: a diverged state is not something to resume or evaluate by accident).
      stats: when given, filled with where the time went: `tsio.read_arrays`'s phases, and
        `finite_check_s` (the NaN/Inf verdict, and the check of arrays the reader did not check).

    Returns:
      (state with the structure of `target`, extra dict or None).

    Raises:
      CheckpointError: naming the array, for any missing, corrupt or mismatching input.
    """
    p = Path(path)
    meta = read_metadata(p)
    arrays = meta["arrays"]
    ctx = tsio.make_context(concurrency)

    # Per restored array: found all finite by the reader (None: to be checked afterwards).
    finite: list[bool | None] | None = None if allow_non_finite else []

    def read(requests: list[tuple[str, tuple, Any, Any]]) -> list[Any]:
        items = [(str(p / "arrays" / arrays[src]["dir"]), s, d, sh) for src, s, d, sh in requests]
        try:
            return tsio.read_arrays(items, ctx, stats=stats, finite=finite)
        except ValueError:
            if finite is not None:
                finite[:] = [None] * len(requests)
        # Re-read one at a time to name the culprit (errors are rare; clarity beats speed here).
        out = []
        for (src, *_), item in zip(requests, items):
            try:
                out.extend(tsio.read_arrays([item], ctx))
            except ValueError as e:
                raise CheckpointError(f"checkpoint {p}: array '{src}' cannot be read: {e}") from e
        return out

    if target is None:
        paths = list(arrays)
        values = read(
            [(a, tuple(arrays[a]["shape"]), np.dtype(arrays[a]["dtype"]), None) for a in paths]
        )
        if not allow_non_finite:
            _timed_check_finite(p, paths, values, finite, stats)
        by_path = dict(zip(paths, values))
        tree = jax.tree_util.tree_map(lambda a: by_path[a], meta["tree"])
        return tree, layout.read_extra(p) if with_extra else None

    leaves, treedef = layout.flatten(target)
    rules = [(re.compile(r), repl) for r, repl in (assignment_map or [])]
    requests, slots, out = [], [], []
    for tpath, leaf in leaves:
        src: str | None = tpath
        for rx, repl in rules:
            if rx.fullmatch(tpath):
                src = None if repl is None else rx.sub(repl, tpath)
                break
        skip = params_only and tpath.split("/")[0] != params_key
        if src is not None and not skip and src not in arrays and strict:
            raise missing_array(p, src, tpath)
        if src is None or skip or src not in arrays:
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise CheckpointError(
                    f"checkpoint {p}: target '{tpath}' is not restored (missing or excluded) "
                    "and has no initial value; pass a concrete array for it in `target`"
                )
            out.append(leaf)
            continue
        shape, dtype = checked_target(p, src, arrays[src], tpath, leaf)
        requests.append((src, shape, dtype, getattr(leaf, "sharding", None)))
        slots.append(len(out))
        out.append(None)
    values = read(requests)
    if not allow_non_finite:
        _timed_check_finite(p, [src for src, *_ in requests], values, finite, stats)
    for i, v in zip(slots, values):
        out[i] = v
    state = jax.tree_util.tree_unflatten(treedef, out)
    return state, (layout.read_extra(p) if with_extra and not params_only else None)


def _timed_check_finite(
    p: Path,
    names: list[str],
    values: list[Any],
    known: list[bool | None] | None,
    stats: dict | None,
) -> None:
    t0 = time.perf_counter()
    check_finite(p, names, values, known or None)
    if stats is not None:
        stats["finite_check_s"] = time.perf_counter() - t0
