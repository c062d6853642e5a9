"""Sequence and context parallelism's and ZeRO-3's collectives, written with `jax.shard_map`.

Megatron's sequence parallelism (Korthikanti et al. 2022) keeps the residual stream split by
position over the tensor-parallel axis and turns each block's all-reduce into an all-gather
before the column-parallel matmuls (`g`) and a reduce-scatter after the row-parallel one (`ḡ`).
Rules alone do not get there: the SPMD partitioner writes every reduce-scatter as an all-reduce
followed by a slice, and XLA:CPU and XLA:TPU both keep it that way for block outputs. So the
boundaries are written here, each a `shard_map` manual over every mesh axis with in/out specs
from the rules (Shardy left the batch unsplit inside a partially manual one, measured with JAX
0.10.2). A kernel also split over another axis (FSDP's `data`) is gathered inside; the
transpose reduce-scatters its gradient there.

- `column_parallel`: gathers the block input's positions once and contracts it with each kernel
  locally. Its transpose reduce-scatters the summed input gradients of all kernels once.
- `row_parallel`: contracts locally and reduce-scatters the partial sums by position. Its
  transpose all-gathers the output gradient.
- `context_attention`: context parallelism's attention: keys and values computed on each
  device's positions and gathered inside, so their gradients are reduce-scattered back.
- ZeRO-3 (`_zero3`, taken by `column_parallel` and `row_parallel` when sequence parallelism is
  not in force): a kernel split over a mesh axis that also splits the activation's batch (FSDP's
  `embed` -> `data`) is gathered inside the layer's shard_map where it is used, so its gradient
  leaves through a reduce-scatter over that axis, not the partitioner's all-reduce + slice
  (XLA:CPU has no pass that turns that pair into a reduce-scatter). The token embedding (a
  lookup, and the tied logits) is not a dense layer and stays with the partitioner.

Model code calls them with logical axes only. The current rules table and mesh (those of
`Partitioner.context`) decide: when the rules split the activation's `length` over the same mesh
axes as the block's features (`heads`, `mlp`, `vocab`) take inside the block, or (context
parallelism) keep `kv_length` whole while splitting `length`, the explicit path runs; otherwise
(no mesh or one device, no rules, Explicit axes, a dimension that does not divide, a layout
that is neither) each call is the plain contraction (`constraints.dense`) the partitioner lays
out, exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from flax.linen import spmd
from jax.sharding import PartitionSpec

from t5lite import constraints

Axes = Sequence[str | None]
LENGTH = "length"


def _mesh_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _resolve(axes: Axes) -> tuple[tuple[str, ...], ...] | None:
    """Mesh axes of each dimension under the current rules (None: no rules bound)."""
    rules = spmd.get_logical_axis_rules()
    if not rules:
        return None
    spec = spmd.logical_to_mesh_axes(tuple(axes), rules)
    if spec is None:
        return None
    entries = tuple(spec) + (None,) * (len(axes) - len(spec))
    return tuple(_mesh_axes(e) for e in entries)


Dims = tuple[tuple[str, ...], ...]  # mesh axes of each dimension of an array


def _spec(dims: Dims) -> PartitionSpec:
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _divides(dims: Dims, shape: Sequence[int], mesh: jax.sharding.AbstractMesh) -> bool:
    return all(n % math.prod(mesh.shape[a] for a in d) == 0 for d, n in zip(dims, shape))


def _sequence_axes(axes: Axes) -> tuple[str, ...] | None:
    """The mesh axes (together of size > 1) that split `length` of an activation."""
    mesh = jax.sharding.get_abstract_mesh()
    dims = _resolve(axes)
    if mesh.empty or dims is None or LENGTH not in axes:
        return None
    sp = dims[list(axes).index(LENGTH)]
    if not sp or any(a not in mesh.shape for a in sp):
        return None
    return sp if math.prod(mesh.shape[a] for a in sp) > 1 else None


def _kernel_dims(dims: Dims, sp: tuple[str, ...]) -> Dims | None:
    """A kernel's dims once gathered over every axis but `sp` (None: a dim mixes both)."""
    out = []
    for d in dims:
        if d and d != sp and set(d) & set(sp):
            return None
        out.append(d if d == sp else ())
    return tuple(out)


def _gather_kernel(kernel: jax.Array, dims: Dims, sp: tuple[str, ...]) -> jax.Array:
    """Inside the shard_map: gathers a kernel over its non-`sp` axes (e.g. FSDP's `data`); the
    transpose reduce-scatters its gradient there (ZeRO-3)."""
    for i, d in enumerate(dims):
        if d and d != sp:
            kernel = jax.lax.all_gather(kernel, d, axis=i, tiled=True)
    return kernel


