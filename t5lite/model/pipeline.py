"""Pipeline parallelism: a scanned layer stack run as stages over a `stage` mesh axis (GPipe).

The rules split the stacked parameters' `layers` dimension over the stage axes
(`select` picks `collectives.Strategy.PIPELINE`), so stage `s` of `p` holds
layers `[s * L/p, (s + 1) * L/p)`. The batch is cut into `m` microbatches; at clock tick `t`
stage `s` runs its layers on microbatch `t - s` and hands the result to stage `s + 1` by
`jax.lax.ppermute`, inside a `jax.shard_map` manual over the stage axes only (data, FSDP and
Megatron splits on the other axes stay with the partitioner: inside a stage every contraction
runs `plain` and GSPMD lays it out). `m + p - 1` ticks fill and drain the pipe: GPipe's
schedule, whose idle share is `(p - 1) / (m + p - 1)` of each device's time.

The backward pass is the forward's transpose: the scan over ticks runs in reverse and each
`ppermute` becomes one from stage `s + 1` to stage `s` (all forward, then all backward), so every
stage keeps the residuals of its `m + p - 1` ticks (GPipe's `m` microbatches in flight; remat
trims what each keeps).

Inside a tick the stage's `L/p` layers are written out one after another, not scanned: the
tick scan then saves each layer's residuals once, straight into its `[T, ...]` stack. A layer
scan nested in the tick scan stacks them twice (the inner scan into `[L/p, ...]` buffers, which
the tick scan copies into `[T, L/p, ...]` and slices back out in the backward pass, copying the
inner loop's buffers besides): the same dot FLOPs as written out, but several times the
residuals' memory traffic (docs/pipeline.md). The price is a program that grows with `L/p`.
Under remat 'full' (a layer saves only its input) and where the rules split a layer's weights
over the batch's axes (FSDP, whose per-layer gathers the scan keeps in the tick loop) the layers
stay a scan (`apply_stack`).

Why `ppermute` in `shard_map` rather than GSPMD's shifting buffer (a stage-vectorised state
rolled by one each tick, as in MaxText's default and the GSPMD paper): the stage-to-stage
transfer is then exactly one collective-permute of one microbatch's activations per tick and
direction, written where it happens, rather than whatever the partitioner makes of a roll on a
sharded dimension; and the layers run unvectorised, so they trace like the unpipelined stack.

Microbatch `i` is rows `i, i + m, i + 2m, ...` of the batch (as the trainer's gradient
accumulation): each data shard keeps its share of every microbatch, so cutting moves no data.
The embedding before the stack and the logits after it are not pipelined: they run on every
stage's devices (the stack's input is whole over `stage`, its output is sent from the last
stage to all).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import spmd
from jax.sharding import PartitionSpec as P

from t5lite import constraints
from t5lite.collectives import Choice, Strategy
from t5lite.model import schedules

Array = jax.Array
PyTree = Any
LayerFn = Callable[[PyTree, Array, tuple, Array | None], Array]
"""`(one layer's params, x [b, L, D], the stack's other args, dropout key or None) -> x`."""


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A pipelined layer stack: `axes` (together `num_stages` devices) split its `layers`."""

    axes: tuple[str, ...]
    num_stages: int


