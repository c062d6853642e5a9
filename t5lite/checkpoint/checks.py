"""What a restore refuses: arrays that do not fit the target, and non-finite values."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5lite import distributed
from t5lite.checkpoint import layout
from t5lite.checkpoint.layout import CheckpointError
from t5lite.pytree import finite_by_array


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    if src == dst:
        return True
    # Only float <-> float casts (fp32 -> bf16 parameters); anything else is a wrong target.
    return jax.dtypes.issubdtype(src, np.floating) and jax.dtypes.issubdtype(dst, np.floating)


def check_finite(
    p: Path,
    names: Sequence[str],
    values: Sequence[Any],
    known: Sequence[bool | None] | None = None,
) -> None:
    """Raises CheckpointError naming the first restored array that holds NaN or Inf.

    Args:
      p: the checkpoint directory (for the message).
      names: the arrays' paths in the checkpoint.
      values: the restored arrays.
      known: per array, whether this process's part of it was already found all finite (the
        restore's reader checks chunks as they land), or None to check it here. With several
        processes the known flags are combined across processes first, so every process
        reaches the same verdict.
    """
    known = list(known) if known is not None else [None] * len(values)
    if jax.process_count() > 1 and any(k is not None for k in known):
        # Which entries are known is the same on every process (it depends on the stored
        # format and dtypes only); their verdicts are not.
        local = np.array([k is not False for k in known])
        every = distributed.host_allgather(local)
        known = [None if k is None else bool(ok) for k, ok in zip(known, every.all(axis=0))]
    floats = [
        (n, v, k) for n, v, k in zip(names, values, known) if jnp.issubdtype(v.dtype, jnp.inexact)
    ]
    on_device = [v for _, v, k in floats if isinstance(v, jax.Array) and k is None]
    # One jitted reduction per array on its own shards; only the booleans reach the host.
    flags = iter(jax.device_get(_finite_flags(on_device)) if on_device else [])
    for name, v, k in floats:
        if k is not None:
            ok = k
        elif isinstance(v, jax.Array):
            ok = bool(next(flags))
        else:
            ok = bool(np.isfinite(v).all())
        if not ok:
            raise CheckpointError(
                f"checkpoint {p}: array '{name}' holds NaN or Inf (a diverged run?); restore an "
                "earlier checkpoint, or pass allow_non_finite=True to read it anyway"
            )


# The train step's check (one fused reduction per array), jitted here on its own.
_finite_flags = jax.jit(finite_by_array)


def checked_target(
    p: Path, src: str, info: dict, tpath: str, leaf: Any
) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a stored array is read as, or an error naming both sides."""
    # Python scalars in the target (e.g. a step counter) restore as numpy scalars.
    shape = tuple(np.shape(leaf))
    dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
    if tuple(info["shape"]) != shape:
        raise CheckpointError(
            f"checkpoint {p}: array '{src}' has shape {tuple(info['shape'])}, "
            f"target '{tpath}' expects {shape}"
        )
    if not _castable(np.dtype(info["dtype"]), dtype):
        raise CheckpointError(
            f"checkpoint {p}: array '{src}' has dtype {info['dtype']}, target '{tpath}' "
            f"expects {dtype}; only float-to-float casts are done on restore"
        )
    return shape, dtype


def missing_array(p: Path, src: str, tpath: str) -> CheckpointError:
    """The error for a target leaf whose array the checkpoint lacks."""
    return CheckpointError(
        f"checkpoint {p}: array '{src}' (for target '{tpath}') is missing; "
        "pass strict=False to keep fresh initialisation for missing parameters"
    )


def check_against_metadata(path: str | Path, target: Any, params_only: bool = False) -> None:
    """Compares a checkpoint's `metadata.json` with a target's shapes and dtypes, reading no
    array: a checkpoint that cannot restore onto the model fails in seconds, before anything
    is built, initialised or compiled. Raises the CheckpointError a restore would."""
    p = Path(path)
    arrays = layout.read_metadata(p)["arrays"]
    for tpath, leaf in layout.flatten(target)[0]:
        if params_only and tpath.split("/")[0] != "params":
            continue
        if tpath not in arrays:
            raise missing_array(p, tpath, tpath)
        checked_target(p, tpath, arrays[tpath], tpath, leaf)