def _dot(x: jax.Array, kernel: jax.Array, n_contract: int) -> jax.Array:
    """x's last `n_contract` dims against kernel's first: DenseGeneral's contraction."""
    return constraints.dense(x, kernel, n_contract)


def _shard_map(body, in_dims: Sequence[Dims], out_specs):
    """`body` manual over every mesh axis, input specs from the rules' dims."""
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=tuple(_spec(d) for d in in_dims),
        out_specs=out_specs,
    )


def column_parallel(
    x: jax.Array, x_axes: Axes, kernels: Sequence[tuple[jax.Array, Axes]]
) -> list[jax.Array]:
    """Contracts x's last dim with each kernel's first: `x [B, L, D] · kernel [D, *F]`.

    Under sequence parallelism x arrives split by position; it is all-gathered once over those
    mesh axes and every kernel (split over them on its output features) is applied locally, so
    the backward pass sums the kernels' input gradients before one reduce-scatter.

    Args:
      x: the block input, in the kernels' dtype, with logical axes `x_axes`.
      kernels: (kernel, its logical axes) pairs; each output has the axes
        `x_axes[:-1] + kernel_axes[1:]`.

    Returns:
      One output per kernel, `[*x.shape[:-1], *kernel.shape[1:]]`.
    """
    plan = _column_plan(x, x_axes, kernels)
    if plan is None:
        zero3 = _zero3(x, x_axes, kernels, 1)
        return zero3 if zero3 is not None else [_dot(x, k, 1) for k, _ in kernels]
    sp, x_dims, k_dims, out_dims = plan
    length_dim = list(x_axes).index(LENGTH)

    def body(x_local: jax.Array, *ks: jax.Array) -> list[jax.Array]:
        x_full = jax.lax.all_gather(x_local, sp, axis=length_dim, tiled=True)
        return [_dot(x_full, _gather_kernel(k, d, sp), 1) for k, d in zip(ks, k_dims)]

    out_specs = [_spec(d) for d in out_dims]
    return _shard_map(body, [x_dims, *k_dims], out_specs)(x, *(k for k, _ in kernels))


def _column_plan(x, x_axes, kernels):
    """(sp axes, dims of x, of the kernels, of the outputs) when the layout is sequence
    parallel's: x split by position over `sp`, whole over its contracted dim, and each kernel's
    features (and so each output's) split over `sp`. None otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    sp = _sequence_axes(x_axes)
    if sp is None:
        return None
    x_dims = _resolve(x_axes)
    if x_dims[-1] or not _divides(x_dims, x.shape, mesh):
        return None
    batch_dims = tuple(() if a == LENGTH else d for a, d in zip(x_axes[:-1], x_dims[:-1]))
    k_all, out_all = [], []
    for kernel, k_axes in kernels:
        k_dims = _resolve(k_axes)
        gathered = _kernel_dims(k_dims, sp)
        if gathered is None or gathered[0] or sp not in gathered[1:]:
            return None
        if not _divides(k_dims, kernel.shape, mesh):
            return None
        k_all.append(k_dims)
        out_all.append(batch_dims + gathered[1:])
    return sp, x_dims, k_all, out_all


def row_parallel(
    x: jax.Array, x_axes: Axes, kernel: jax.Array, kernel_axes: Axes, n_contract: int
) -> jax.Array:
    """Contracts x's last `n_contract` dims with the kernel's first: `x [B, L, *F] · [*F, D]`.

    Under sequence parallelism (the contracted features split over the mesh axes that split the
    output's `length`) each device's partial product is reduce-scattered by position, so the
    block's output leaves already split like the residual stream.

    Args:
      x: the block's inner activation (in the kernel's dtype), logical axes `x_axes`.
      kernel: logical axes `kernel_axes`; the output has `x_axes[:-n] + kernel_axes[n:]`.

    Returns:
      `[*x.shape[:-n_contract], *kernel.shape[n_contract:]]`.
    """
    plan = _row_plan(x, x_axes, kernel, kernel_axes, n_contract)
    if plan is None:
        zero3 = _zero3(x, x_axes, [(kernel, kernel_axes)], n_contract)
        return zero3[0] if zero3 is not None else _dot(x, kernel, n_contract)
    sp, x_dims, k_dims, out_dims = plan
    length_dim = list(x_axes).index(LENGTH)

    def body(x_local: jax.Array, k_local: jax.Array) -> jax.Array:
        partial = _dot(x_local, _gather_kernel(k_local, k_dims, sp), n_contract)
        return jax.lax.psum_scatter(partial, sp, scatter_dimension=length_dim, tiled=True)

    return _shard_map(body, [x_dims, k_dims], _spec(out_dims))(x, kernel)


def _row_plan(x, x_axes, kernel, kernel_axes, n):
    """(sp axes, dims of x, of the kernel, of the output) when the contraction is over the
    axes that split the output's `length` and x's `length` is whole. None otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    out_axes = tuple(x_axes[:-n]) + tuple(kernel_axes[n:])
    sp = _sequence_axes(out_axes)
    if sp is None or LENGTH not in x_axes:
        return None
    x_dims, k_dims = _resolve(x_axes), _resolve(kernel_axes)
    gathered = _kernel_dims(k_dims, sp)
    contracted = x_dims[-n:]
    if gathered is None or sp not in contracted or any(d and d != sp for d in contracted):
        return None
    if gathered[:n] != contracted or any(gathered[n:]):
        return None
    length_dim = list(x_axes).index(LENGTH)
    rest = x_dims[:-n]
    if rest[length_dim] or any(set(d) & set(sp) for d in rest):
        return None
    if not (_divides(x_dims, x.shape, mesh) and _divides(k_dims, kernel.shape, mesh)):
        return None
    out_shape = x.shape[length_dim]
    if out_shape % math.prod(mesh.shape[a] for a in sp):
        return None
    out_dims = tuple(sp if i == length_dim else d for i, d in enumerate(rest))
    return sp, x_dims, k_dims, out_dims + ((),) * (len(kernel_axes) - n)


