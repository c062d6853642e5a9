"""2D (Optimus / SUMMA) and 3D (Colossal-AI) tensor parallelism: the contractions the rules of
`t5lite.partitioning.tensor_mesh` lay out, written as explicit collectives.

Both run one `jax.shard_map` manual over every mesh axis (in/out specs from the rules), selected
by `collectives.select_strategy` as `summa_2d` and `tensor_3d`; model code is unchanged.

`summa_2d` (Xu et al. 2021, arXiv:2104.05343) on a q x q mesh (`tensor_row`, `tensor_col`, and
`data` outside it): activations [batch -> (data, row), features -> col]; every kernel
[in -> row, out -> col] by name (`embed` -> row, `mlp`/`heads`/`vocab` -> col). A kernel stored
that way whose input arrives split over col (q, k, v, wi, logits: SUMMA's C = A B) all-gathers
the input over col and the kernel over row, then multiplies locally; one stored the other way
round (`wo`, `out`: [mlp -> col, embed -> row], SUMMA's C = A B^T, which one rule per name
cannot avoid since `embed` and `mlp` swap places) all-gathers the kernel over row and
reduce-scatters the partial products over col. NOTE: SUMMA broadcasts its blocks again in the
backward pass (6 collectives per layer); here the gathered blocks are kept for it, as 3D keeps
them, so the backward runs 2 (the transposes: reduce-scatters of the input's and kernel's
gradients, or for C = A B^T an all-gather of the output's gradient and a reduce-scatter of the
kernel's): 4 per layer, 2 (q-1)/q^2 of the two gathered operands' elements instead of 3.

`tensor_3d` (Bian et al. 2021, arXiv:2105.14450) on a q x q x q mesh (`tensor_i`, `tensor_j`,
`tensor_l`): processor (i, j, l) holds a 1/q^3 block of the input and of the kernel. The input's
features are split over (c, g) (c the contracted axis, g its sub-split), its batch over i; the
kernel's input dim over c and its output dim over g, sub-split over i. Forward: all-gather the
input over g, the kernel over i, multiply, reduce-scatter the partial sums over c: the output's
features leave split over (g, c), so the next layer's c is this one's g (Colossal-AI's swap of
input and output groups). Backward (by autodiff, the gathered blocks saved as Colossal-AI
does): all-gather of the output gradient over c, reduce-scatter of the input gradient over g and
of the kernel gradient over i: 6 collectives of q - 1 steps per layer. NOTE: Colossal-AI
sub-splits the batch (X_ijl: rows over (i, j)); here the sub-split is on the features (rows over
i, features over (l, j)), the same block sizes and bytes moved, so one rule per logical name
places every kernel and activation (see `partitioning.tensor_mesh`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from flax.linen import spmd
from jax.sharding import PartitionSpec

from t5lite import constraints

Array = jax.Array
Axes = Sequence[str | None]
Dims = tuple[tuple[str, ...], ...]

TENSOR_ROW, TENSOR_COL = "tensor_row", "tensor_col"
TENSOR_I, TENSOR_J, TENSOR_L = "tensor_i", "tensor_j", "tensor_l"
AXES_2D = (TENSOR_ROW, TENSOR_COL)
AXES_3D = (TENSOR_I, TENSOR_J, TENSOR_L)
SUMMA_2D, TENSOR_3D = "summa_2d", "tensor_3d"


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One kernel of a 2D/3D contraction: its dims, the (dim, axis) it is gathered along, the
    output (dim, axis) its partial sums are reduce-scattered along (None: none), its output dims."""

    dims: Dims
    gather: tuple[int, str]
    scatter: tuple[int, str] | None
    out_dims: Dims


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """A 2D or 3D contraction: the scheme, x's dims and the (dim, axis) x is gathered along."""

    scheme: str
    x_dims: Dims
    x_gather: tuple[int, str] | None
    kernels: tuple[KernelPlan, ...]


def mesh_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes (shared with `collectives`)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec(dims: Dims) -> PartitionSpec:
    """The PartitionSpec of dims given as mesh-axis tuples (shared with `collectives`)."""
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _resolve(axes: Axes) -> Dims:
    entries = spmd.logical_to_mesh_axes(tuple(axes), spmd.get_logical_axis_rules())
    entries = tuple(entries) + (None,) * (len(axes) - len(entries))
    return tuple(mesh_axes(e) for e in entries)


