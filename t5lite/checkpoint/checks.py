"""What a restore refuses: arrays that do not fit the target, and non-finite values."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5lite.checkpoint import layout
from t5lite.checkpoint.layout import CheckpointError


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    if src == dst:
        return True
    # Only float <-> float casts (fp32 -> bf16 parameters); anything else is a wrong target.
    return jax.dtypes.issubdtype(src, np.floating) and jax.dtypes.issubdtype(dst, np.floating)


def check_finite(p: Path, names: Sequence[str], values: Sequence[Any]) -> None:
    """Raises CheckpointError naming the first restored array that holds NaN or Inf."""
    floats = [(n, v) for n, v in zip(names, values) if jnp.issubdtype(v.dtype, jnp.inexact)]
    on_device = [v for _, v in floats if isinstance(v, jax.Array)]
    # One jitted reduction per array on its own shards; only the booleans reach the host.
    flags = iter(jax.device_get(_finite_flags(on_device)) if on_device else [])
    for name, v in floats:
        ok = bool(next(flags)) if isinstance(v, jax.Array) else bool(np.isfinite(v).all())
        if not ok:
            raise CheckpointError(
                f"checkpoint {p}: array '{name}' holds NaN or Inf (a diverged run?); restore an "
                "earlier checkpoint, or pass allow_non_finite=True to read it anyway"
            )


@jax.jit
def _finite_flags(arrays: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(a)) for a in arrays]


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
