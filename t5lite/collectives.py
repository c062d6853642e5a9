"""How a contraction is parallelised: one named `Strategy` per layer, chosen by `select_strategy`.

A dense layer (`model/layers.py`) computes `x [..., *C] · kernel [*C, *F]` through `contract`,
which asks `select_strategy` once which strategy the rules in force (those of
`Partitioner.context`), the mesh and the shapes call for, and runs exactly that one. The
attention core's strategy is chosen the same way by `context_parallel.select_attention_strategy`.

Strategies, what selects each (in the order `select_strategy` tries them) and what each emits:

- `explicit`: `Partitioner(shard_mode='explicit')` installed a layout. The contraction is typed
  by it (`constraints.dense`); weights are gathered by `constraints.weight`.
- `plain`: no mesh, or a mesh of one device. One local matmul, no collective.
- `summa_2d`, `tensor_3d`: Optimus's 2D and Colossal-AI's 3D tensor parallelism (`tensor_nd`).
- `sequence_parallel_gather` (Megatron-SP's `g`; the `sequence_parallel` preset's block inputs
  and logits): the input is split by `length` over the mesh axes that split every kernel's
  output features, and is whole over its contracted dims. Forward: one all-gather of the input
  by position for all the kernels; backward: one reduce-scatter of the summed input gradients.
- `sequence_parallel_scatter` (Megatron-SP's `g-bar`; block outputs): the contracted features
  are split over the axes that split the output's `length`, and the input's `length` is whole.
  Forward: one reduce-scatter of the partial sums by position; backward: one all-gather.
- `zero3` (the `fsdp`, `fully_sharded` and `tensor_2d` presets: `embed` -> `data`): each kernel
  is split over a mesh axis that also splits the input's batch. Forward: each kernel
  all-gathered where it is used (and again in the backward pass); backward: its gradient
  reduce-scattered. Row-parallel kernels add Megatron's all-reduce (or reduce-scatter) over
  `model`.
- `partitioner` (`data_parallel`, `megatron`, `activations_2d`, a split that does not divide):
  any other layout on a mesh. GSPMD lays out the plain contraction from its operands'
  shardings: Megatron's all-reduce after a row-parallel contraction, the gradients' all-reduce
  over `data`.
- `context_parallel` (attention only; the `context_parallel` preset; `context_parallel.py`):
  the rules split the queries' `length` and keep `kv_length` whole. Keys and values are
  all-gathered inside attention; their gradients reduce-scattered back.
- `ring_context_parallel` (the `context_parallel_ring` preset): `kv_length` split like `length`;
  keys and values go around the ring, a `ppermute` per step (`model/ring_attention.py`).
- `per_shard` (kernels the partitioner cannot split, e.g. the TPU splash attention, a Pallas
  call): the kernel runs on each device's shard of its operands, laid out by the rules; no
  collective. Only for operations that are independent across the split dimensions (attention
  over batch and heads); `per_shard` refuses a split of any other dimension.
- `pipeline` (a scanned layer stack whose `layers` the rules split: t5lite/model/pipeline.py).
  Inside a stage's shard_map (its axes Manual) every contraction runs `plain` on its shard.

Why the explicit ones exist: the SPMD partitioner writes every reduce-scatter as an all-reduce
followed by a slice, and XLA:CPU and XLA:TPU both keep it that way for block outputs and weight
gradients; so Megatron's sequence parallelism (Korthikanti et al. 2022) and ZeRO-3's
gather-where-used are written here, each a `jax.shard_map` manual over every mesh axis with
in/out specs from the rules (Shardy left the batch unsplit inside a partially manual one). A
kernel also split over another axis (FSDP's `data`) is gathered inside a sequence-parallel
layer too; the transpose reduce-scatters its gradient there. The token embedding (a lookup, and
the tied logits) is not a dense layer and stays with the partitioner.

`select_strategy` tries the layouts in the table's order; each `_*_plan` says whether its
layout is the one in force (and how), and each strategy's function runs its plan with no
fallback inside. Model code passes logical axes only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax.linen import spmd

from t5lite import constraints, tensor_nd

Array = jax.Array
Axes = Sequence[str | None]
Dims = tuple[tuple[str, ...], ...]  # mesh axes of each dimension of an array
Kernels = Sequence[tuple[Array, Axes]]  # (kernel, its logical axes)
LENGTH = "length"


class Strategy(enum.StrEnum):
    """How one contraction (or attention core) is parallelised; see the module's table."""

    PLAIN = "plain"
    EXPLICIT = "explicit"
    PARTITIONER = "partitioner"
    SEQUENCE_PARALLEL_GATHER = "sequence_parallel_gather"
    SEQUENCE_PARALLEL_SCATTER = "sequence_parallel_scatter"
    ZERO3 = "zero3"
    CONTEXT_PARALLEL = "context_parallel"
    RING_CONTEXT_PARALLEL = "ring_context_parallel"
    PER_SHARD = "per_shard"
    PIPELINE = "pipeline"
    SUMMA_2D = tensor_nd.SUMMA_2D
    TENSOR_3D = tensor_nd.TENSOR_3D


