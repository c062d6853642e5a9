"""The KV cache a decode starts from: zeros laid out like the activations, and the per-row
index a prefilled prompt resumes at."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.core import meta

from t5lite import constraints

Array = jax.Array
PyTree = Any


def zero_cache(create: Any) -> PyTree:
    """A zero KV cache shaped by `create()` (a decode=True apply; traced, never run).

    Each array is constrained to its logical axes, so the cache is born sharded like the
    activations (batch over data, heads over model) under the partitioner's rules.
    """
    _, variables = jax.eval_shape(create)
    boxed = variables["cache"]

    def zeros(x: Any) -> Array:
        if isinstance(x, meta.Partitioned):
            return constraints.constrain(jnp.zeros(x.value.shape, x.value.dtype), x.names)
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree.map(zeros, boxed, is_leaf=lambda x: isinstance(x, meta.Partitioned))


def set_cache_index(cache: PyTree, index_B: Array) -> PyTree:
    """Sets every `cache_index` leaf ([B] or [B, layers]) to the per-row `index_B`."""

    def one(path: tuple[Any, ...], x: Array) -> Array:
        if getattr(path[-1], "key", None) != "cache_index":
            return x
        idx = index_B.astype(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return jnp.broadcast_to(idx, x.shape)

    return jax.tree_util.tree_map_with_path(one, cache)
