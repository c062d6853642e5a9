"""Pipeline schedules beyond GPipe (model/pipeline.py): 1F1B, hand-written.

GPipe falls out of autodiff: the backward pass is the forward loop transposed, so a stage holds
the activations of all `m` microbatches when its backward starts. 1F1B (PipeDream-Flush,
Megatron's non-interleaved schedule) interleaves the forward and backward passes of different
microbatches so that stage `s` holds at most `p - s` microbatches at once; no transposed loop
expresses that, so the stack is a `jax.custom_vjp` whose backward rule is the schedule.

The loss is computed outside the stack (the logits follow it), so the stack's output cotangent
exists only once the whole forward pass has run. The custom_vjp's forward rule therefore runs
the stack forward-only (GPipe's loop, nothing kept but the stack's input), and its backward rule
runs 1F1B: `2(m + p - 1)` half-ticks, in each of which stage `s` does one forward (F) when
`tau - s` is even and one backward (B) when it is odd:

- F of microbatch `i` at half-tick `2i + s`: runs the stage on the input received from stage
  `s - 1` (stage 0: the stack input), stores that input in slot `i mod p`, sends the output on;
- B of microbatch `i` at half-tick `2i + 2p - 1 - s`: recomputes the stage from slot `i mod p`
  under `jax.vjp` and pulls back the cotangent received from stage `s + 1` (stage `p - 1`: the
  stack output's), accumulates the parameter gradients, sends the input's cotangent back.

Stage `s` warms up with `p - s` forwards spaced by idle half-ticks, alternates 1F1B in the
steady state and cools down with backwards: its idle share is `(p - 1) / (m + p - 1)` as
GPipe's. What it holds: `p` slots of stage inputs (one microbatch's `[b, L, D]` each; `p - s`
are live) instead of GPipe's residuals of `m + p - 1` ticks, and one microbatch's residuals of
its `L/p` layers while a B recomputes them. The price is compute: the stack's forward runs three
times (the forward pass, the schedule's F, the recompute in B) against GPipe's one (or two with
remat).

Communication: in each half-tick a stage sends one buffer, forward after an F and backward
after a B; which neighbour it is follows the half-tick's parity, so one `ppermute` of static
pairs per half-tick moves both directions ((0->1, 1->0, 2->3, 3->2, ...) on even half-ticks,
(1->2, 2->1, ...) on odd ones, which are empty for `p = 2`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Array = jax.Array
PyTree = Any


def _split(x: Array, m: int) -> Array:
    """[B, ...] -> [m, B/m, ...]: microbatch i is rows i, i + m, ... (as model/pipeline.py)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge(x: Array) -> Array:
    """[m, B/m, ...] -> [B, ...], `_split`'s inverse."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def half_tick_pairs(num_stages: int, parity: int) -> list[tuple[int, int]]:
    """The (source, destination) stages of 1F1B's one permute on half-ticks of `parity`: a stage
    whose `tau - s` is even did an F and sends forward, the others did a B and send back."""
    p = num_stages
    forward = [(s, s + 1) for s in range(parity, p - 1, 2)]
    backward = [(s, s - 1) for s in range(1 + parity, p, 2)]
    return sorted(forward + backward)


def half_tick_op(tau: int, stage: int, num_stages: int, num_microbatches: int) -> tuple[str, int]:
    """What 1F1B's stage `stage` does at half-tick `tau`: ('F', i), ('B', i) or ('idle', -1)
    (the loop in `one_f_one_b` computes the same from traced values)."""
    d = tau - stage
    i = d // 2 if d % 2 == 0 else (tau - 2 * num_stages + 1 + stage) // 2
    if not 0 <= i < num_microbatches:
        return ("idle", -1)
    return ("F" if d % 2 == 0 else "B", i)


def one_f_one_b(
    forward: Callable[[PyTree, Array, tuple, Array | None], Array],
    layer_fn: Callable[[PyTree, Array, tuple, Array | None], Array],
    stacked: PyTree,
    x_BLD: Array,
    args: tuple,
    axes: tuple[str, ...],
    num_stages: int,
    num_microbatches: int,
    rng: Array | None,
) -> Array:
    """The layer stack `stacked` applied to `x_BLD` with 1F1B's backward pass.

    Args:
      forward: the stack's forward pass over the stages, `(stacked, x_BLD, args, rng) -> y_BLD`
        (GPipe's loop: it is never differentiated here).
      layer_fn: one layer, `(params, x [b, L, D], args, dropout key or None) -> x`.
      stacked: the stack's parameters, each leaf [layers, ...], `layers` split over `axes`.
      x_BLD: the stack's input [B, L, D].
      args: the stack's other inputs: leaves whose first dim is B are cut into microbatches.
      axes: the stage mesh axes (together `num_stages` devices).
      num_stages: p.
      num_microbatches: m (>= p; divides B).
      rng: a dropout key (None: deterministic); each layer and microbatch folds in its own, as
        GPipe's loop does, so the recomputed forward draws the same masks.

    Returns:
      [B, L, D], equal to the stack applied to the whole batch; its gradients are 1F1B's.
    """
    batch, m, p = x_BLD.shape[0], num_microbatches, num_stages
    leaves, treedef = jax.tree_util.tree_flatten(args)
    cut = [leaf.ndim > 0 and leaf.shape[0] == batch for leaf in leaves]
    diff = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]
    key0 = jnp.zeros((2,), jnp.uint32) if rng is None else rng

    @jax.custom_vjp
    def stack(stacked, x_BLD, key, leaves):
        return forward(
            stacked,
            x_BLD,
            jax.tree_util.tree_unflatten(treedef, leaves),
            None if rng is None else key,
        )

    def stack_fwd(stacked, x_BLD, key, leaves):
        return stack(stacked, x_BLD, key, leaves), (stacked, x_BLD, key, leaves)

    def stack_bwd(res, dy_BLD):
        stacked, x_BLD, key, leaves = res
        grads, dx_BLD, dleaves = _backward(
            layer_fn,
            stacked,
            x_BLD,
            dy_BLD,
            key,
            leaves,
            treedef,
            cut,
            diff,
            axes,
            p,
            m,
            rng is not None,
        )
        return grads, dx_BLD, None, dleaves

    stack.defvjp(stack_fwd, stack_bwd)
    return stack(stacked, x_BLD, key0, leaves)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What 1F1B's loop knows at trace time: the layer, the stack's other inputs' structure
    (`cut`: cut into microbatches; `diff`: inexact, so differentiated), the stages."""

    layer_fn: Callable[[PyTree, Array, tuple, Array | None], Array]
    treedef: Any
    cut: tuple[bool, ...]
    diff: tuple[bool, ...]
    axes: tuple[str, ...]
    p: int
    m: int
    per_stage: int
    dropout: bool

    @property
    def ax(self) -> str | tuple[str, ...]:
        return self.axes if len(self.axes) > 1 else self.axes[0]

    @property
    def cut_wrt(self) -> list[bool]:
        return [c for c, d in zip(self.cut, self.diff) if d]


class _Local(NamedTuple):
    """One stage's inside the shard_map: its index, its layers, the stack's whole inputs."""

    stage: Array
    stacked: PyTree
    xs_MbLD: Array
    dys_MbLD: Array
    key: Array
    leaves: list[Array]


def _varying(st: _Static, x: Array) -> Array:
    """`x` marked as differing between stages (for the axes it is not yet)."""
    missing = tuple(a for a in st.axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _leaves_of(st: _Static, loc: _Local, i_mb: Array) -> list[Array]:
    return [
        jax.lax.dynamic_index_in_dim(v, i_mb, keepdims=False) if c else v
        for v, c in zip(loc.leaves, st.cut)
    ]


def _stage_fn(st: _Static, loc: _Local, params: PyTree, x_bLD: Array, mb_leaves, i_mb) -> Array:
    """The stage's `L/p` layers on microbatch `i_mb` (dropout keys as GPipe's loop folds them)."""
    mb_args = jax.tree_util.tree_unflatten(st.treedef, mb_leaves)

    def one_layer(x, j_params):
        j, layer_params = j_params
        k = None
        if st.dropout:
            k = jax.random.fold_in(jax.random.fold_in(loc.key, i_mb), loc.stage * st.per_stage + j)
        return st.layer_fn(layer_params, x, mb_args, k), None

    x_bLD, _ = jax.lax.scan(one_layer, x_bLD, (jnp.arange(st.per_stage), params))
    return x_bLD


def _idle(st: _Static, loc: _Local, carry, recv: Array, tau: Array):
    return carry, jnp.zeros_like(recv)


def _forward_op(st: _Static, loc: _Local, carry, recv: Array, tau: Array):
    """F: the stage on what stage s - 1 sent (stage 0: the stack input), kept in its slot."""
    slots, grads, dleaves, dxs = carry
    i = (tau - loc.stage) // 2
    fresh = jax.lax.dynamic_index_in_dim(loc.xs_MbLD, i, keepdims=False)
    x_bLD = jnp.where(loc.stage == 0, fresh, recv)
    y_bLD = _stage_fn(st, loc, loc.stacked, x_bLD, _leaves_of(st, loc, i), i)
    slots = jax.lax.dynamic_update_index_in_dim(slots, x_bLD, i % st.p, 0)
    return (slots, grads, dleaves, dxs), y_bLD


def _backward_op(st: _Static, loc: _Local, carry, recv: Array, tau: Array):
    """B: the stage recomputed from its slot under `jax.vjp`, pulling back what stage s + 1
    sent (stage p - 1: the stack output's cotangent); gradients accumulated."""
    slots, grads, dleaves, dxs = carry
    i = (tau - 2 * st.p + 1 + loc.stage) // 2
    given = jax.lax.dynamic_index_in_dim(loc.dys_MbLD, i, keepdims=False)
    dy_bLD = jnp.where(loc.stage == st.p - 1, given, recv)
    x_bLD = jax.lax.dynamic_index_in_dim(slots, i % st.p, keepdims=False)
    mb = _leaves_of(st, loc, i)
    # Pulled back through an input whole over the stages, a cotangent would be summed over
    # them (psum) right here, inside this branch, which the stages take at different
    # half-ticks: a collective that never completes. As varying inputs their cotangents stay
    # per stage, summed once after the loop.
    wrt = [_varying(st, v) for v, d in zip(mb, st.diff) if d]

    def f(params, x, wrt):
        it = iter(wrt)
        full = [next(it) if d else v for v, d in zip(mb, st.diff)]
        return _stage_fn(st, loc, params, x, full, i)

    _, pull = jax.vjp(f, loc.stacked, x_bLD, wrt)
    dparams, dx_bLD, dwrt = pull(dy_bLD)
    grads = jax.tree_util.tree_map(jnp.add, grads, dparams)
    new = []
    for acc, g, c in zip(dleaves, dwrt, st.cut_wrt):
        if c:
            row = jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) + g
            new.append(jax.lax.dynamic_update_index_in_dim(acc, row, i, 0))
        else:
            new.append(acc + g)
    dxs = jax.lax.dynamic_update_index_in_dim(dxs, dx_bLD, i, 0)
    return (slots, grads, new, dxs), dx_bLD


def _half_tick(st: _Static, loc: _Local, carry, recv: Array, tau: Array, perm):
    """One half-tick: F, B or nothing by `half_tick_op`'s rule, then its one permute."""
    d = tau - loc.stage
    f_mb, b_mb = d // 2, (tau - 2 * st.p + 1 + loc.stage) // 2
    op = jnp.where(
        d % 2 == 0,
        jnp.where((f_mb >= 0) & (f_mb < st.m), 1, 0),
        jnp.where((b_mb >= 0) & (b_mb < st.m), 2, 0),
    )
    ops = [functools.partial(f, st, loc) for f in (_idle, _forward_op, _backward_op)]
    carry, send = jax.lax.switch(op, ops, carry, recv, tau)
    if not perm:  # p = 2's odd half-ticks: every send has no receiver
        return carry, jnp.zeros_like(send)
    return carry, jax.lax.ppermute(send, st.ax, perm)


def _schedule(st: _Static, stacked_local, xs_MbLD, dys_MbLD, key, *leaves_local):
    """The shard_map body: one stage's `2(m + p - 1)` half-ticks, then the input gradients
    summed over the stages."""
    stage = jax.lax.axis_index(st.ax)
    loc = _Local(stage, stacked_local, xs_MbLD, dys_MbLD, key, list(leaves_local))
    pairs = (half_tick_pairs(st.p, 0), half_tick_pairs(st.p, 1))

    def tick(state, k):
        carry, recv = state
        carry, recv = _half_tick(st, loc, carry, recv, 2 * k, pairs[0])
        carry, recv = _half_tick(st, loc, carry, recv, 2 * k + 1, pairs[1])
        return (carry, recv), None

    def zeros(x):
        return jax.lax.pcast(jnp.zeros(x.shape, x.dtype), st.axes, to="varying")

    slots = zeros(jnp.zeros((st.p, *xs_MbLD.shape[1:]), xs_MbLD.dtype))
    grads = jax.tree_util.tree_map(zeros, stacked_local)
    dleaves = [zeros(v) for v, d in zip(leaves_local, st.diff) if d]
    init = ((slots, grads, dleaves, zeros(xs_MbLD)), zeros(xs_MbLD[0]))
    (carry, _), _ = jax.lax.scan(tick, init, jnp.arange(st.m + st.p - 1))
    _, grads, dleaves, dxs = carry
    # Stage 0 alone pulled back to the stack input; every stage added its layers' share to the
    # other inputs' cotangents.
    dxs = jax.lax.psum(jnp.where(stage == 0, dxs, jnp.zeros_like(dxs)), st.ax)
    return grads, dxs, [jax.lax.psum(g, st.ax) for g in dleaves]


def _backward(
    layer_fn, stacked, x_BLD, dy_BLD, key, leaves, treedef, cut, diff, axes, p, m, dropout
):
    """1F1B's loop (module docstring): the gradients of the stacked parameters, of the stack's
    input and of its other inputs' inexact leaves (None for the rest)."""
    per_stage = jax.tree_util.tree_leaves(stacked)[0].shape[0] // p
    st = _Static(layer_fn, treedef, tuple(cut), tuple(diff), tuple(axes), p, m, per_stage, dropout)
    xs_MbLD, dys_MbLD = _split(x_BLD, m), _split(dy_BLD, m)
    mb_leaves = [_split(v, m) if c else v for v, c in zip(leaves, cut)]
    stage_specs = jax.tree_util.tree_map(lambda _: P(st.ax), stacked)
    grads, dxs_MbLD, dleaves = jax.shard_map(
        functools.partial(_schedule, st),
        in_specs=(stage_specs, P(), P(), P(), *[P()] * len(mb_leaves)),
        out_specs=(stage_specs, P(), [P()] * len(st.cut_wrt)),
        axis_names=set(axes),
    )(stacked, xs_MbLD, dys_MbLD, key, *mb_leaves)
    it = iter(dleaves)
    dleaves = [(_merge(next(it)) if c else next(it)) if d else None for c, d in zip(cut, diff)]
    return grads, _merge(dxs_MbLD), dleaves
