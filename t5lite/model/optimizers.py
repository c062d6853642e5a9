"""Optimizers and learning-rate schedules, with optimizer state sharded like the parameters.

Optimizers are small frozen dataclasses (bound in gin) whose `create(params_axes)` returns an
optax `GradientTransformation`. They take the parameters' logical axes because Adafactor decides
*which* dimensions to factor from them (t5x's factor rules), and because `state_axes` must give
the optimizer state the same logical layout as the parameters it tracks, factored statistics
included.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

PyTree = Any
Schedule = Callable[[jax.Array], jax.Array]


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000) -> Schedule:
    """T5's schedule: `base / sqrt(max(step, warmup_steps))` (constant through warm-up)."""

    def schedule(step: jax.Array) -> jax.Array:
        return base_learning_rate * jax.lax.rsqrt(
            jnp.maximum(jnp.asarray(step, jnp.float32), float(warmup_steps))
        )

    return schedule


def warmup_cosine_schedule(
    peak_learning_rate: float,
    warmup_steps: int,
    decay_steps: int,
    end_learning_rate: float = 0.0,
) -> Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to `end_learning_rate`.

    `decay_steps` counts from step 0 (warm-up included), as in optax.
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_schedule: decay_steps ({decay_steps}) must exceed warmup_steps "
            f"({warmup_steps})"
        )
    return optax.warmup_cosine_decay_schedule(
        0.0, peak_learning_rate, warmup_steps, decay_steps, end_learning_rate
    )


def constant_schedule(learning_rate: float) -> Schedule:
    return optax.constant_schedule(learning_rate)


def _as_schedule(lr: float | Schedule) -> Schedule:
    return lr if callable(lr) else optax.constant_schedule(lr)


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW with optional global-norm clipping."""

    learning_rate: float | Schedule = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled, multiplied by the learning rate
    clip_norm: float | None = 1.0  # global gradient norm; None disables clipping

    def create(self, params_axes: PyTree) -> optax.GradientTransformation:
        del params_axes  # AdamW's statistics have exactly the parameters' shapes
        tx = optax.adamw(
            _as_schedule(self.learning_rate),
            self.b1,
            self.b2,
            self.eps,
            weight_decay=self.weight_decay,
        )
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), tx) if self.clip_norm else tx

    def learning_rate_at(self, step: jax.Array) -> jax.Array:
        return _as_schedule(self.learning_rate)(step)


# ---------------------------------------------------------------------------------------------
# Adafactor, factored by logical axes
# ---------------------------------------------------------------------------------------------


class FactorDim(enum.Enum):
    """What a parameter dimension is to Adafactor's factored second moment."""

    ROW = "row"  # kept in v_row, averaged out of v_col
    COLUMN = "column"  # kept in v_col, averaged out of v_row
    BATCH = "batch"  # independent statistics per index (e.g. the scanned `layers` axis)
    NONE = "none"  # kept in both factors, like BATCH


# t5x's `standard_logical_factor_rules`.
STANDARD_FACTOR_RULES: Mapping[str, FactorDim] = {
    "vocab": FactorDim.COLUMN,
    "embed": FactorDim.ROW,
    "mlp": FactorDim.COLUMN,
    "heads": FactorDim.COLUMN,
    "kv_heads": FactorDim.COLUMN,
    "kv": FactorDim.COLUMN,
    "joined_kv": FactorDim.COLUMN,
    "relpos_buckets": FactorDim.NONE,
    "layers": FactorDim.BATCH,
    "stack": FactorDim.BATCH,  # t5x: stacked (unscanned) layers keep per-layer statistics
}


class _Factoring(NamedTuple):
    rows: tuple[int, ...]  # dimensions averaged out of v_col
    cols: tuple[int, ...]  # dimensions averaged out of v_row


class AdafactorState(NamedTuple):
    count: jax.Array
    v_row: PyTree  # per parameter: factored row statistics, or a (1,) placeholder
    v_col: PyTree
    v: PyTree  # per parameter: full statistics when not factored, else a (1,) placeholder
    # First moment (t5x's `exp_avg`) when `beta1` is set; None (no leaves) otherwise, so states
    # and checkpoints without momentum keep their structure.
    m: PyTree = None


