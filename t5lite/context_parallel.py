"""Context parallelism's attention strategies: which one the rules call for, and the all-gather.

Both split the queries' `length` over a context axis (n devices); `select_attention_strategy`
picks one from the rules in force, like `collectives.select_strategy` for a dense layer:

- `context_parallel` (the `context_parallel` preset, `kv_length` whole): keys and values are
  all-gathered inside attention (`context_parallel_attention`); their gradients
  reduce-scattered back.
- `ring_context_parallel` (the `context_parallel_ring` preset, `kv_length` split like
  `length`): keys and values go around the ring, a `ppermute` per step; the model layer runs
  it (`model/ring_attention.py`), from the `ContextPlan` chosen here.

The `Strategy` names and the layout helpers are `collectives.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from t5lite import constraints
from t5lite.collectives import (
    LENGTH,
    Choice,
    Dims,
    Strategy,
    _divides,
    _one_device,
    _resolve,
    _sequence_axes,
    _shard_map,
    _spec,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """Context-parallel attention: `cp` splits the queries' and keys' positions."""

    cp: tuple[str, ...]
    dims: tuple[Dims, ...]  # of q, k, v[, bias][, mask]
    out_dims: Dims


def select_attention_strategy(
    q: Array, k: Array, bias: Array | None, mask: Array | None, kv_axis: str
) -> Choice:
    """`context_parallel` when the rules split the queries' `length` and keep `kv_length`
    whole, `ring_context_parallel` when they split both alike, else the partitioner's.

    Args:
      q: [B, L, H, K] ('batch', 'length', 'heads', 'kv'); k: [B, S, G, K] with `kv_axis`.
      bias: [1 or B, H, L, S] or None; mask: [B or 1, 1, L, S] or None.
    """
    if constraints.layout_installed():
        return Choice(Strategy.EXPLICIT)
    if _one_device():
        return Choice(Strategy.PLAIN)
    ring = bool((_resolve(("batch", "kv_length", kv_axis, "kv")) or ((), ()))[1])
    plan = _context_plan(q, k, bias, None if ring else mask, kv_axis)  # the ring reads parts
    if plan is None:
        return Choice(Strategy.PARTITIONER)
    return Choice(Strategy.RING_CONTEXT_PARALLEL if ring else Strategy.CONTEXT_PARALLEL, plan)


def _context_plan(q, k, bias, mask, kv_axis) -> ContextPlan | None:
    q_axes = ("batch", LENGTH, "heads", "kv")
    cp = _sequence_axes(q_axes)
    if cp is None or _resolve(("batch", "kv_length", kv_axis, "kv"))[1] not in ((), cp):
        return None
    q_dims, kv_dims = _resolve(q_axes), _resolve(("batch", LENGTH, kv_axis, "kv"))
    if q_dims[1] != cp or kv_dims[1] != cp or any(set(d) & set(cp) for d in q_dims[2:]):
        return None
    args, dims = [q, k, k], [q_dims, kv_dims, kv_dims]
    if bias is not None:
        args.append(bias)
        dims.append((q_dims[0] if bias.shape[0] > 1 else (), q_dims[2], cp, ()))
    if mask is not None:
        args.append(mask)
        dims.append((q_dims[0] if mask.shape[0] > 1 else (), (), cp, ()))
    if not all(_divides(d, a.shape) for d, a in zip(dims, args)):
        return None
    return ContextPlan(cp, tuple(dims), q_dims)


def context_parallel_attention(
    attend: Callable[..., Array],
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    mask: Array | None,
    plan: ContextPlan,
) -> Array:
    """Attention with queries split by position and keys/values gathered inside.

    `k` and `v` arrive split by position like the queries; each device gathers every key and
    value, attends its own queries, and the backward pass reduce-scatters the keys' and values'
    gradients back to their positions (instead of all-reducing them whole).

    Args:
      attend: `(q, k, v, bias, mask) -> out`, the attention core (`bias`, `mask` may be None),
        applied per device to its queries and all keys.
      q, k, v, bias, mask: as for `select_attention_strategy` (v like k).

    Returns:
      [B, L, H, K] split like q.
    """
    has_bias, has_mask = bias is not None, mask is not None

    def body(q_l: Array, k_l: Array, v_l: Array, *rest: Array) -> Array:
        k_all, v_all = (jax.lax.all_gather(t, plan.cp, axis=1, tiled=True) for t in (k_l, v_l))
        b, m = (rest[0] if has_bias else None), (rest[-1] if has_mask else None)
        return attend(q_l, k_all, v_all, b, m)

    args = [a for a in (q, k, v, bias, mask) if a is not None]
    return _shard_map(body, plan.dims, _spec(plan.out_dims))(*args)
