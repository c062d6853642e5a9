"""Where model code states a layout, in logical names only: `constrain`, `weight`, `dense`,
`dot_general`, `einsum`, `take` and `whole`.

Model code (`t5lite/model/`) never imports the partitioning layer, and the partitioning layer
never imports model code; this module is the one point they share. With no layout installed
(outside a partitioner, or under an Auto-axis one) each function is exactly what it replaces:
Flax's `nn.with_logical_constraint` (resolved by the `nn.logical_axis_rules` in force),
`jax.lax.dot_general`, `jnp.einsum`, `jnp.take`, and the partitioner (GSPMD / Shardy)
propagates the rest, so an Auto-axis program is the same program as before this module existed.

On Explicit mesh axes every array's sharding is part of its type, `with_sharding_constraint`
only asserts, and a contraction over a sharded dimension or a gather from a sharded table needs
its output sharding spelled out. A `Partitioner(shard_mode='explicit')` installs a `Layout`
for the duration of its `context()`, and these functions hand their operands to it
(`t5lite.partitioning.explicit` decides: `jax.sharding.reshard`, `out_sharding=`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
LogicalAxes = Sequence[str | None]


class Layout(Protocol):
    """What an installed layout provides; see `t5lite.partitioning.explicit.ExplicitLayout`."""

    def constrain(self, x: Array, logical_axes: LogicalAxes) -> Array: ...

    def dot_general(
        self, lhs: Array, rhs: Array, dimension_numbers: Any, **kwargs: Any
    ) -> Array: ...

    def einsum(self, subscripts: str, lhs: Array, rhs: Array, **kwargs: Any) -> Array: ...

    def take(self, table: Array, indices: Array) -> Array: ...

    def whole(self, x: Array) -> Array: ...

    def weight(self, x: Array) -> Array: ...


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar(
    "t5lite_layout", default=None
)


@contextlib.contextmanager
def installed(layout: Layout | None) -> Iterator[None]:
    """Model code traced inside this block states its layouts through `layout`."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def layout_installed() -> bool:
    """Whether a layout (Explicit axes) states array shardings: `collectives` then leaves the
    weights to `weight` (which gathers them per use there) rather than gathering them itself."""
    return _LAYOUT.get() is not None


def constrain(x: Array, logical_axes: LogicalAxes) -> Array:
    """`x` laid out as its logical axes say under the rules in force (one name per dimension)."""
    layout = _LAYOUT.get()
    if layout is None:
        return nn.with_logical_constraint(x, tuple(logical_axes))
    return layout.constrain(x, tuple(logical_axes))


def weight(x: Array) -> Array:
    """A parameter as read for use. With no layout installed `x` itself (the partitioner
    gathers what it must); on Explicit axes, gathered over the mesh axes the batch is split on
    (2D/FSDP tables shard parameters over `data` for storage, ZeRO-3: gathered per use, their
    gradients reduce-scattered back)."""
    layout = _LAYOUT.get()
    return x if layout is None else layout.weight(x)


def dot_general(lhs: Array, rhs: Array, dimension_numbers: Any, **kwargs: Any) -> Array:
    """`jax.lax.dot_general`; on Explicit axes with operand shardings made compatible."""
    layout = _LAYOUT.get()
    if layout is None:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    return layout.dot_general(lhs, rhs, dimension_numbers, **kwargs)


def dense(inputs: Array, kernel: Array, n_in: int) -> Array:
    """The trailing `n_in` dims of `inputs` contracted with the leading `n_in` of `kernel`
    (a dense layer: output dims are the kernel's others, appended).

    On one device (no mesh, or a mesh of one) this is one 2-D matmul [tokens, in] x [in, out]
    (merging contiguous dims is free): its weight gradient is then a plain
    [tokens, in]^T x [tokens, out] dot, where contracting batch and length as two dims makes
    XLA:CPU copy every activation gradient transposed first (17% of the T5.1.1-small train
    step, benchmarks/train_throughput.py). On a sharded mesh the dims stay as they are: merging
    a sharded batch with length made the partitioner gather twice the 2D-tensor-parallel input
    and replicate more under context parallelism (tests/test_layouts.py), and a reshape merging
    sharded dims cannot always be typed on Explicit axes. Inside a pipeline stage of one device
    (a `shard_map` manual over the stage axes, the partitioner's other axes all of size 1) the
    stage's program is a one-device program and merges too: kept 3-D there, the weight
    gradients' transposed copies were a fifth of GPipe's step on XLA:CPU (docs/pipeline.md)."""
    lead = inputs.ndim - n_in
    contract = ((tuple(range(lead, inputs.ndim)), tuple(range(n_in))), ((), ()))
    layout = _LAYOUT.get()
    if layout is not None:
        return layout.dot_general(inputs, kernel, contract)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and not _one_device_stage(mesh):
        return jax.lax.dot_general(inputs, kernel, contract)
    k_in = math.prod(inputs.shape[lead:])
    out = kernel.shape[n_in:]
    y = jax.lax.dot_general(
        inputs.reshape(-1, k_in), kernel.reshape(k_in, math.prod(out)), (((1,), (0,)), ((), ()))
    )
    return y.reshape(inputs.shape[:lead] + out)


def _one_device_stage(mesh: Any) -> bool:
    """Whether `mesh` is seen from a `shard_map` manual over some of its axes (a pipeline
    stage's) that leaves the partitioner only axes of size 1: one device to lay out."""
    auto = [n for a, n in mesh.shape.items() if a not in mesh.manual_axes]
    return bool(mesh.manual_axes) and bool(auto) and math.prod(auto) == 1


def einsum(subscripts: str, lhs: Array, rhs: Array, **kwargs: Any) -> Array:
    """Two-operand `jnp.einsum`; on Explicit axes with operand shardings made compatible."""
    layout = _LAYOUT.get()
    if layout is None:
        return jnp.einsum(subscripts, lhs, rhs, **kwargs)
    return layout.einsum(subscripts, lhs, rhs, **kwargs)


def take(table: Array, indices: Array) -> Array:
    """Rows of `table` [N, ...] at integer `indices` [...] (`jnp.take(table, indices, axis=0)`)."""
    layout = _LAYOUT.get()
    if layout is None:
        return jnp.take(table, indices, axis=0)
    return layout.take(table, indices)


def whole(x: Array) -> Array:
    """`x` whole on every device where shardings are types (Explicit axes), for the small
    bookkeeping arrays (e.g. per-sequence token counts) of an op JAX cannot type from sharded
    operands; with no layout installed `x` itself: the partitioner places it."""
    layout = _LAYOUT.get()
    return x if layout is None else layout.whole(x)