def _zero3(
    x: jax.Array, x_axes: Axes, kernels: Sequence[tuple[jax.Array, Axes]], n: int
) -> list[jax.Array] | None:
    """FSDP / ZeRO-3: x's last `n` dims contracted with each kernel's first `n` inside one
    shard_map, each kernel gathered there over the mesh axes that split both it and x's other
    dims (the batch's `data`), or None when no kernel is split so (the caller contracts as usual).

    The partitioner would gather such a kernel too, but writes its gradient's reduce-scatter as
    an all-reduce over `data` plus a slice (twice ZeRO-3's traffic), which XLA:CPU keeps; the
    transpose of a gather inside a shard_map is a real reduce-scatter. The other splits are
    Megatron's, as the partitioner lays them out: a kernel split over `model` on its output
    features gives local outputs (column parallel); split on its contracted dims like x (row
    parallel), the partial sums are summed over `model` (reduce-scattered where the rules split
    the output over it, 2D activations); x split on a contracted dim the kernel is not (2D
    activations' `embed`) is gathered first.
    """
    plan = _zero3_plan(x, x_axes, kernels, n)
    if plan is None:
        return None
    x_dims, x_gather, k_plans = plan
    lead = x.ndim - n

    # ZeRO-3 holds a gathered kernel only while it is used, so nothing inside is saved for the
    # backward pass: it may gather each kernel again from the shard (the contraction needs only
    # x and the kernel, so nothing else is recomputed; XLA may still reuse the forward gather in
    # an unscanned step). Saving what the body computes made the shard_map copy it out as
    # residuals: a scanned 2-layer LM's step took 81.7 MB against 73.7 MB with the
    # partitioner's gathers (tests/test_insight_accuracy.py's lm/fsdp/none); with this, 73.7 MB.
    @jax.checkpoint
    def body(x_local: jax.Array, *ks: jax.Array) -> list[jax.Array]:
        for i, axes in enumerate(x_gather):
            if axes:
                x_local = jax.lax.all_gather(x_local, axes, axis=lead + i, tiled=True)
        outs = []
        for k, (k_dims, fsdp, partial, scatter, _) in zip(ks, k_plans):
            for i, d in enumerate(k_dims):
                if set(d) & set(fsdp):
                    k = jax.lax.all_gather(k, d, axis=i, tiled=True)
            y = _dot(x_local, k, n)
            if partial and scatter is not None:
                y = jax.lax.psum_scatter(y, partial, scatter_dimension=scatter, tiled=True)
            elif partial:
                y = jax.lax.psum(y, partial)
            outs.append(y)
        return outs

    out_specs = [_spec(p[4]) for p in k_plans]
    in_dims = [x_dims, *(p[0] for p in k_plans)]
    return _shard_map(body, in_dims, out_specs)(x, *(k for k, _ in kernels))