@dataclasses.dataclass(frozen=True)
class SequencePlan:
    """A sequence-parallel contraction: mesh axes `sp` split `length`; dims of every operand."""

    sp: tuple[str, ...]
    x_dims: Dims
    kernel_dims: tuple[Dims, ...]
    out_dims: tuple[Dims, ...]
    length_dim: int


@dataclasses.dataclass(frozen=True)
class Zero3Kernel:
    """One kernel of a ZeRO-3 contraction."""

    dims: Dims  # as stored
    fsdp: tuple[str, ...]  # mesh axes it is gathered over where used
    partial: tuple[str, ...]  # mesh axes its partial products are summed over
    scatter: int | None  # the output dim that sum is scattered along (None: all-reduced)
    out_dims: Dims


@dataclasses.dataclass(frozen=True)
class Zero3Plan:
    """A ZeRO-3 contraction: x's dims, the axes each contracted dim of x is gathered over."""

    x_dims: Dims
    x_gather: Dims
    kernels: tuple[Zero3Kernel, ...]


# A strategy's plan, defined beside the function that runs it: `SequencePlan`, `Zero3Plan`,
# tensor_nd's, context_parallel's `ContextPlan`; None for the plain kinds.
Plan = Any
_mesh_axes, _spec = tensor_nd.mesh_axes, tensor_nd.spec


@dataclasses.dataclass(frozen=True)
class Choice:
    """The strategy `select_strategy` picked, and how to run it (None for the plain kinds)."""

    strategy: Strategy
    plan: Plan = None


def _resolve(axes: Axes) -> Dims | None:
    """Mesh axes of each dimension under the current rules (None: no rules bound)."""
    rules = spmd.get_logical_axis_rules()
    if not rules:
        return None
    spec = spmd.logical_to_mesh_axes(tuple(axes), rules)
    if spec is None:
        return None
    entries = tuple(spec) + (None,) * (len(axes) - len(spec))
    return tuple(_mesh_axes(e) for e in entries)


def _mesh() -> jax.sharding.AbstractMesh:
    return jax.sharding.get_abstract_mesh()


def _divides(dims: Dims, shape: Sequence[int]) -> bool:
    mesh = _mesh()
    return all(n % math.prod(mesh.shape[a] for a in d) == 0 for d, n in zip(dims, shape))


def _known(dims: Dims) -> bool:
    return all(a in _mesh().shape for d in dims for a in d)


def _sequence_axes(axes: Axes) -> tuple[str, ...] | None:
    """The mesh axes (together of size > 1) that split `length` of an activation, if any."""
    mesh, dims = _mesh(), _resolve(axes)
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


def _one_device() -> bool:
    mesh = _mesh()  # a pipeline stage's Manual axes: the partitioner lays out the others
    return mesh.empty or mesh.size == 1 or jax.sharding.AxisType.Manual in mesh.axis_types


def select_strategy(x: Array, x_axes: Axes | None, kernels: Kernels, n_contract: int) -> Choice:
    """The one strategy for `x`'s last `n_contract` dims contracted with each kernel's first.

    Args:
      x: the input, logical axes `x_axes` (None: unknown, so the partitioner lays it out).
      kernels: (kernel, its logical axes) pairs that all read `x`.
      n_contract: how many trailing dims of `x` each kernel contracts.
    """
    if constraints.layout_installed():
        return Choice(Strategy.EXPLICIT)
    if _one_device():
        return Choice(Strategy.PLAIN)
    if x_axes is None or _resolve(x_axes) is None:
        return Choice(Strategy.PARTITIONER)
    plans = (
        (Strategy.TENSOR_3D, tensor_nd.cube_plan),
        (Strategy.SUMMA_2D, tensor_nd.summa_plan),
        (Strategy.SEQUENCE_PARALLEL_GATHER, _gather_plan),
        (Strategy.SEQUENCE_PARALLEL_SCATTER, _scatter_plan),
        (Strategy.ZERO3, _zero3_plan),
    )
    for strategy, make_plan in plans:
        plan = make_plan(x, tuple(x_axes), kernels, n_contract)
        if plan is not None:
            return Choice(strategy, plan)
    return Choice(Strategy.PARTITIONER)