def _split_over(name: str) -> tuple[tuple[str, ...], int]:
    """The mesh axes the rules in force split a dimension named `name` over, and their size."""
    mesh, rules = jax.sharding.get_abstract_mesh(), spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return (), 1
    spec = spmd.logical_to_mesh_axes((name,), rules)
    entry = spec[0] if spec is not None and len(spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    if any(a not in mesh.shape for a in axes):
        return (), 1
    return axes, math.prod(mesh.shape[a] for a in axes)


def split_size(name: str) -> int:
    """How many devices the rules in force split a dimension named `name` over (1: whole)."""
    return _split_over(name)[1]


def stage_axes() -> tuple[str, ...]:
    """The mesh axes (together of size > 1) the rules in force split a stack's `layers` over."""
    axes, size = _split_over("layers")
    return axes if size > 1 else ()


_ONE_STAGE = contextvars.ContextVar("one_stage", default=False)


@contextlib.contextmanager
def one_stage() -> Iterator[None]:
    """Within it, a `stage` axis of one device runs the pipeline's schedule too (elsewhere a
    pipeline needs two stages or more): a stage's program alone, its ticks and code without a
    bubble or a transfer, which benchmarks/pipeline_bubble.py times as a stage's busy work.
    It acts where a step is traced: jit keeps a step's first trace, so first call it within.
    Meant for a mesh of one device: with other axes over several devices XLA's partitioner
    rejects the manual axis of size one (an all-reduce outside manual mode, 8 fake devices)."""
    token = _ONE_STAGE.set(True)
    try:
        yield
    finally:
        _ONE_STAGE.reset(token)


def select(num_layers: int, where: str) -> Choice:
    """`pipeline` (collectives.Strategy) when the rules split a scanned stack's `layers` over
    devices, else `partitioner` (the stack is scanned; GSPMD lays out each layer).

    Args:
      num_layers: the stack's layers; they must divide over the stages.
      where: the config field that counts them, for messages.
    """
    axes, stages = _split_over("layers")
    if stages <= 1 and not (axes and _ONE_STAGE.get()):
        return Choice(Strategy.PARTITIONER)
    if constraints.layout_installed():
        raise ValueError(f"pipeline stages ({axes}) need Partitioner.shard_mode='auto'")
    if num_layers % stages:
        raise ValueError(
            f"{where}={num_layers} layers do not divide into {stages} pipeline stages (mesh "
            f"axes {axes} from the rule for 'layers')"
        )
    return Choice(Strategy.PIPELINE, PipelinePlan(axes, stages))  # type: ignore[arg-type]


def select_stack(cfg: Any, stack: str, num_layers: int) -> Choice:
    """`select` for a network's stack `stack` ('encoder' or 'decoder') of `cfg`; an unscanned
    stack with the rules splitting `layers` is refused (its layers carry no `layers` axis)."""
    name = type(cfg).__name__
    if not cfg.scan_layers:
        _refuse_unscanned(cfg)
        return Choice(Strategy.PARTITIONER)
    field = "num_layers" if name == "DecoderOnlyConfig" else f"num_{stack}_layers"
    return select(num_layers, f"{name}.{field}")


def _refuse_unscanned(cfg: Any) -> None:
    """One line when the rules in force stage an unscanned network (its layers carry no
    `layers` axis to split)."""
    if not getattr(cfg, "scan_layers", True) and stage_axes():
        raise ValueError(
            f"{type(cfg).__name__}.scan_layers=False, but the rules split 'layers' over mesh "
            f"axes {stage_axes()} (pipeline stages): set scan_layers=True"
        )


def apply_stack(
    parent: Any,
    layer_cls: type,
    plan: PipelinePlan,
    x_BLD: Array,
    args: tuple,
    layer_kwargs: dict[str, Any],
    remat_policy: Any,
) -> Array:
    """The scanned stack `parent.layers` (a Flax module's) run as pipeline stages: its stacked
    parameters, as `nn.scan` created them (so checkpoints do not change), applied layer by
    layer in each stage; `remat_policy` (a `jax.checkpoint` policy, None: save nothing) unless
    the config's remat policy is 'none'."""
    cfg = layer_kwargs["config"]
    name = type(cfg).__name__
    if cfg.num_experts:
        raise ValueError(f"{name}.num_experts={cfg.num_experts}: pipeline stages need dense MLPs")
    m = microbatches(cfg.pipeline_microbatches, plan.num_stages)
    check(m, x_BLD.shape[0], split_size("batch"), name)
    layer = layer_cls(parent=None, sparse=False, **layer_kwargs)

    def layer_fn(params: PyTree, x: Array, layer_args: tuple, key: Array | None) -> Array:
        rngs = {} if key is None else {"dropout": key}
        return layer.apply({"params": params}, x, *layer_args, rngs=rngs)[0]

    if cfg.remat_policy != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy)
    dropout = not layer_kwargs["deterministic"] and cfg.dropout_rate > 0
    rng = parent.make_rng("dropout") if dropout else None
    stacked = parent.variables["params"]["layers"]
    if cfg.pipeline_schedule == "1f1b":
        check_schedule(cfg.pipeline_schedule, plan.num_stages, m, name)

        def forward(stacked: PyTree, x: Array, args: tuple, key: Array | None) -> Array:
            # Never differentiated (the custom_vjp's forward rule): nothing to save, so the
            # stage's layers stay a scan and the program small.
            return run(layer_fn, stacked, x, args, plan, m, key, unroll_stage=False)

        return schedules.one_f_one_b(
            forward, layer_fn, stacked, x_BLD, args, plan.axes, plan.num_stages, m, rng
        )
    # Written out (see the module docstring) unless a layer saves only its input (remat
    # 'full': the nested scan's second stacking then copies one [b, L, D] a layer and tick,
    # while written out XLA may recompute a tick's layers before their backwards, holding
    # more at once) or its weights are split over the batch's axes (FSDP): written out, XLA
    # hoists their gathers out of the tick loop and holds the whole stage's weights through
    # the step, where a layer scan gathers one layer's in each tick.
    unroll = cfg.remat_policy != "full" and not _params_split_over_batch(layer, x_BLD, args)
    return run(layer_fn, stacked, x_BLD, args, plan, m, rng, unroll_stage=unroll)


