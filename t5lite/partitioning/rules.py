"""Rules tables and their resolution: how logical axis names become `PartitionSpec`s.

Model code names array dimensions with logical axes (`batch`, `embed`, `mlp`, ...). A rules table
maps those names onto mesh axes (`data`, `model`, optionally `replica`). This module is the only
place that knows how a name becomes a `PartitionSpec`.

Rule order is priority with fallback, exactly as in Flax/t5x: for each rule in turn, the first
dimension carrying the rule's logical name takes the rule's mesh axis if that dimension is still
unassigned and no other dimension of the same array already uses that mesh axis.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, PartitionSpec

from t5lite.partitioning.mesh import DATA, MODEL, STAGE, PartitioningError, mesh_str

MeshAxis = str | tuple[str, ...] | None
LogicalRules = Sequence[tuple[str, MeshAxis]]
PyTree = Any


# Names that are never sharded by the standard tables (explicit `None`, so the rule exists and a
# missing rule can be told apart from a deliberately replicated name): t5lite's own (`kv_length`
# is the key/value positions inside attention, which context parallelism keeps whole) and the
# rest of t5x's vocabulary, so t5x-style modules partition unchanged: `abspos_buckets` (learned
# absolute positions), `stack` (stacked, unscanned layers), `mlp_activations` (the gated MLP's
# activation index), and from t5x's MoE tables `expert_group` and `unmodeled`. `lora_rank` is
# the inner dimension of LoRA's factors (model/lora.py): a few columns, never worth splitting.
_REPLICATED_NAMES = (
    "length",
    "kv_length",
    "kv",
    "relpos_buckets",
    "layers",
    "lora_rank",
    "abspos_buckets",
    "stack",
    "mlp_activations",
    "expert_group",
    "unmodeled",
)


def _expert_rules(data_axis: MeshAxis) -> list[tuple[str, MeshAxis]]:
    """t5x's MoE names (t5x/contrib/moe, with model parallelism): experts split over the data
    axis, each expert's MLP over `model` (Megatron inside every expert), expert replicas not
    split. `expert_capacity` is t5lite's: the slots of an expert's tokens in the dispatched
    activations [expert, expert_group, expert_capacity, embed] (model/moe.py), kept whole."""
    return [
        ("expert", data_axis),
        ("expert_mlp", MODEL),
        ("expert_replicas", None),
        ("expert_capacity", None),
    ]


def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: LogicalRules | None = None,
    data_axis: MeshAxis = DATA,
) -> tuple[tuple[str, MeshAxis], ...]:
    """The t5x rules table for 1D/2D activation and parameter partitioning.

    Args:
      activation_partitioning_dims: 1 shards activations over `batch` only; 2 also shards their
        `embed` dimension over `model` (2D activation partitioning, GSPMD §3.3).
      parameter_partitioning_dims: 1 shards parameters over `model` only (Megatron-style); 2 also
        shards their `embed` dimension over `data` (ZeRO-3 / FSDP).
      additional_rules: appended after the standard ones (lowest priority).
      data_axis: the mesh axis (or axes) the batch is split over; `('replica', 'data')` on a
        multi-slice mesh.

    Returns:
      A tuple of `(logical_name, mesh_axis_or_None)` pairs, highest priority first.
    """
    if activation_partitioning_dims not in (1, 2) or parameter_partitioning_dims not in (1, 2):
        raise PartitioningError(
            "standard_logical_axis_rules: activation_partitioning_dims and "
            "parameter_partitioning_dims must each be 1 or 2, got "
            f"{activation_partitioning_dims} and {parameter_partitioning_dims}"
        )
    rules: list[tuple[str, MeshAxis]] = [
        ("batch", data_axis),
        ("vocab", MODEL),
        ("mlp", MODEL),
        ("heads", MODEL),
        ("kv_heads", MODEL),
        ("joined_kv", MODEL),
    ]
    # The order of the two `embed` rules is what makes 2/2 work: activations [batch, length,
    # embed] take `model` (batch holds `data`); parameters [embed, mlp] find `model` taken by
    # `mlp` and fall back to `data`.
    if activation_partitioning_dims == 1 and parameter_partitioning_dims == 1:
        rules.append(("embed", None))
    elif activation_partitioning_dims == 2 and parameter_partitioning_dims == 1:
        rules.append(("embed", MODEL))
    elif activation_partitioning_dims == 1 and parameter_partitioning_dims == 2:
        rules.append(("embed", DATA))
    else:
        rules += [("embed", MODEL), ("embed", DATA)]
    rules += [(name, None) for name in _REPLICATED_NAMES]
    rules += _expert_rules(data_axis)
    rules += list(additional_rules or ())
    return tuple(rules)


def data_parallel_logical_axis_rules(
    additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, MeshAxis], ...]:
    """Pure data parallelism: the batch is split over every mesh axis, all weights replicated."""
    rules: list[tuple[str, MeshAxis]] = [("batch", (DATA, MODEL))]
    names = [n for n in _REPLICATED_NAMES if n != "expert_group"]
    for name in ("vocab", "mlp", "heads", "kv_heads", "joined_kv", "embed", *names):
        rules.append((name, None))
    # As t5x's MoE table when the batch spans both axes: experts over `data`, their replicas
    # over `model` (the second data axis), no expert-MLP split. The dispatched activations
    # [expert, expert_group, expert_capacity, embed] keep their groups (sequences) over
    # `model`, where the batch has them: the dispatch is an all-to-all over `data` only.
    rules += [
        ("expert", DATA),
        ("expert_mlp", None),
        ("expert_replicas", MODEL),
        ("expert_group", MODEL),
        ("expert_capacity", None),
    ]
    return tuple(rules + list(additional_rules or ()))


# The named layouts: one table that the gin presets (configs/partitioning/*.gin), `t5lite plan`
# and the tests all read. name -> (activation_partitioning_dims, parameter_partitioning_dims) of
# the t5x table it starts from; None: pure data parallelism. Presets in `_TABLE_EDITS` then
# move `length` or the expert names (see there).
PRESETS: dict[str, tuple[int, int] | None] = {
    "data_parallel": None,
    "megatron": (1, 1),
    "fsdp": (1, 2),
    "activations_2d": (2, 1),
    "fully_sharded": (2, 2),
    "sequence_parallel": (1, 1),
    "context_parallel": (1, 1),
    "context_parallel_ring": (1, 1),
    # GSPMD's 2D sharding (weights [embed -> data, mlp/heads -> model], activations [batch ->
    # data, embed -> model]) is t5x's 2/2 table: the rules-only form of 2D tensor parallelism
    # (Optimus splits each weight's input dim over rows and its output dim over columns, which
    # one rule per name cannot say for both MLP matrices; see docs/partitioning.md).
    "tensor_2d": (2, 2),
    # GShard expert parallelism (Lepikhin et al. 2020): Megatron's dense layers; experts over
    # `data`, each expert whole on its devices (`expert_mlp` replicated, no all-reduce inside an
    # expert), its tokens split over `model` (`expert_capacity`). The dispatch and combine
    # einsums of model/moe.py become all-to-alls over `data`. The other presets keep t5x's MoE
    # rules: experts over `data` too, with Megatron (`expert_mlp` -> model) inside every expert,
    # or, with 2D parameters, experts unsplit and `embed` over `data` (ZeRO-3).
    "expert_parallel": (1, 1),
}


EXPERT_PRESETS = ("expert_parallel",)
"""Presets that only differ from another for a model with experts (`num_experts > 0`)."""


def presets_for(num_experts: int) -> tuple[str, ...]:
    """The presets worth searching for a model: the expert layouts only when it has experts."""
    return tuple(p for p in PRESETS if num_experts > 0 or p not in EXPERT_PRESETS)


def _sequence_parallel(rules: list[tuple[str, MeshAxis]]) -> list[tuple[str, MeshAxis]]:
    """Megatron-3 (Korthikanti et al. 2022): `length` -> model *after* mlp/heads/vocab.

    Between the blocks the residual stream [batch, length, embed] takes `model` on `length`
    (layer norms, dropout and the residual adds work on 1/model of the tokens); inside a block
    `heads` / `mlp` / `vocab` come first and take `model`, so `length` falls back to whole
    there. Each block's all-reduce becomes an all-gather (before its column-parallel matmuls)
    and a reduce-scatter (to the length-sharded residual), written by `collectives.py`.
    """
    return [(n, MODEL if n == "length" else a) for n, a in rules]


def _context_parallel(rules: list[tuple[str, MeshAxis]]) -> list[tuple[str, MeshAxis]]:
    """`model` becomes the context axis: every activation's `length` -> model, first.

    Queries, the MLP, norms and logits work on 1/model of the positions; keys and values
    (`kv_length`, replicated) are all-gathered inside attention and their gradients
    reduce-scattered back (`t5lite/context_parallel.py`). Weights are replicated over
    `model` (their gradients are summed over data and context, as in Megatron's context
    parallelism); with the length rule first, no activation dimension other than `length` can
    take `model`.
    """
    front = [("length", MODEL)]
    rest = [(n, None if a == MODEL else a) for n, a in rules if n != "length"]
    return front + rest


def _context_parallel_ring(rules: list[tuple[str, MeshAxis]]) -> list[tuple[str, MeshAxis]]:
    """`context_parallel` with keys and values split by position too (`kv_length` -> model):
    they go around the ring of `model` inside attention (`model/ring_attention.py`) instead of
    being all-gathered."""
    cp = _context_parallel(rules)
    return cp[:1] + [("kv_length", MODEL)] + [(n, a) for n, a in cp[1:] if n != "kv_length"]


def _expert_parallel(rules: list[tuple[str, MeshAxis]]) -> list[tuple[str, MeshAxis]]:
    """Experts whole (`expert_mlp` replicated), their capacity slots over `model`."""
    moved = {"expert_mlp": None, "expert_capacity": MODEL}
    return [(n, moved.get(n, a)) for n, a in rules]


_TABLE_EDITS = {
    "sequence_parallel": _sequence_parallel,
    "context_parallel": _context_parallel,
    "context_parallel_ring": _context_parallel_ring,
    "expert_parallel": _expert_parallel,
}


def preset_rules(
    name: str,
    additional_rules: LogicalRules | None = None,
    data_axis: MeshAxis = DATA,
    overrides: Mapping[str, MeshAxis] | None = None,
) -> tuple[tuple[str, MeshAxis], ...]:
    """The rules table of a named preset (see `PRESETS`).

    Args:
      name: a key of `PRESETS`.
      additional_rules: appended after the preset's rules (lowest priority).
      data_axis: the mesh axis (or axes) the batch is split over (standard tables only);
        `('replica', 'data')` on a multi-slice mesh.
      overrides: logical name -> mesh axis (None: replicated) replacing the preset's rules for
        that name in place, their priority kept; e.g. `{'expert': 'model', 'expert_mlp': None}`
        puts whole experts over `model` (docs/moe.md).
    """
    rules = _preset_table(name, additional_rules, data_axis)
    for logical in overrides or {}:
        if logical not in (n for n, _ in rules):
            raise PartitioningError(
                f"preset_rules.overrides: preset {name!r} has no rule for {logical!r} to override"
            )
    return tuple((n, overrides[n] if overrides and n in overrides else a) for n, a in rules)


def _preset_table(
    name: str, additional_rules: LogicalRules | None, data_axis: MeshAxis
) -> tuple[tuple[str, MeshAxis], ...]:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, sorted(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PartitioningError(
            f"unknown partitioning preset {name!r}{hint}; known: {', '.join(sorted(PRESETS))}"
        )
    dims = PRESETS[name]
    if dims is None:
        return data_parallel_logical_axis_rules(additional_rules)
    rules = list(standard_logical_axis_rules(*dims, data_axis=data_axis))
    if name in _TABLE_EDITS:
        rules = _TABLE_EDITS[name](rules)
    return tuple(rules + list(additional_rules or ()))


def pipeline_rules(
    base: str = "megatron", additional_rules: LogicalRules | None = None, data_axis: MeshAxis = DATA
) -> tuple[tuple[str, MeshAxis], ...]:
    """A preset's table with the scanned `layers` split over the `stage` mesh axis: pipeline
    parallelism (t5lite/model/pipeline.py; `Partitioner.num_stages` adds the axis).

    Each stage holds `1/stages` of the layers and of their optimizer state; nothing else names
    `stage`, so every other dimension is laid out by `base` on the other axes (data parallel,
    Megatron, FSDP, multi-slice's `('replica', 'data')` batch).

    Args:
      base: a key of `PRESETS`.
      additional_rules, data_axis: as for `preset_rules`.
    """
    rules = preset_rules(base, additional_rules, data_axis)
    return tuple((n, STAGE if n == "layers" else a) for n, a in rules)


@dataclasses.dataclass(frozen=True)
class ExplicitSpec:
    """A layout given in mesh axes (e.g. by `nn.with_partitioning`), bypassing the rules."""

    spec: PartitionSpec


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one array is laid out on the mesh."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    logical_axes: tuple[str | None, ...] | None  # None: not annotated; explicit specs: mesh axes
    spec: PartitionSpec
    shard_shape: tuple[int, ...]
    # Logical names with a rule to a real mesh axis that ended up unsharded because the axis was
    # taken by another dimension of the same array (or, for `shard_if_divisible` names, because
    # the dimension does not divide).
    replicated_despite_rule: tuple[str, ...] = ()

    @property
    def bytes_total(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * np.dtype(self.dtype).itemsize


def mesh_axes_of(assignment: MeshAxis) -> tuple[str, ...]:
    if assignment is None:
        return ()
    return (assignment,) if isinstance(assignment, str) else tuple(assignment)


def describe(path: str, shape: Sequence[int] | None, axes: Any, mesh: Mesh | None) -> str:
    parts = [f"parameter {path!r}" if path else "array"]
    if shape is not None:
        parts.append(f"shape {tuple(shape)}")
    if axes is not None:
        parts.append(f"logical axes {tuple(axes)}")
    if mesh is not None:
        parts.append(f"mesh {mesh_str(mesh)}")
    return ", ".join(parts)


def resolve_logical_axes(
    logical_axes: Sequence[str | None],
    rules: LogicalRules,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    path: str = "",
    shard_if_divisible: Sequence[str] = (),
) -> tuple[PartitionSpec, tuple[str, ...]]:
    """Maps one array's logical axes to a `PartitionSpec` with Flax's priority-and-fallback rule.

    Args:
      logical_axes: one logical name (or None) per dimension.
      rules: the rules table.
      shape, mesh: when given, divisibility is checked (and `shard_if_divisible` applied).
      path: the array's name for error messages.
      shard_if_divisible: logical names that fall back to the next rule (or replication) instead
        of failing when their dimension does not divide the mesh axis (e.g. `kv_heads`).

    Returns:
      The `PartitionSpec` and the logical names left unsharded despite a sharding rule.

    Raises:
      PartitioningError: a name without any rule, a name used twice, a rule to a mesh axis the
        mesh lacks, or a dimension that does not divide its mesh axes.
    """
    axes = tuple(logical_axes)
    if shape is not None and len(shape) != len(axes):
        raise PartitioningError(
            f"{describe(path, shape, axes, mesh)}: {len(axes)} logical axes for "
            f"{len(shape)} dimensions"
        )
    names = [a for a in axes if a is not None]
    if len(set(names)) != len(names):
        raise PartitioningError(
            f"{describe(path, shape, axes, mesh)}: a logical axis name occurs twice"
        )
    known = {name for name, _ in rules}
    for a in names:
        if a not in known:
            raise PartitioningError(
                f"{describe(path, shape, axes, mesh)}: logical axis {a!r} has no rule in the "
                f"logical_axis_rules table (known names: {sorted(known)})"
            )

    unassigned = object()
    result: list[Any] = [unassigned if a is not None else None for a in axes]
    wanted: set[str] = set()  # names that some rule would have sharded
    for rule_name, mesh_axis in rules:
        if rule_name not in names:
            continue
        pos = axes.index(rule_name)
        targets = mesh_axes_of(mesh_axis)
        if mesh is not None:
            for t in targets:
                if t not in mesh.shape:
                    raise PartitioningError(
                        f"rule ({rule_name!r}, {mesh_axis!r}) names mesh axis {t!r}, which mesh "
                        f"{mesh_str(mesh)} does not have"
                    )
        if targets:
            wanted.add(rule_name)
        if result[pos] is not unassigned:
            continue
        taken = {t for r in result if r is not unassigned for t in mesh_axes_of(r)}
        if taken.intersection(targets):
            continue
        if (
            targets
            and shape is not None
            and mesh is not None
            and rule_name in shard_if_divisible
            and shape[pos] % math.prod(mesh.shape[t] for t in targets)
        ):
            continue
        result[pos] = mesh_axis
    result = [None if r is unassigned else r for r in result]
    flagged = tuple(a for a, r in zip(axes, result) if a in wanted and r is None)
    spec = PartitionSpec(*result)
    if shape is not None and mesh is not None and "expert" in axes:
        _check_experts(axes.index("expert"), spec, shape, mesh, path)
    if shape is not None and mesh is not None:
        validate_spec(spec, shape, mesh, path=path, logical_axes=axes)
    return spec, flagged


def _check_experts(
    dim: int, spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, path: str
) -> None:
    """One line naming `num_experts` when the experts do not divide their mesh axes."""
    entry = spec[dim] if dim < len(spec) else None
    size = math.prod(mesh.shape[t] for t in mesh_axes_of(entry) if t in mesh.shape)
    if shape[dim] % size:
        raise PartitioningError(
            f"num_experts={shape[dim]} is not divisible by mesh axes {entry!r} of size {size}, "
            f"which the rules give 'expert' ({path or 'array'}, mesh {mesh_str(mesh)}): use a "
            f"multiple of {size} experts or another rule for 'expert'"
        )


def validate_spec(
    spec: PartitionSpec,
    shape: Sequence[int] | None,
    mesh: Mesh,
    *,
    path: str = "",
    logical_axes: Sequence[str | None] | None = None,
) -> None:
    """Rejects illegal layouts (a mesh axis used twice), unknown mesh axes and uneven splits."""
    used: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        for t in mesh_axes_of(entry):
            if t not in mesh.shape:
                raise PartitioningError(
                    f"{describe(path, shape, logical_axes, mesh)}: PartitionSpec {spec} names "
                    f"mesh axis {t!r}, which the mesh does not have"
                )
            if t in used:
                raise PartitioningError(
                    f"{describe(path, shape, logical_axes, mesh)}: illegal layout {spec}: "
                    f"dimensions {used[t]} and {dim} are both mapped to mesh axis {t!r}"
                )
            used[t] = dim
    if shape is None:
        return
    if len(spec) > len(shape):
        raise PartitioningError(
            f"{describe(path, shape, logical_axes, mesh)}: PartitionSpec {spec} has more "
            "entries than the array has dimensions"
        )
    for dim, entry in enumerate(spec):
        size = math.prod(mesh.shape[t] for t in mesh_axes_of(entry))
        if shape[dim] % size:
            raise PartitioningError(
                f"{describe(path, shape, logical_axes, mesh)}: dimension {dim} of size "
                f"{shape[dim]} is not divisible by mesh axes {entry!r} of size {size}"
            )


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        out[dim] //= math.prod(mesh.shape[t] for t in mesh_axes_of(entry))
    return tuple(out)


def is_axes_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec | ExplicitSpec)


def logical_axes_of(boxed_tree: PyTree) -> PyTree:
    """The logical axes of a tree of Flax variables (boxed by `with_logical_partitioning`).

    Returns a tree of the unboxed structure whose leaves are `PartitionSpec`s of logical names,
    `ExplicitSpec`s for mesh-axis boxes (`nn.with_partitioning`), or None where not annotated.
    """

    def axes(x: Any) -> Any:
        if isinstance(x, nn.LogicallyPartitioned):
            return PartitionSpec(*x.names)
        if isinstance(x, nn.Partitioned):
            return ExplicitSpec(PartitionSpec(*x.names))
        return None

    return jax.tree_util.tree_map(
        axes, boxed_tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
    )