def contract(x: Array, x_axes: Axes | None, kernels: Kernels, n_contract: int = 1) -> list[Array]:
    """Each kernel applied to `x` (`x [..., *C] · kernel [*C, *F]`), by `select_strategy`'s pick.

    Args:
      x: the input, in the kernels' dtype, with logical axes `x_axes`.
      kernels: (kernel, its logical axes) pairs; output i has the axes
        `x_axes[:-n] + kernel_axes_i[n:]`.
      n_contract: n, the trailing dims of `x` (leading dims of each kernel) contracted.

    Returns:
      One output per kernel, `[*x.shape[:-n], *kernel.shape[n:]]`.
    """
    choice = select_strategy(x, x_axes, kernels, n_contract)
    ks = [k for k, _ in kernels]
    match choice.strategy:
        case Strategy.SEQUENCE_PARALLEL_GATHER:
            return sequence_parallel_gather(x, ks, n_contract, choice.plan)
        case Strategy.SEQUENCE_PARALLEL_SCATTER:
            return sequence_parallel_scatter(x, ks, n_contract, choice.plan)
        case Strategy.ZERO3:
            return zero3(x, ks, n_contract, choice.plan)
        case Strategy.SUMMA_2D | Strategy.TENSOR_3D:
            return tensor_nd.contract(x, ks, n_contract, choice.plan)
        case _:  # plain, explicit, partitioner: constraints.dense is each of them
            return [_dot(x, k, n_contract) for k in ks]


def _dot(x: Array, kernel: Array, n_contract: int) -> Array:
    """x's last `n_contract` dims against kernel's first: a dense layer's contraction."""
    return constraints.dense(x, kernel, n_contract)


def _shard_map(body, in_dims: Sequence[Dims], out_specs):
    """`body` manual over every mesh axis, input specs from the rules' dims."""
    return jax.shard_map(
        body, mesh=_mesh(), in_specs=tuple(_spec(d) for d in in_dims), out_specs=out_specs
    )


def _gather_kernel(kernel: Array, dims: Dims, sp: tuple[str, ...]) -> Array:
    """Inside the shard_map: gathers a kernel over its non-`sp` axes (e.g. FSDP's `data`); the
    transpose reduce-scatters its gradient there (ZeRO-3)."""
    for i, d in enumerate(dims):
        if d and d != sp:
            kernel = jax.lax.all_gather(kernel, d, axis=i, tiled=True)
    return kernel


# --- sequence parallelism: Megatron-SP's g (gather) and g-bar (scatter) -------------------------


def sequence_parallel_gather(
    x: Array, kernels: Sequence[Array], n: int, plan: SequencePlan
) -> list[Array]:
    """x arrives split by position; it is all-gathered once over `plan.sp` and every kernel
    (split there on its output features) is applied locally, so the backward pass sums the
    kernels' input gradients before one reduce-scatter."""

    def body(x_local: Array, *ks: Array) -> list[Array]:
        x_full = jax.lax.all_gather(x_local, plan.sp, axis=plan.length_dim, tiled=True)
        return [
            _dot(x_full, _gather_kernel(k, d, plan.sp), n) for k, d in zip(ks, plan.kernel_dims)
        ]

    out_specs = [_spec(d) for d in plan.out_dims]
    return _shard_map(body, [plan.x_dims, *plan.kernel_dims], out_specs)(x, *kernels)


def _gather_plan(x: Array, x_axes: Axes, kernels: Kernels, n: int) -> SequencePlan | None:
    """The plan when x is split by position over `sp`, whole over its contracted dims, and each
    kernel's features (and so each output's) are split over `sp`; None for other layouts."""
    sp = _sequence_axes(x_axes)
    if sp is None:
        return None
    x_dims = _resolve(x_axes)
    if any(x_dims[-n:]) or not _divides(x_dims, x.shape):
        return None
    batch_dims = tuple(() if a == LENGTH else d for a, d in zip(x_axes[:-n], x_dims[:-n]))
    k_all, out_all = [], []
    for kernel, k_axes in kernels:
        k_dims = _resolve(k_axes)
        gathered = _kernel_dims(k_dims, sp)
        if gathered is None or any(gathered[:n]) or sp not in gathered[n:]:
            return None
        if not _divides(k_dims, kernel.shape):
            return None
        k_all.append(k_dims)
        out_all.append(batch_dims + gathered[n:])
    length_dim = list(x_axes).index(LENGTH)
    return SequencePlan(sp, x_dims, tuple(k_all), tuple(out_all), length_dim)