def _split(dims: Dims) -> list[int]:
    return [i for i, d in enumerate(dims) if d]


def check_mesh(mesh_shape: dict[str, int]) -> str | None:
    """The scheme a mesh's tensor axes call for (None: neither); a ValueError naming the axes
    when they are not all of one size."""
    for scheme, axes in ((TENSOR_3D, AXES_3D), (SUMMA_2D, AXES_2D)):
        if all(a in mesh_shape for a in axes):
            sizes = [mesh_shape[a] for a in axes]
            if len(set(sizes)) > 1:
                shape = " x ".join(f"{a}={s}" for a, s in zip(axes, sizes))
                kind = "cubic" if scheme == TENSOR_3D else "square"
                raise ValueError(f"{scheme} needs a {kind} tensor mesh (q x q...), got {shape}")
            return scheme
    return None


def _divides(dims: Dims, shape: Sequence[int], mesh_shape: dict[str, int]) -> bool:
    return all(n % math.prod(mesh_shape[a] for a in d) == 0 for d, n in zip(dims, shape))


def _check_divides(what: str, axes: Axes, dims: Dims, shape, mesh_shape) -> None:
    """One line naming the dimension and q when a split does not divide."""
    for name, d, n in zip(axes, dims, shape):
        size = math.prod(mesh_shape[a] for a in d)
        if n % size:
            raise ValueError(
                f"{what} dimension {name!r} of size {n} is not divisible by mesh axes {d} of "
                f"size {size} (the rules in force); choose sizes divisible by q^2"
            )


def summa_plan(x: Array, x_axes: Axes, kernels, n: int) -> TensorPlan | None:
    """The `summa_2d` plan when the mesh has `tensor_row` x `tensor_col` and the rules lay `x`
    and every kernel out as Optimus does; None otherwise.

    Args:
      x: the input with logical axes `x_axes`; kernels: (kernel, logical axes) pairs contracting
        x's last `n` dims with their first `n`.
    """
    return _plan(SUMMA_2D, x, x_axes, kernels, n)


def cube_plan(x: Array, x_axes: Axes, kernels, n: int) -> TensorPlan | None:
    """The `tensor_3d` plan when the mesh has `tensor_i` x `tensor_j` x `tensor_l` and the rules
    lay `x` and every kernel out as the 3D scheme does; None otherwise (args as `summa_plan`)."""
    return _plan(TENSOR_3D, x, x_axes, kernels, n)


def _plan(scheme: str, x: Array, x_axes: Axes, kernels, n: int) -> TensorPlan | None:
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    if check_mesh(mesh_shape) != scheme:
        return None
    x_dims = _resolve(x_axes)
    lead = x.ndim - n
    contracted = _split(x_dims[lead:])
    if len(contracted) != 1:
        return None
    p = contracted[0]
    k_plans, x_gather = [], None
    for kernel, k_axes in kernels:
        k_dims = _resolve(k_axes)
        make = _summa_kernel if scheme == SUMMA_2D else _cube_kernel
        made = make(x_dims, k_dims, lead, p, n)
        if made is None:
            return None
        gather, k_plan = made
        if k_plans and gather != x_gather:
            return None
        want = _resolve(tuple(x_axes[:lead]) + tuple(k_axes[n:]))
        if want != k_plan.out_dims:
            return None
        out_shape = x.shape[:lead] + kernel.shape[n:]
        _check_divides("a kernel's", k_axes, k_dims, kernel.shape, mesh_shape)
        _check_divides(
            "an activation's", tuple(x_axes[:lead]) + tuple(k_axes[n:]), want, out_shape, mesh_shape
        )
        x_gather = gather
        k_plans.append(k_plan)
    _check_divides("an activation's", x_axes, x_dims, x.shape, mesh_shape)
    return TensorPlan(scheme, x_dims, x_gather, tuple(k_plans))