def _zero3_plan(x, x_axes, kernels, n):
    """(dims of x, mesh axes to gather each contracted dim of x over, and per kernel: its dims,
    the axes it is gathered over, the axes its partial products are summed over, the output
    dim they are scattered along or None, the output's dims), or None when no kernel shares a
    mesh axis with x's uncontracted dims, on Explicit axes (`constraints.weight` gathers
    there), on one device, or when a split does not divide or does not fit these shapes."""
    mesh = jax.sharding.get_abstract_mesh()
    if constraints.layout_installed() or mesh.empty or mesh.size == 1:
        return None
    x_dims = _resolve(x_axes)
    if x_dims is None or not _known(x_dims, mesh) or not _divides(x_dims, x.shape, mesh):
        return None
    lead = x_dims[:-n]
    lead_axes = {a for d in lead for a in d if mesh.shape[a] > 1}
    x_gather, k_plans = None, []
    for kernel, k_axes in kernels:
        k_dims = _resolve(k_axes)
        if not _known(k_dims, mesh) or not _divides(k_dims, kernel.shape, mesh):
            return None
        fsdp = tuple(a for d in k_dims for a in d if a in lead_axes)
        if not fsdp:
            return None
        # A dim split over FSDP's axes and another is not gathered piecewise here.
        if any(set(d) & set(fsdp) and not set(d) <= set(fsdp) for d in k_dims):
            return None
        local = tuple(() if set(d) & set(fsdp) else d for d in k_dims)
        xc, kc = x_dims[-n:], local[:n]
        if any(kd and kd != xd for xd, kd in zip(xc, kc)):
            return None
        gather = tuple(xd if xd and not kd else () for xd, kd in zip(xc, kc))
        if x_gather is not None and gather != x_gather:
            return None
        x_gather = gather
        partial = tuple(a for kd in kc for a in kd)
        out = list(lead + local[n:])
        want = _resolve(tuple(x_axes[:-n]) + tuple(k_axes[n:]))
        out_shape = x.shape[:-n] + kernel.shape[n:]
        size = math.prod(mesh.shape[a] for a in partial)
        scatter = next(
            (i for i, (w, o, m) in enumerate(zip(want, out, out_shape))
             if partial and w == partial and not o and m % size == 0),
            None,
        )  # fmt: skip
        if scatter is not None:
            out[scatter] = partial
        k_plans.append((k_dims, fsdp, partial, scatter, tuple(out)))
    return x_dims, x_gather, k_plans


def _known(dims: Dims, mesh: jax.sharding.AbstractMesh) -> bool:
    return all(a in mesh.shape for d in dims for a in d)


def context_attention(
    attend: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    kv_axis: str,
) -> jax.Array | None:
    """Attention with queries split by position and keys/values gathered inside (context
    parallelism), or None when the rules do not call for it (the caller attends as usual).

    When the rules split `length` over some mesh axes and keep `kv_length` whole, `k` and `v`
    arrive split by position like the queries; each device gathers every key and value, attends
    its own queries, and the backward pass reduce-scatters the keys' and values' gradients back
    to their positions (instead of all-reducing them whole).

    Args:
      attend: `(q, k, v, bias, mask) -> out`, the unsharded attention (`bias`, `mask` may be
        None); applied per device to its queries and all keys.
      q: [B, L, H, K] ('batch', 'length', 'heads', 'kv'); k, v: [B, S, G, K] with `kv_axis`.
      bias: [1 or B, H, L, S] or None; mask: [B or 1, 1, L, S] or None.

    Returns:
      [B, L, H, K] split like q, or None.
    """
    q_axes = ("batch", LENGTH, "heads", "kv")
    kv_axes = ("batch", LENGTH, kv_axis, "kv")
    cp = _sequence_axes(q_axes)
    if cp is None or any(_resolve(("batch", "kv_length", kv_axis, "kv"))[1]):
        return None
    q_dims, kv_dims = _resolve(q_axes), _resolve(kv_axes)
    if q_dims[1] != cp or kv_dims[1] != cp or any(set(d) & set(cp) for d in q_dims[2:]):
        return None
    batch = q_dims[0]
    args, dims = [q, k, v], [q_dims, kv_dims, kv_dims]
    if bias is not None:
        args.append(bias)
        dims.append((batch if bias.shape[0] > 1 else (), q_dims[2], cp, ()))
    if mask is not None:
        args.append(mask)
        dims.append((batch if mask.shape[0] > 1 else (), (), cp, ()))
    mesh = jax.sharding.get_abstract_mesh()
    if not all(_divides(d, a.shape, mesh) for d, a in zip(dims, args)):
        return None
    has_bias, has_mask = bias is not None, mask is not None

    def body(q_l: jax.Array, k_l: jax.Array, v_l: jax.Array, *rest: jax.Array) -> jax.Array:
        k_all = jax.lax.all_gather(k_l, cp, axis=1, tiled=True)
        v_all = jax.lax.all_gather(v_l, cp, axis=1, tiled=True)
        rest = list(rest)
        b = rest.pop(0) if has_bias else None
        m = rest.pop(0) if has_mask else None
        return attend(q_l, k_all, v_all, b, m)

    return _shard_map(body, dims, _spec(q_dims))(*args)