@dataclasses.dataclass(frozen=True)
class Adafactor:
    """Adafactor as in t5x / Mesh-TensorFlow, with factoring decided by logical axes.

    A parameter is factored when its logical axes include ROW and COLUMN dimensions (per
    `factor_rules`) and both sides have at least `min_dim_size_to_factor` elements; its second
    moment is then stored as v_row (ROW + BATCH dims) and v_col (COLUMN + BATCH dims).
    """

    learning_rate: float | Schedule = 1e-2
    decay_rate: float = 0.8  # second-moment decay: 1 - (step + 1) ** -decay_rate
    step_offset: int = 0
    multiply_by_parameter_scale: bool = True  # scale updates by RMS(param), floored at epsilon2
    clipping_threshold: float | None = 1.0  # cap on the update's RMS
    epsilon1: float = 1e-30  # added to squared gradients
    epsilon2: float = 1e-3  # floor of the parameter scale
    min_dim_size_to_factor: int = 128
    weight_decay_rate: float | None = None  # decoupled, multiplied by the learning rate
    clip_norm: float | None = None  # optional global gradient-norm clipping first
    factor_rules: Mapping[str, FactorDim] | None = None  # default: STANDARD_FACTOR_RULES
    beta1: float | None = None
    """Momentum (t5x's `beta1`, optax's `momentum`): an EMA, without bias correction, of the
    scaled update (after clipping, learning rate and parameter scale, before weight decay),
    kept in fp32 with the parameters' layout. None: no momentum and no extra state."""
    replicate_factored: bool = False
    """Lay out v_row and v_col replicated, as t5x's `derive_logical_axes` does. False (t5lite):
    each keeps the logical axes of the dimensions it keeps, so it is split like them (less
    memory per device under Megatron's `mlp`/`heads` -> `model`). The numbers are the same."""

    def _factoring(self, axes: Any, shape: tuple[int, ...]) -> _Factoring | None:
        if axes is None or len(shape) < 2:
            return None
        rules = STANDARD_FACTOR_RULES if self.factor_rules is None else self.factor_rules
        kinds = [rules.get(a, FactorDim.NONE) if a is not None else FactorDim.NONE for a in axes]
        rows = tuple(i for i, k in enumerate(kinds) if k == FactorDim.ROW)
        cols = tuple(i for i, k in enumerate(kinds) if k == FactorDim.COLUMN)
        if not rows or not cols:
            return None
        size = lambda dims: math.prod(shape[i] for i in dims)
        if min(size(rows), size(cols)) < self.min_dim_size_to_factor:
            return None
        return _Factoring(rows, cols)

    def create(self, params_axes: PyTree) -> optax.GradientTransformation:
        lr = _as_schedule(self.learning_rate)
        is_axes = lambda x: x is None or isinstance(x, PartitionSpec)

        def factorings(params: PyTree) -> PyTree:
            return jax.tree_util.tree_map(
                lambda ax, p: self._factoring(tuple(ax) if ax is not None else None, p.shape),
                params_axes,
                params,
                is_leaf=is_axes,
            )

        def init(params: PyTree) -> AdafactorState:
            facts = jax.tree_util.tree_leaves(factorings(params), is_leaf=_is_fact)
            leaves, treedef = jax.tree_util.tree_flatten(params)
            rows, cols, full = [], [], []
            placeholder = jnp.zeros((1,), jnp.float32)
            for p, f in zip(leaves, facts):
                if f is None:
                    rows.append(placeholder), cols.append(placeholder)
                    full.append(jnp.zeros(p.shape, jnp.float32))
                else:
                    rows.append(jnp.zeros(_drop(p.shape, f.cols), jnp.float32))
                    cols.append(jnp.zeros(_drop(p.shape, f.rows), jnp.float32))
                    full.append(placeholder)
            unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
            m = None
            if self.beta1 is not None:
                m = unflat([jnp.zeros(p.shape, jnp.float32) for p in leaves])
            return AdafactorState(
                jnp.zeros([], jnp.int32), unflat(rows), unflat(cols), unflat(full), m
            )

        def update(grads: PyTree, state: AdafactorState, params: PyTree | None = None):
            if params is None:
                raise ValueError("Adafactor needs the parameters in update()")
            facts = jax.tree_util.tree_leaves(factorings(params), is_leaf=_is_fact)
            step = state.count + 1
            decay = 1.0 - (step - self.step_offset).astype(jnp.float32) ** (-self.decay_rate)
            learning_rate = lr(state.count)
            g_leaves, treedef = jax.tree_util.tree_flatten(grads)
            flat = lambda t: treedef.flatten_up_to(t)
            ms = flat(state.m) if self.beta1 is not None else [None] * len(g_leaves)
            outs = [
                self._update_one(g, p, f, vr, vc, v, m, decay, learning_rate)
                for g, p, f, vr, vc, v, m in zip(
                    g_leaves,
                    flat(params),
                    facts,
                    flat(state.v_row),
                    flat(state.v_col),
                    flat(state.v),
                    ms,
                )
            ]
            unflat = lambda i: jax.tree_util.tree_unflatten(treedef, [o[i] for o in outs])
            m = unflat(4) if self.beta1 is not None else None
            return unflat(0), AdafactorState(step, unflat(1), unflat(2), unflat(3), m)

        tx = optax.GradientTransformation(init, update)
        if self.clip_norm:
            tx = optax.chain(optax.clip_by_global_norm(self.clip_norm), tx)
        return tx

    def _update_one(self, g, p, f, v_row, v_col, v, m, decay, learning_rate):
        """One parameter's update (all statistics in fp32)."""
        g = g.astype(jnp.float32)
        g_sq = g * g + self.epsilon1
        if f is None:
            v = decay * v + (1.0 - decay) * g_sq
            u = g * jax.lax.rsqrt(v)
        else:
            v_row = decay * v_row + (1.0 - decay) * jnp.mean(g_sq, axis=f.cols)
            v_col = decay * v_col + (1.0 - decay) * jnp.mean(g_sq, axis=f.rows)
            # v_row has lost the column dims: ROW dims sit at their positions among the rest.
            row_pos = tuple(i - sum(c < i for c in f.cols) for i in f.rows)
            row_mean = jnp.mean(v_row, axis=row_pos, keepdims=True)
            row_factor = jnp.expand_dims(jax.lax.rsqrt(v_row / row_mean), f.cols)
            col_factor = jnp.expand_dims(jax.lax.rsqrt(v_col), f.rows)
            u = g * row_factor * col_factor
        if self.clipping_threshold is not None:
            rms = jnp.sqrt(jnp.mean(u * u))
            u = u / jnp.maximum(1.0, rms / self.clipping_threshold)
        scale = learning_rate
        if self.multiply_by_parameter_scale:
            p32 = p.astype(jnp.float32)
            scale = scale * jnp.maximum(jnp.sqrt(jnp.mean(p32 * p32)), self.epsilon2)
        u = scale * u
        if self.beta1 is not None:
            # NOTE: momentum of the scaled step, as t5x and optax do (not of the raw gradient).
            m = self.beta1 * m + (1.0 - self.beta1) * u
            u = m
        u = -u
        if self.weight_decay_rate:
            u = u - learning_rate * self.weight_decay_rate * p.astype(jnp.float32)
        return u.astype(p.dtype), v_row, v_col, v, m

    def learning_rate_at(self, step: jax.Array) -> jax.Array:
        return _as_schedule(self.learning_rate)(step)

    def state_axes_for(self, params_axes: PyTree, params: PyTree) -> AdafactorState:
        """Logical axes of `AdafactorState` for parameters with `params_axes`."""
        is_axes = lambda x: x is None or isinstance(x, PartitionSpec)

        def per_param(which: str):
            def one(ax, p):
                ax_t = tuple(ax) if ax is not None else None
                f = self._factoring(ax_t, p.shape)
                if which == "v":
                    return ax if f is None else PartitionSpec(None)
                if f is None or self.replicate_factored:
                    return PartitionSpec(None)
                assert ax_t is not None
                drop = f.cols if which == "v_row" else f.rows
                return PartitionSpec(*(a for i, a in enumerate(ax_t) if i not in drop))

            return jax.tree_util.tree_map(one, params_axes, params, is_leaf=is_axes)

        m = None
        if self.beta1 is not None:  # the first moment is laid out like its parameter
            m = jax.tree_util.tree_map(lambda ax, p: ax, params_axes, params, is_leaf=is_axes)
        return AdafactorState(
            PartitionSpec(), per_param("v_row"), per_param("v_col"), per_param("v"), m
        )