def _summa_kernel(x_dims: Dims, k_dims: Dims, lead: int, p: int, n: int):
    """(x's gather, the kernel's plan) for SUMMA's C = A B or C = A B^T; None for other dims."""
    if len(x_dims[lead + p]) != 1 or x_dims[lead + p][0] not in AXES_2D:
        return None
    c_axis = x_dims[lead + p][0]
    r_axis = AXES_2D[1 - AXES_2D.index(c_axis)]
    if not any(r_axis in d for d in x_dims[:lead]):
        return None
    k_in, k_out = k_dims[:n], k_dims[n:]
    if _split(k_in) != [p] or len(_split(k_out)) != 1:
        return None
    q_out = _split(k_out)[0]
    if k_in[p] == (r_axis,) and k_out[q_out] == (c_axis,):  # C = A B
        out = x_dims[:lead] + k_out
        return (lead + p, c_axis), KernelPlan(k_dims, (p, r_axis), None, out)
    if k_in[p] == (c_axis,) and k_out[q_out] == (r_axis,):  # C = A B^T
        out = list(x_dims[:lead] + k_out)
        out[lead + q_out] = (c_axis,)
        plan = KernelPlan(k_dims, (n + q_out, r_axis), (lead + q_out, c_axis), tuple(out))
        return None, plan
    return None


def _cube_kernel(x_dims: Dims, k_dims: Dims, lead: int, p: int, n: int):
    """(x's gather, the kernel's plan) for the 3D contraction; None for other dims."""
    if len(x_dims[lead + p]) != 2 or not set(x_dims[lead + p]) <= {TENSOR_J, TENSOR_L}:
        return None
    c_axis, g_axis = x_dims[lead + p]
    if c_axis == g_axis or not any(TENSOR_I in d for d in x_dims[:lead]):
        return None
    k_in, k_out = k_dims[:n], k_dims[n:]
    if _split(k_in) != [p] or len(_split(k_out)) != 1:
        return None
    q_out = _split(k_out)[0]
    if k_in[p] not in ((c_axis,), (c_axis, TENSOR_I)):
        return None
    if k_out[q_out] not in ((g_axis,), (g_axis, TENSOR_I)):
        return None
    with_i = [i for i, d in enumerate(k_dims) if d and d[-1] == TENSOR_I]
    if len(with_i) != 1:
        return None
    out = list(x_dims[:lead] + tuple(() for _ in k_out))
    out[lead + q_out] = (g_axis, c_axis)
    plan = KernelPlan(k_dims, (with_i[0], TENSOR_I), (lead + q_out, c_axis), tuple(out))
    return (lead + p, g_axis), plan


def _replica_axes(x_dims: Dims, k_dims: Dims) -> tuple[str, ...]:
    """The mesh axes `x` is split over and a kernel is not (the data-parallel replicas)."""
    held = {a for d in k_dims for a in d}
    return tuple(a for d in x_dims for a in d if a not in held)


def contract(x: Array, kernels: Sequence[Array], n: int, plan: TensorPlan) -> list[Array]:
    """Each kernel applied to `x` inside one shard_map, by `plan` (see the module docstring)."""

    def body(x_local: Array, *ks: Array) -> list[Array]:
        if plan.x_gather is not None:
            dim, axis = plan.x_gather
            x_local = jax.lax.all_gather(x_local, axis, axis=dim, tiled=True)
        outs = []
        for k, kp in zip(ks, plan.kernels):
            # The kernel is the same on every data replica, its product with x is not: marking
            # it varying over `data` here, before the gather, puts the transpose's psum over
            # `data` on the kernel's own block (1/q of the gathered one).
            replicas = _replica_axes(plan.x_dims, kp.dims)
            if replicas:
                k = jax.lax.pcast(k, replicas, to="varying")
            k = jax.lax.all_gather(k, kp.gather[1], axis=kp.gather[0], tiled=True)
            y = constraints.dense(x_local, k, n)
            if kp.scatter is not None:
                dim, axis = kp.scatter
                y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
            outs.append(y)
        return outs

    in_specs = (spec(plan.x_dims), *(spec(kp.dims) for kp in plan.kernels))
    out_specs = [spec(kp.out_dims) for kp in plan.kernels]
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(x, *kernels)
