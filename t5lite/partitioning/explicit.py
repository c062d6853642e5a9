"""Explicit sharding mode: the layout a `Partitioner(shard_mode='explicit')` installs.

On Explicit mesh axes (JAX's sharding in types) every array's sharding is part of its type:
`with_sharding_constraint` only asserts, and JAX refuses an op whose output sharding it cannot
infer without communicating (a contraction over a dimension both operands shard, a gather from
a sharded table). Model code states its layouts through `t5lite.constraints`; under this layout

- an activation constraint is a `jax.sharding.reshard` to what the rules give its logical axes
  (names without a rule stay whole, as Flax's constraint leaves them);
- a parameter is gathered over the batch's mesh axes where it is read (ZeRO-3 / FSDP: stored
  split over `data`, whole over `data` in use; the gradient comes back reduce-scattered);
- a contraction keeps a dimension both operands shard alike (partial sums, then one all-reduce:
  Megatron's row-parallel matmul) and gathers one they shard differently (FSDP's weight
  all-gather); an output dimension whose mesh axes another output dimension already holds is
  gathered too, so the output sharding is always legal, and it is given as `out_sharding=`;
- a table lookup keeps the table's row sharding (masked local lookups summed over those axes:
  Megatron's vocab-parallel embedding) and gives the rows the indices' layout.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from t5lite.partitioning.mesh import PartitioningError
from t5lite.partitioning.rules import LogicalRules, mesh_axes_of, resolve_logical_axes

Array = jax.Array
Axes = tuple[str, ...]  # the mesh axes one dimension is split over; () when whole

SHARD_MODES = ("auto", "explicit")


def mesh_for_mode(mesh: Mesh, shard_mode: str) -> Mesh:
    """`mesh` with the axis types `shard_mode` needs, or one line saying why it cannot be.

    Auto mode takes an all-Auto mesh as it is. Explicit mode takes an all-Explicit mesh as it
    is and rebuilds an all-Auto one (`create_mesh`'s) with Explicit axes on the same devices.
    Any other mix is refused.
    """
    if shard_mode not in SHARD_MODES:
        raise PartitioningError(
            f"Partitioner.shard_mode={shard_mode!r} is not one of {', '.join(SHARD_MODES)}"
        )
    types = tuple(getattr(mesh, "axis_types", ()) or (AxisType.Auto,) * len(mesh.axis_names))
    by_type = {
        kind: [n for n, t in zip(mesh.axis_names, types) if t == kind]
        for kind in (AxisType.Auto, AxisType.Explicit)
    }
    other = [n for n, t in zip(mesh.axis_names, types) if t not in by_type]
    n = len(mesh.axis_names)
    if other:
        raise PartitioningError(
            f"mesh axes {other} are {types[mesh.axis_names.index(other[0])]}; t5lite needs "
            "every mesh axis Auto (shard_mode='auto') or Explicit (shard_mode='explicit')"
        )
    if shard_mode == "auto" and by_type[AxisType.Explicit]:
        raise PartitioningError(
            f"mesh axes {by_type[AxisType.Explicit]} are AxisType.Explicit, and "
            "Partitioner.shard_mode is 'auto': pass shard_mode='explicit', or build the mesh "
            f"with axis_types=(jax.sharding.AxisType.Auto,) * {n} (e.g. jax.make_mesh(shape, "
            "names, axis_types=...)), or use t5lite.create_mesh"
        )
    if shard_mode == "explicit" and by_type[AxisType.Auto] and by_type[AxisType.Explicit]:
        raise PartitioningError(
            f"mesh axes {by_type[AxisType.Auto]} are AxisType.Auto and "
            f"{by_type[AxisType.Explicit]} AxisType.Explicit; shard_mode='explicit' needs "
            f"axis_types=(jax.sharding.AxisType.Explicit,) * {n}"
        )
    if shard_mode == "explicit" and by_type[AxisType.Auto]:
        return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * n)
    return mesh


def check_length_rules(rules: LogicalRules) -> None:
    """Refuses tables that split `length` (sequence / context parallelism) in explicit mode."""
    for name, axis in rules:
        if name == "length" and mesh_axes_of(axis):
            raise PartitioningError(
                f"shard_mode='explicit' cannot use a rules table that shards 'length' (rule "
                f"('length', {axis!r}); the sequence_parallel and context_parallel presets): "
                "an attention mask [batch, length, length] would need that mesh axis on two "
                "dimensions; use shard_mode='auto' for these layouts"
            )
        if name == "length":
            return


def explain_untypable(lower: Callable[[], Any], what: str) -> None:
    """Traces `lower()` now, so an op JAX cannot type on Explicit axes fails up front in one
    line (JAX's own first line, and where in t5lite it happened) rather than mid-run."""
    try:
        lower()
    except Exception as e:  # JAX's ShardingTypeError is not public
        if type(e).__name__ != "ShardingTypeError":
            raise
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/t5lite/" in f.filename]
        where = (
            f" at {frames[-1].filename.split('/t5lite/')[-1]}:{frames[-1].lineno}" if frames else ""
        )
        first = str(e).strip().splitlines()[0]
        raise PartitioningError(
            f"shard_mode='explicit': the {what} cannot be typed on Explicit axes{where}: "
            f"{first} (use shard_mode='auto' for this model and layout)"
        ) from None


class ExplicitLayout:
    """`t5lite.constraints.Layout` on Explicit axes: reshards and output shardings by rules."""

    def __init__(self, mesh: Mesh, rules: LogicalRules, shard_if_divisible: Sequence[str]):
        self.mesh = mesh
        self.rules = tuple(rules)
        self.shard_if_divisible = tuple(shard_if_divisible)
        self._known = {name for name, _ in self.rules}
        batch, _ = resolve_logical_axes(("batch",), self.rules, mesh=mesh)
        self.batch_axes = frozenset(mesh_axes_of(batch[0]))

    def spec_of(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """What the rules give an activation; names without a rule stay whole (as in Flax)."""
        axes = tuple(a if a in self._known else None for a in logical_axes)
        spec, _ = resolve_logical_axes(
            axes,
            self.rules,
            shape=tuple(shape),
            mesh=self.mesh,
            shard_if_divisible=self.shard_if_divisible,
        )
        return spec

    def constrain(self, x: Array, logical_axes: Sequence[str | None]) -> Array:
        return jax.sharding.reshard(x, self.spec_of(logical_axes, x.shape))

    def dot_general(self, lhs: Array, rhs: Array, dimension_numbers: Any, **kwargs: Any) -> Array:
        (lc, rc), (lb, rb) = dimension_numbers
        # One label per dimension, as in an einsum; shared dimensions share a label.
        lhs_l = [f"l{i}" for i in range(lhs.ndim)]
        rhs_l = [f"r{j}" for j in range(rhs.ndim)]
        for i, j in [*zip(lc, rc), *zip(lb, rb)]:
            rhs_l[j] = lhs_l[i]
        out_l = (
            [lhs_l[i] for i in lb]
            + [c for i, c in enumerate(lhs_l) if i not in (*lc, *lb)]
            + [c for j, c in enumerate(rhs_l) if j not in (*rc, *rb)]
        )
        lhs, rhs, out = self._compatible(lhs, rhs, lhs_l, rhs_l, out_l)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, out_sharding=out, **kwargs)

    def einsum(self, subscripts: str, lhs: Array, rhs: Array, **kwargs: Any) -> Array:
        ins, _, out_l = subscripts.replace(" ", "").partition("->")
        lhs_l, _, rhs_l = ins.partition(",")
        if not out_l or "." in subscripts or len(set(lhs_l)) < len(lhs_l):
            raise ValueError(f"einsum {subscripts!r}: give two operands and '->' without '...'")
        lhs, rhs, out = self._compatible(lhs, rhs, list(lhs_l), list(rhs_l), list(out_l))
        return jax.numpy.einsum(subscripts, lhs, rhs, out_sharding=out, **kwargs)

    def take(self, table: Array, indices: Array) -> Array:
        idx = _spec(indices)
        used = {t for axes in idx for t in axes}
        tab = _spec(table)
        # Rows keep their split when the indices do not use those axes (masked lookups + one
        # all-reduce); a trailing dimension on an axis the indices hold is gathered.
        new = [tab[0] if not used.intersection(tab[0]) else ()]
        new += [axes if not used.intersection(axes) else () for axes in tab[1:]]
        table = _reshard_if(table, tab, new)
        out = PartitionSpec(*(_entry(a) for a in [*idx, *new[1:]]))
        return table.at[indices].get(mode="fill", out_sharding=out)

    def weight(self, x: Array) -> Array:
        spec = _spec(x)
        return _reshard_if(x, spec, [tuple(t for t in a if t not in self.batch_axes) for a in spec])

    def whole(self, x: Array) -> Array:
        return jax.sharding.reshard(x, PartitionSpec())

    @staticmethod
    def _compatible(
        lhs: Array, rhs: Array, lhs_l: list[str], rhs_l: list[str], out_l: list[str]
    ) -> tuple[Array, Array, PartitionSpec]:
        """Operands resharded so JAX can type the contraction, and the output's sharding."""
        ls, rs = _spec(lhs), _spec(rhs)
        lhs_s, rhs_s = dict(zip(lhs_l, ls)), dict(zip(rhs_l, rs))
        for c in [c for c in lhs_l if c in rhs_s]:  # in lhs order: the same choice every run
            if lhs_s[c] == rhs_s[c]:
                continue
            if c in out_l:  # a batch dimension: the rhs follows the lhs (the activation)
                rhs_s[c] = lhs_s[c]
            else:  # contracted, split differently: both whole (gather the weight)
                lhs_s[c] = rhs_s[c] = ()
        # The lhs keeps its other dimensions; a rhs dimension on a mesh axis the lhs already
        # holds is gathered (an output may use each mesh axis once).
        used = {t for axes in lhs_s.values() for t in axes}
        for c in rhs_l:
            if c not in lhs_s:
                if used.intersection(rhs_s[c]):
                    rhs_s[c] = ()
                used.update(rhs_s[c])
        lhs = _reshard_if(lhs, ls, [lhs_s[c] for c in lhs_l])
        rhs = _reshard_if(rhs, rs, [rhs_s[c] for c in rhs_l])
        out = PartitionSpec(*(_entry(lhs_s[c] if c in lhs_s else rhs_s[c]) for c in out_l))
        return lhs, rhs, out


def _spec(x: Array) -> list[Axes]:
    """The mesh axes of each dimension of `x`, from its type."""
    spec = tuple(jax.typeof(x).sharding.spec)
    spec = spec + (None,) * (x.ndim - len(spec))
    return [mesh_axes_of(e) for e in spec]


def _entry(axes: Axes) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _reshard_if(x: Array, old: list[Axes], new: list[Axes]) -> Array:
    if list(old) == list(new):
        return x
    return jax.sharding.reshard(x, PartitionSpec(*(_entry(a) for a in new)))
