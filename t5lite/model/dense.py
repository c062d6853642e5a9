"""Dense layers: `DenseGeneral` (one kernel) and `DenseGroup` (several kernels, one input).

Each computes its output. How the contraction is parallelised (plain, the partitioner's
Megatron column/row, ZeRO-3, sequence parallelism, Explicit axes) is the one strategy
`t5lite.collectives.select_strategy` picks from the rules, the mesh and the input's logical
axes; the layer passes those axes and runs `collectives.contract`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t5lite import collectives, constraints

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _canonicalize_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


def _normalize_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


def _kernel(
    module: nn.Module,
    in_shape: tuple[int, ...],
    features: tuple[int, ...],
    kernel_axes: tuple[str, ...],
    kernel_init: Initializer,
    param_dtype: DType,
    dtype: DType,
) -> Array:
    """`module`'s parameter `kernel` [*in_shape, *features], read for use in `dtype`."""
    n_in = len(in_shape)
    if len(kernel_axes) != n_in + len(features):
        raise ValueError(f"kernel_axes {kernel_axes} do not match {in_shape}+{features}")

    def init(key, shape, dtype):
        # Fan-in/out over flattened contracted/output dims, as for a 2D kernel.
        flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
        return kernel_init(key, flat, dtype).reshape(shape)

    kernel = module.param(
        "kernel",
        nn.with_logical_partitioning(init, kernel_axes),
        in_shape + features,
        jnp.dtype(param_dtype),
    )
    return jnp.asarray(constraints.weight(kernel), jnp.dtype(dtype))


class DenseGeneral(nn.Module):
    """A bias-free linear map over one or more input axes, with logical kernel axes.

    Attributes:
      features: output feature shape (int or tuple).
      kernel_axes: logical names of the kernel dims, input dims first then output dims.
      axis: input axes contracted (default last).
      input_axes: logical names of the input's dims; with them the contraction runs the
        strategy `collectives.select_strategy` picks (None: the partitioner lays it out).
      dtype: computation dtype of the activations.
      param_dtype: storage dtype of the kernel.
      kernel_init: initializer of the kernel (fan-in computed over all contracted dims).
    """

    features: int | Sequence[int]
    kernel_axes: tuple[str, ...]
    axis: int | Sequence[int] = -1
    input_axes: tuple[str | None, ...] | None = None
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    kernel_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Contracts `axis` of `inputs` with the kernel: [*rest, *in] -> [*rest, *features]."""
        axis = _normalize_axes(_canonicalize_tuple(self.axis), inputs.ndim)
        n_in = len(axis)
        trailing = tuple(range(inputs.ndim - n_in, inputs.ndim))
        input_axes = self.input_axes
        if axis != trailing:  # the strategies contract trailing dims
            inputs = jnp.moveaxis(inputs, axis, trailing)
            if input_axes is not None:
                rest = [a for i, a in enumerate(input_axes) if i not in axis]
                input_axes = (*rest, *(input_axes[i] for i in axis))
        features = _canonicalize_tuple(self.features)
        kernel = _kernel(
            self,
            inputs.shape[-n_in:],
            features,
            self.kernel_axes,
            self.kernel_init,
            self.param_dtype,
            self.dtype,
        )
        inputs = jnp.asarray(inputs, jnp.dtype(self.dtype))
        (y,) = collectives.contract(inputs, input_axes, [(kernel, self.kernel_axes)], n_in)
        return y


@dataclasses.dataclass(frozen=True)
class Projection:
    """One kernel of a `DenseGroup`: what a `DenseGeneral` named `name` contracting the input's
    last dim would hold."""

    name: str
    features: int | tuple[int, ...]
    kernel_axes: tuple[str, ...]
    kernel_init: Initializer = default_kernel_init


class _Kernel(nn.Module):
    """The one parameter (`kernel`) of a `DenseGroup` member."""

    projection: Projection
    dtype: DType
    param_dtype: DType

    @nn.compact
    def __call__(self, in_shape: tuple[int, ...]) -> Array:
        p = self.projection
        features = _canonicalize_tuple(p.features)
        return _kernel(
            self, in_shape, features, p.kernel_axes, p.kernel_init, self.param_dtype, self.dtype
        )


class DenseGroup(nn.Module):
    """Several dense kernels that read one input (q, k, v; wi_0, wi_1), one output each.

    They share one contraction strategy, so an input that sequence parallelism gathers by
    position is gathered once for all of them (and its gradients summed before one
    reduce-scatter). The group shares its parent's scope: each kernel sits in the parameter
    tree where a `DenseGeneral` of its name would (`mlp/wi_0/kernel`).

    Attributes:
      projections: the kernels, each contracting the input's last dim.
      input_axes: logical names of the input's dims.
    """

    projections: tuple[Projection, ...]
    input_axes: tuple[str | None, ...]
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32

    def setup(self) -> None:
        if isinstance(self.parent, nn.Module):  # a group applied on its own has nothing above
            nn.share_scope(self, self.parent)

    @nn.compact
    def __call__(self, inputs: Array) -> list[Array]:
        """[..., D] -> one [..., *features] per projection, in order."""
        in_shape = inputs.shape[-1:]
        kernels = [
            (_Kernel(p, self.dtype, self.param_dtype, name=p.name)(in_shape), p.kernel_axes)
            for p in self.projections
        ]
        inputs = jnp.asarray(inputs, jnp.dtype(self.dtype))
        return collectives.contract(inputs, self.input_axes, kernels, 1)