def sequence_parallel_scatter(
    x: Array, kernels: Sequence[Array], n: int, plan: SequencePlan
) -> list[Array]:
    """Each device's partial product is reduce-scattered by position over `plan.sp`, so the
    block's output leaves split like the residual stream; the transpose all-gathers the output
    gradient."""
    (kernel,), (k_dims,) = kernels, plan.kernel_dims

    def body(x_local: Array, k_local: Array) -> Array:
        partial = _dot(x_local, _gather_kernel(k_local, k_dims, plan.sp), n)
        return jax.lax.psum_scatter(partial, plan.sp, scatter_dimension=plan.length_dim, tiled=True)

    return [_shard_map(body, [plan.x_dims, k_dims], _spec(plan.out_dims[0]))(x, kernel)]


def _scatter_plan(x: Array, x_axes: Axes, kernels: Kernels, n: int) -> SequencePlan | None:
    """The plan when one kernel's contraction is over the axes `sp` that split the output's
    `length` and x's `length` is whole; None for other layouts."""
    if len(kernels) != 1 or LENGTH not in x_axes:
        return None
    ((kernel, kernel_axes),) = kernels
    sp = _sequence_axes(tuple(x_axes[:-n]) + tuple(kernel_axes[n:]))
    if sp is None:
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
    if not (_divides(x_dims, x.shape) and _divides(k_dims, kernel.shape)):
        return None
    if x.shape[length_dim] % math.prod(_mesh().shape[a] for a in sp):
        return None
    out_dims = tuple(sp if i == length_dim else d for i, d in enumerate(rest))
    out_dims += ((),) * (len(kernel_axes) - n)
    return SequencePlan(sp, x_dims, (k_dims,), (out_dims,), length_dim)


# --- ZeRO-3: kernels gathered where used ------------------------------------------------------


def zero3(x: Array, kernels: Sequence[Array], n: int, plan: Zero3Plan) -> list[Array]:
    """FSDP / ZeRO-3: x's last `n` dims contracted with each kernel's first `n` inside one
    shard_map, each kernel gathered there over the mesh axes that split both it and x's other
    dims (the batch's `data`).

    The partitioner would gather such a kernel too, but writes its gradient's reduce-scatter as
    an all-reduce over `data` plus a slice (twice ZeRO-3's traffic), which XLA:CPU keeps; the
    transpose of a gather inside a shard_map is a real reduce-scatter. The other splits are
    Megatron's, as the partitioner lays them out: a kernel split over `model` on its output
    features gives local outputs (column parallel); split on its contracted dims like x (row
    parallel), the partial sums are summed over `model` (reduce-scattered where the rules split
    the output over it, 2D activations); x split on a contracted dim the kernel is not (2D
    activations' `embed`) is gathered first.
    """
    lead = x.ndim - n

    # ZeRO-3 holds a gathered kernel only while it is used, so nothing inside is saved for the
    # backward pass: it may gather each kernel again from the shard (the contraction needs only
    # x and the kernel, so nothing else is recomputed; XLA may still reuse the forward gather in
    # an unscanned step). Saving what the body computes made the shard_map copy the gathered
    # kernels out as residuals, more memory than the partitioner's own gathers.
    @jax.checkpoint
    def body(x_local: Array, *ks: Array) -> list[Array]:
        for i, axes in enumerate(plan.x_gather):
            if axes:
                x_local = jax.lax.all_gather(x_local, axes, axis=lead + i, tiled=True)
        outs = []
        for k, kp in zip(ks, plan.kernels):
            for i, d in enumerate(kp.dims):
                if set(d) & set(kp.fsdp):
                    k = jax.lax.all_gather(k, d, axis=i, tiled=True)
            y = _dot(x_local, k, n)
            if kp.partial and kp.scatter is not None:
                y = jax.lax.psum_scatter(y, kp.partial, scatter_dimension=kp.scatter, tiled=True)
            elif kp.partial:
                y = jax.lax.psum(y, kp.partial)
            outs.append(y)
        return outs

    out_specs = [_spec(kp.out_dims) for kp in plan.kernels]
    in_dims = [plan.x_dims, *(kp.dims for kp in plan.kernels)]
    return _shard_map(body, in_dims, out_specs)(x, *kernels)