def _is_fact(x: Any) -> bool:
    return x is None or isinstance(x, _Factoring)


def _drop(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s for i, s in enumerate(shape) if i not in dims)


# ---------------------------------------------------------------------------------------------
# Fine-tuning a part of the model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrozenParams:
    """Trains only the parameters whose path matches none of `patterns`; the others stay put.

    `patterns` are regular expressions matched in full against '/'-joined parameter paths
    (`encoder/.*` freezes the encoder; `.*embedding.*` the embeddings). Frozen parameters get
    no optimizer state at all (optax's `multi_transform` masks them out of the wrapped
    optimizer, whose clipping, weight decay and statistics see only the trained ones), and a
    zero update, so they come out of training bit for bit as they went in.
    """

    optimizer: AdamW | Adafactor = AdamW()
    patterns: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(self.patterns))  # hashable, like the rest

    def labels(self, params_axes: PyTree) -> PyTree:
        """'frozen' or 'trained' per parameter; an error for a pattern that matches nothing."""
        is_axes = lambda x: x is None or isinstance(x, PartitionSpec)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params_axes, is_leaf=is_axes)
        paths = ["/".join(_key(k) for k in path) for path, _ in leaves]
        compiled = [re.compile(p) for p in self.patterns]
        for pattern, rx in zip(self.patterns, compiled):
            if not any(rx.fullmatch(p) for p in paths):
                raise ValueError(
                    f"FrozenParams.patterns: {pattern!r} matches no parameter (paths look like "
                    f"{paths[0]!r})"
                )
        frozen = ["frozen" if any(rx.fullmatch(p) for rx in compiled) else "trained" for p in paths]
        if "trained" not in frozen:
            raise ValueError("FrozenParams.patterns freeze every parameter: nothing would train")
        return jax.tree_util.tree_unflatten(treedef, frozen)

    def create(self, params_axes: PyTree) -> optax.GradientTransformation:
        labels = self.labels(params_axes)
        inner = self.optimizer.create(_masked(params_axes, labels))
        return optax.multi_transform({"trained": inner, "frozen": optax.set_to_zero()}, labels)

    def learning_rate_at(self, step: jax.Array) -> jax.Array:
        return self.optimizer.learning_rate_at(step)


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _masked(tree: PyTree, labels: PyTree) -> PyTree:
    """`tree` with its frozen leaves replaced by optax's MaskedNode, as `multi_transform`
    presents the parameters to the optimizer of the trained ones."""
    is_axes = lambda x: x is None or isinstance(x, PartitionSpec)
    return jax.tree_util.tree_map(
        lambda x, label: x if label == "trained" else optax.MaskedNode(),
        tree,
        labels,
        is_leaf=is_axes,
    )