def _params_split_over_batch(layer: Any, x_BLD: Array, args: tuple) -> bool:
    """Whether the rules in force split any of one layer's parameters (their logical axes as
    its `init` names them) over a mesh axis that also splits the batch (FSDP, ZeRO-3)."""
    batch, _ = _split_over("batch")
    if not batch:
        return False
    key = jax.random.PRNGKey(0)
    boxed = jax.eval_shape(
        lambda x, a: layer.init({"params": key, "dropout": key}, x, *a), x_BLD, args
    )
    rules = spmd.get_logical_axis_rules()
    for names in jax.tree_util.tree_leaves(
        nn.get_partition_spec(boxed)["params"], is_leaf=lambda n: isinstance(n, P)
    ):
        for entry in spmd.logical_to_mesh_axes(tuple(names), rules) or ():
            split = () if entry is None else (entry,) if isinstance(entry, str) else entry
            if set(split) & set(batch):
                return True
    return False


def check_microbatches(cfg: Any, batch: int) -> None:
    """Before anything compiles (the trainer calls it under the partitioner's context): one line
    naming the culprit when the rules in force pipeline `cfg`'s scanned stacks and its
    microbatches do not cut a `batch` of rows over the data devices, or are too few for the
    schedule, or the network is not scanned. `apply_stack` checks the same again where it
    runs."""
    _, stages = _split_over("layers")
    if stages <= 1 or cfg is None:
        return
    _refuse_unscanned(cfg)
    if not getattr(cfg, "scan_layers", False):
        return
    name = type(cfg).__name__
    m = microbatches(cfg.pipeline_microbatches, stages)
    check(m, batch, split_size("batch"), name)
    check_schedule(cfg.pipeline_schedule, stages, m, name)