def _zero3_plan(x: Array, x_axes: Axes, kernels: Kernels, n: int) -> Zero3Plan | None:
    """The plan when every kernel shares a mesh axis with x's uncontracted dims (and every split
    divides and fits these shapes); None for other layouts."""
    x_dims = _resolve(x_axes)
    if not _known(x_dims) or not _divides(x_dims, x.shape):
        return None
    mesh = _mesh()
    lead_axes = {a for d in x_dims[:-n] for a in d if mesh.shape[a] > 1}
    x_gather, k_plans = None, []
    for kernel, k_axes in kernels:
        k_plan = _zero3_kernel(x, x_axes, x_dims, kernel, k_axes, n, lead_axes)
        if k_plan is None:
            return None
        k_plan, gather = k_plan
        if x_gather is not None and gather != x_gather:
            return None
        x_gather = gather
        k_plans.append(k_plan)
    return Zero3Plan(x_dims, x_gather, tuple(k_plans))


def _zero3_kernel(x, x_axes, x_dims, kernel, k_axes, n, lead_axes):
    """(this kernel's `Zero3Kernel`, the axes x's contracted dims are gathered over), or None
    when the kernel is not split over the batch's axes or its split does not fit."""
    k_dims = _resolve(k_axes)
    if not _known(k_dims) or not _divides(k_dims, kernel.shape):
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
    partial = tuple(a for kd in kc for a in kd)
    out = list(x_dims[:-n] + local[n:])
    want = _resolve(tuple(x_axes[:-n]) + tuple(k_axes[n:]))
    out_shape = x.shape[:-n] + kernel.shape[n:]
    size = math.prod(_mesh().shape[a] for a in partial)
    scatter = None
    for i, (w, o, m) in enumerate(zip(want, out, out_shape)):
        if partial and w == partial and not o and m % size == 0:
            scatter = i
            break
    if scatter is not None:
        out[scatter] = partial
    return Zero3Kernel(k_dims, fsdp, partial, scatter, tuple(out)), gather


# --- kernels the partitioner cannot split: run on each device's shard ---------------------------


def per_shard(
    fn: Callable[..., Array],
    args: Sequence[Array | None],
    axes: Sequence[Axes],
    out_axes: Axes,
    independent: Sequence[str],
    aligned: Sequence[tuple[str, str]] = (),
) -> Array:
    """`fn(*args)` on each device's shard of `args`, laid out by the rules (no collective): the
    partitioner would gather a custom kernel's operands whole; attention is independent across
    examples and heads, so each device's rows and heads give its share of the output.

    Args:
      fn: the kernel, applied per device; `None` arguments are passed through as None.
      args: its array arguments (or None).
      axes: the logical axes of each argument (ignored for None).
      out_axes: the logical axes of the output.
      independent: the logical names the kernel may see split (e.g. 'batch', 'heads'); a rule
        that splits any other dimension is refused.
      aligned: pairs of names that must be split alike (grouped-query attention's `heads` and
        `kv_heads`: each device's query heads must read its own key/value heads).

    Returns:
      The output, laid out by `out_axes`.
    """
    if constraints.layout_installed() or _one_device() or _resolve(out_axes) is None:
        return fn(*args)
    present = [(a, ax) for a, ax in zip(args, axes) if a is not None]
    dims = [_resolve(ax) for _, ax in present]
    for (a, ax), d in zip(present, dims):
        for name, mesh_axes in zip(ax, d):
            if mesh_axes and name not in independent:
                raise ValueError(
                    f"this attention kernel runs per device and cannot have `{name}` split "
                    f"over mesh axes {mesh_axes} (the rules in force); use 'xla' or 'cudnn'"
                )
        if not _divides(d, a.shape):
            raise ValueError(
                f"an attention operand {a.shape} with axes {tuple(ax)} does not divide over "
                f"mesh axes {d}"
            )
    split = {name: d for (_, ax), ds in zip(present, dims) for name, d in zip(ax, ds)}
    for first, second in aligned:
        if first in split and second in split and split[first] != split[second]:
            raise ValueError(
                f"this attention kernel runs per device and needs `{first}` and `{second}` "
                f"split alike (the rules give {split[first]} and {split[second]}); use 'xla' "
                "or 'cudnn'"
            )
    slots = [a is not None for a in args]

    def body(*local: Array) -> Array:
        it = iter(local)
        return fn(*(next(it) if present_ else None for present_ in slots))

    # NOTE: check_vma=False: a Pallas call's outputs do not say how they vary over mesh axes.
    specs = tuple(_spec(d) for d in dims)
    out_spec = _spec(_resolve(out_axes))
    out = jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=out_spec, check_vma=False)
    return out(*(a for a, _ in present))
