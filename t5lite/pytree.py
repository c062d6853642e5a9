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
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not leaves:
        return jnp.ones([0], bool)
    # One plain read per array: a sum is finite only if every element is (a NaN or inf makes
    # it NaN or inf). XLA:CPU fuses a bare sum into one pass; `sum(x * 0)` or
    # `all(isfinite(x))` first write a temporary of the array's size. Finite elements whose sum
    # overflows make a sum inf too, so only then, under the `cond`, each array is checked
    # element by element: the flags are exact and the common case costs one read.
    quick = jnp.stack([jnp.isfinite(jnp.sum(x)) for x in leaves])
    return jax.lax.cond(
        jnp.all(quick),
        lambda: quick,
        lambda: jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]),
    )