def check_schedule(schedule: str, num_stages: int, num_microbatches: int, where: str) -> None:
    """One line naming the culprit when the schedule cannot run `num_microbatches` microbatches
    over `num_stages` stages (1F1B's warm-up fills every stage before the first backward)."""
    if schedule == "1f1b" and num_microbatches < num_stages:
        raise ValueError(
            f"{where}.pipeline_microbatches={num_microbatches}: schedule '1f1b' needs at least "
            f"as many microbatches as the {num_stages} pipeline stages"
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline's shape: `p` stages, `m` microbatches, the ticks to fill and drain it."""

    num_stages: int
    num_microbatches: int
    name: str = "gpipe"

    @property
    def ticks(self) -> int:
        """Clock ticks per pass (forward or backward): `m + p - 1`."""
        return self.num_microbatches + self.num_stages - 1

    @property
    def bubble(self) -> float:
        """The idle share of each stage's time: `(p - 1) / (m + p - 1)` (GPipe, 1F1B)."""
        return (self.num_stages - 1) / self.ticks

    @property
    def in_flight(self) -> int:
        """Microbatches whose activations a stage holds at the peak: `m` for GPipe."""
        return self.num_microbatches


def check(num_microbatches: int, batch: int, data_size: int, where: str) -> None:
    """One line naming the culprit when the batch cannot be cut into the microbatches."""
    if batch % num_microbatches or (batch // num_microbatches) % data_size:
        raise ValueError(
            f"{where}.pipeline_microbatches={num_microbatches}: a batch of {batch} rows does not "
            f"cut into {num_microbatches} microbatches that divide over the {data_size} devices "
            f"splitting the batch (needs a multiple of {num_microbatches * data_size} rows)"
        )


def microbatches(config_value: int, num_stages: int) -> int:
    """The microbatch count: `pipeline_microbatches`, or as many as stages when it is 0."""
    return config_value or num_stages


def _split(x: Array, m: int) -> Array:
    """[B, ...] -> [m, B/m, ...]: microbatch i is rows i, i + m, ..."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge(x: Array) -> Array:
    """[m, B/m, ...] -> [B, ...], `_split`'s inverse."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run(
    layer_fn: LayerFn,
    stacked: PyTree,
    x_BLD: Array,
    args: tuple,
    plan: PipelinePlan,
    num_microbatches: int,
    rng: Array | None = None,
    unroll_stage: bool = True,
) -> Array:
    """The layer stack `stacked` applied to `x_BLD` as a GPipe pipeline over `plan.axes`.

    Args:
      layer_fn: one layer (see `LayerFn`), applied with each layer's slice of `stacked`.
      stacked: the stack's parameters, each leaf [layers, ...], `layers` split over the stages.
      x_BLD: the stack's input [B, L, D].
      args: the stack's other inputs (masks, biases, positions): leaves whose first dim is B
        are cut into microbatches with `x`; the rest reach every microbatch whole.
      plan: the stage axes and their size.
      num_microbatches: m; divides B.
      rng: a dropout key (None: deterministic); each layer and microbatch folds in its own.
      unroll_stage: the stage's layers written out in each tick (for a differentiated pass: its
        residuals are then saved once, see the module docstring), else scanned.

    Returns:
      [B, L, D], equal to the stack applied to the whole batch.
    """
    batch, m, p = x_BLD.shape[0], num_microbatches, plan.num_stages
    sched = Schedule(p, m)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    cut = [leaf.ndim > 0 and leaf.shape[0] == batch for leaf in leaves]
    leaves = [_split(v, m) if c else v for v, c in zip(leaves, cut)]
    xs_MbLD = _split(x_BLD, m)
    axes = plan.axes if len(plan.axes) > 1 else plan.axes[0]
    per_stage = jax.tree_util.tree_leaves(stacked)[0].shape[0] // p

    def body(stacked_local, xs_MbLD, key, *leaves_local):
        stage = jax.lax.axis_index(axes)
        # Marked stage-varying once: their gradients are summed over the stages in one
        # all-reduce after the backward ticks, not one per tick holding every stage (as 1F1B).
        xs_MbLD = jax.lax.pcast(xs_MbLD, tuple(plan.axes), to="varying")
        leaves_local = [jax.lax.pcast(v, tuple(plan.axes), to="varying") for v in leaves_local]

        def stage_fn(x_bLD, i_mb):
            mb_leaves = [
                jax.lax.dynamic_index_in_dim(v, i_mb, keepdims=False) if c else v
                for v, c in zip(leaves_local, cut)
            ]
            mb_args = jax.tree_util.tree_unflatten(treedef, mb_leaves)

            def one_layer(x, j_params):
                j, params = j_params
                k = None
                if rng is not None:
                    k = jax.random.fold_in(jax.random.fold_in(key, i_mb), stage * per_stage + j)
                return layer_fn(params, x, mb_args, k), None

            if not unroll_stage:
                layers = (jnp.arange(per_stage), stacked_local)
                return jax.lax.scan(one_layer, x_bLD, layers)[0]
            # One split of each stacked leaf: its transpose is one concatenate of the layers'
            # gradients, where per-layer slices would each pad theirs to the whole stack.
            split = [
                jax.lax.split(a, (1,) * per_stage) for a in jax.tree_util.tree_leaves(stacked_local)
            ]
            for j in range(per_stage):
                params = jax.tree_util.tree_unflatten(
                    jax.tree_util.tree_structure(stacked_local), [a[j][0] for a in split]
                )
                x_bLD, _ = one_layer(x_bLD, (j, params))
            return x_bLD

        def tick(state_bLD, t):
            # Stage s works on microbatch t - s; outside [0, m) it computes on a stale buffer
            # whose result is never used (the bubble).
            i_mb = jnp.clip(t - stage, 0, m - 1)
            fresh = jax.lax.dynamic_index_in_dim(xs_MbLD, jnp.clip(t, 0, m - 1), keepdims=False)
            y_bLD = stage_fn(jnp.where(stage == 0, fresh, state_bLD), i_mb)
            sent = jax.lax.ppermute(y_bLD, axes, [(i, i + 1) for i in range(p - 1)])
            return sent, y_bLD

        # The carry differs between stages (it holds what the previous stage sent), as the
        # microbatches it is cut from do.
        state_bLD = jnp.zeros_like(xs_MbLD[0])
        _, ys_TbLD = jax.lax.scan(tick, state_bLD, jnp.arange(sched.ticks))
        return ys_TbLD[None]

    specs = [P(axes) if i == 0 else P() for i in range(3 + len(leaves))]
    stage_specs = jax.tree_util.tree_map(lambda _: P(axes), stacked)
    out = jax.shard_map(
        body,
        in_specs=(stage_specs, *specs[1:]),
        out_specs=P(axes),
        axis_names=set(plan.axes),
    )(stacked, xs_MbLD, jnp.zeros((), jnp.uint32) if rng is None else rng, *leaves)
    # Stage p-1's outputs from tick p-1 on are microbatches 0..m-1.
    return _merge(out[p - 1, p - 1 :])