# ---------------------------------------------------------------------------------------------
# Optimizer state layout
# ---------------------------------------------------------------------------------------------

Optimizer = AdamW | Adafactor | FrozenParams


def optimizer_state_axes(
    optimizer: Optimizer,
    tx: optax.GradientTransformation,
    params: PyTree,
    params_axes: PyTree,
) -> PyTree:
    """Logical axes of `tx.init(params)`: parameter-shaped state takes the parameters' axes.

    Scalars and other non-parameter state are replicated; Adafactor's factored statistics keep
    the axes of the dimensions they keep.
    """
    abstract = jax.eval_shape(tx.init, params)
    is_axes = lambda x: x is None or isinstance(x, PartitionSpec)
    if isinstance(optimizer, FrozenParams):
        # multi_transform's state: the frozen part is empty; the trained part is the wrapped
        # optimizer's state over the masked parameters, laid out as that optimizer's.
        labels = optimizer.labels(params_axes)
        masked_axes = _masked(params_axes, labels)
        inner_tx = optimizer.optimizer.create(masked_axes)
        inner = optimizer_state_axes(
            optimizer.optimizer, inner_tx, _masked(params, labels), masked_axes
        )
        trained = abstract.inner_states["trained"]
        return abstract._replace(
            inner_states={
                "trained": trained._replace(inner_state=inner),
                "frozen": jax.tree_util.tree_map(
                    lambda _: PartitionSpec(), abstract.inner_states["frozen"]
                ),
            }
        )
    if isinstance(optimizer, Adafactor):
        # Adafactor's init needs real shapes, so optax.tree_map_params (which feeds it
        # placeholders) cannot be used; its state is laid out by `state_axes_for` instead.
        fixed = optimizer.state_axes_for(params_axes, params)
        return jax.tree_util.tree_map(
            lambda node: fixed if isinstance(node, AdafactorState) else PartitionSpec(),
            abstract,
            is_leaf=lambda x: isinstance(x, AdafactorState),
        )
    return optax.tree_map_params(
        tx,
        lambda _, ax: ax,
        abstract,
        params_axes,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=is_axes,
    )
