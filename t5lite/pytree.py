"""Key paths as text: the one spelling of a parameter's name (`encoder/layers_0/mlp/wi/kernel`).

Checkpoints name their arrays with it and every error message and report names parameters with
it, so a path read in a message can be looked up in `metadata.json` as it is. Also the one
finiteness check of a tree's arrays, shared by the train step and checkpoint restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def key_str(k: Any) -> str:
    """One component of a JAX key path as text (dict key, attribute name or list index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path: Sequence[Any]) -> str:
    """A JAX key path as a '/'-joined string, e.g. `params/mlp/wi/kernel`."""
    return "/".join(key_str(k) for k in path)


def finite_by_array(tree: Any) -> jax.Array:
    """A bool vector, one entry per floating-point leaf of `tree` in tree order (see
    `t5lite.trainer.inexact_leaf_paths`): every element of that leaf is finite."""
    # One fused reduction per array: x * 0 is 0 where x is finite and NaN where it is not (inf
    # too), and a sum keeps a NaN. `all(isfinite(x))` first writes a bool array on XLA:CPU
    # (about 1% of the T5.1.1-small train step).
    flags = [
        jnp.isfinite(jnp.sum(x * 0, dtype=jnp.float32))
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.stack(flags) if flags else jnp.ones([0], bool)
