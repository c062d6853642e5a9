"""Mesh, logical-axis rules and the Partitioner: how logical names become `NamedSharding`s.

Model code names array dimensions with logical axes (`batch`, `embed`, `mlp`, ...). A rules table
maps those names onto mesh axes (`data`, `model`, optionally `replica`). This module is the only
place that knows how a name becomes a `PartitionSpec`: it builds the mesh, resolves and validates
layouts, and jits functions with explicit input/output shardings (XLA GSPMD does the rest).

Rule order is priority with fallback, exactly as in Flax/t5x: for each rule in turn, the first
dimension carrying the rule's logical name takes the rule's mesh axis if that dimension is still
unassigned and no other dimension of the same array already uses that mesh axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxis = str | tuple[str, ...] | None
LogicalRules = Sequence[tuple[str, MeshAxis]]
PyTree = Any

DATA, MODEL, REPLICA = "data", "model", "replica"


class PartitioningError(ValueError):
    """A layout, mesh or batch that cannot be partitioned; the message names the culprit."""


# ---------------------------------------------------------------------------------------------
# Rules tables
# ---------------------------------------------------------------------------------------------

# Names that are never sharded by the standard tables (explicit `None`, so the rule exists and a
# missing rule can be told apart from a deliberately replicated name).
_REPLICATED_NAMES = ("length", "kv", "relpos_buckets", "layers")


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
    rules += list(additional_rules or ())
    return tuple(rules)


def data_parallel_logical_axis_rules(
    additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, MeshAxis], ...]:
    """Pure data parallelism: the batch is split over every mesh axis, all weights replicated."""
    rules: list[tuple[str, MeshAxis]] = [("batch", (DATA, MODEL))]
    for name in ("vocab", "mlp", "heads", "kv_heads", "joined_kv", "embed", *_REPLICATED_NAMES):
        rules.append((name, None))
    return tuple(rules + list(additional_rules or ()))


# ---------------------------------------------------------------------------------------------
# Mesh construction
# ---------------------------------------------------------------------------------------------


def create_mesh(
    num_partitions: int | None = None,
    *,
    model_parallel_submesh: Sequence[int] | None = None,
    ici_mesh_shape: Sequence[int] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds the device mesh with axes `('data', 'model')`, or `('replica', 'data', 'model')`.

    Give exactly one of:
      num_partitions: size of the `model` axis; `data` takes the remaining devices.
      model_parallel_submesh: the physical TPU block (e.g. `(2, 2, 1, 2)` = x, y, z, core) that
        forms one model-parallel group; its product is the `model` size. On devices without
        physical coordinates (CPU, GPU) only the product matters.
      ici_mesh_shape: explicit `(data, model)` or `(replica, data, model)` within a slice; with
        `dcn_mesh_shape` (same length) the mesh is hybrid: axis i has `dcn[i] * ici[i]` devices,
        the slow DCN links outermost.

    Unlike t5x, `num_partitions` is honoured on CPU too, so fake-device tests see real meshes.
    Device order is topology-aware (`mesh_utils`) on TPU and GPU.
    """
    devices = list(jax.devices() if devices is None else devices)
    given = [
        n
        for n, v in (
            ("num_partitions", num_partitions),
            ("model_parallel_submesh", model_parallel_submesh),
            ("ici_mesh_shape", ici_mesh_shape),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise PartitioningError(f"create_mesh: give only one of {given}")
    if dcn_mesh_shape is not None and ici_mesh_shape is None:
        raise PartitioningError("create_mesh: dcn_mesh_shape needs ici_mesh_shape")
    if not given:
        num_partitions = 1

    if ici_mesh_shape is not None:
        ici = tuple(int(d) for d in ici_mesh_shape)
        if len(ici) not in (2, 3):
            raise PartitioningError(
                f"create_mesh: ici_mesh_shape {ici} must have 2 (data, model) or 3 "
                "(replica, data, model) entries"
            )
        dcn = tuple(int(d) for d in dcn_mesh_shape) if dcn_mesh_shape is not None else None
        if dcn is not None and len(dcn) != len(ici):
            raise PartitioningError(
                f"create_mesh: dcn_mesh_shape {dcn} and ici_mesh_shape {ici} differ in length"
            )
        shape = tuple(i * (dcn[k] if dcn else 1) for k, i in enumerate(ici))
        names = (DATA, MODEL) if len(ici) == 2 else (REPLICA, DATA, MODEL)
        _check_mesh_size(shape, names, len(devices))
        if dcn is not None:
            arr = _hybrid_device_array(ici, dcn, devices)
        else:
            arr = _device_array(shape, devices)
        return Mesh(arr, names)

    if model_parallel_submesh is not None:
        sub = tuple(int(d) for d in model_parallel_submesh)
        num_partitions = math.prod(sub)
        if len(devices) % num_partitions:
            raise PartitioningError(
                f"create_mesh: model_parallel_submesh {sub} has {num_partitions} devices, "
                f"which does not divide the {len(devices)} devices present"
            )
        if all(hasattr(d, "coords") for d in devices):
            return Mesh(submesh_device_array(devices, sub), (DATA, MODEL))

    assert num_partitions is not None
    if num_partitions < 1 or len(devices) % num_partitions:
        raise PartitioningError(
            f"create_mesh: num_partitions={num_partitions} does not divide the "
            f"{len(devices)} devices present"
        )
    shape = (len(devices) // num_partitions, num_partitions)
    return Mesh(_device_array(shape, devices), (DATA, MODEL))


def _check_mesh_size(shape: tuple[int, ...], names: tuple[str, ...], num_devices: int) -> None:
    if math.prod(shape) != num_devices:
        axes = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
        raise PartitioningError(
            f"mesh ({axes}) has {math.prod(shape)} devices but {num_devices} devices are present"
        )


def _device_array(shape: tuple[int, ...], devices: list[Any]) -> np.ndarray:
    """Devices in topology-aware order where JAX knows the topology, else in id order."""
    if devices[0].platform in ("tpu", "gpu", "cuda", "rocm"):
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape, devices)
    return np.asarray(devices, dtype=object).reshape(shape)


def _hybrid_device_array(
    ici: tuple[int, ...], dcn: tuple[int, ...], devices: list[Any]
) -> np.ndarray:
    """A DCN × ICI mesh: granules (slices, or processes) are the outer index of every axis."""
    if hasattr(devices[0], "slice_index") or jax.process_count() > 1:
        from jax.experimental import mesh_utils

        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not hasattr(devices[0], "slice_index")
        )
    # One process without slices (fake CPU devices): consecutive blocks of devices play granules.
    arr = np.asarray(devices, dtype=object).reshape(*dcn, *ici)
    n = len(ici)
    arr = arr.transpose([a for k in range(n) for a in (k, n + k)])
    return arr.reshape([d * i for d, i in zip(dcn, ici)])


def submesh_device_array(devices: Sequence[Any], submesh: tuple[int, ...]) -> np.ndarray:
    """Arranges TPU devices so each `model` group is one physical block of shape `submesh`.

    Devices carry `coords` (x, y, z) and `core_on_chip`. The physical mesh (X, Y, Z, cores) is
    tiled by `submesh`; tiles index `data`, positions within a tile index `model` (t5x's layout,
    which keeps model-parallel all-reduces on the shortest links).
    """
    coords = np.array([(*d.coords, getattr(d, "core_on_chip", 0)) for d in devices])
    phys = tuple(int(c) + 1 for c in coords.max(axis=0))
    if len(submesh) != len(phys):
        raise PartitioningError(
            f"model_parallel_submesh {submesh} must have {len(phys)} entries (x, y, z, core)"
        )
    if math.prod(phys) != len(devices):
        raise PartitioningError(f"devices do not fill the physical mesh {phys}")
    for s, p in zip(submesh, phys):
        if p % s:
            raise PartitioningError(
                f"model_parallel_submesh {submesh} does not tile the physical mesh {phys}"
            )
    grid = np.empty(phys, dtype=object)
    for d, c in zip(devices, coords):
        grid[tuple(c)] = d
    n = len(phys)
    tiled = grid.reshape([x for p, s in zip(phys, submesh) for x in (p // s, s)])
    tiled = tiled.transpose(list(range(0, 2 * n, 2)) + list(range(1, 2 * n, 2)))
    return tiled.reshape(len(devices) // math.prod(submesh), math.prod(submesh))


# ---------------------------------------------------------------------------------------------
# Resolving logical axes
# ---------------------------------------------------------------------------------------------


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


def _mesh_axes_of(assignment: MeshAxis) -> tuple[str, ...]:
    if assignment is None:
        return ()
    return (assignment,) if isinstance(assignment, str) else tuple(assignment)


def _mesh_str(mesh: Mesh) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.shape.items()) + "}"


def _describe(path: str, shape: Sequence[int] | None, axes: Any, mesh: Mesh | None) -> str:
    parts = [f"parameter {path!r}" if path else "array"]
    if shape is not None:
        parts.append(f"shape {tuple(shape)}")
    if axes is not None:
        parts.append(f"logical axes {tuple(axes)}")
    if mesh is not None:
        parts.append(f"mesh {_mesh_str(mesh)}")
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
            f"{_describe(path, shape, axes, mesh)}: {len(axes)} logical axes for "
            f"{len(shape)} dimensions"
        )
    names = [a for a in axes if a is not None]
    if len(set(names)) != len(names):
        raise PartitioningError(
            f"{_describe(path, shape, axes, mesh)}: a logical axis name occurs twice"
        )
    known = {name for name, _ in rules}
    for a in names:
        if a not in known:
            raise PartitioningError(
                f"{_describe(path, shape, axes, mesh)}: logical axis {a!r} has no rule in the "
                f"logical_axis_rules table (known names: {sorted(known)})"
            )

    unassigned = object()
    result: list[Any] = [unassigned if a is not None else None for a in axes]
    wanted: set[str] = set()  # names that some rule would have sharded
    for rule_name, mesh_axis in rules:
        if rule_name not in names:
            continue
        pos = axes.index(rule_name)
        targets = _mesh_axes_of(mesh_axis)
        if mesh is not None:
            for t in targets:
                if t not in mesh.shape:
                    raise PartitioningError(
                        f"rule ({rule_name!r}, {mesh_axis!r}) names mesh axis {t!r}, which mesh "
                        f"{_mesh_str(mesh)} does not have"
                    )
        if targets:
            wanted.add(rule_name)
        if result[pos] is not unassigned:
            continue
        taken = {t for r in result if r is not unassigned for t in _mesh_axes_of(r)}
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
    if shape is not None and mesh is not None:
        validate_spec(spec, shape, mesh, path=path, logical_axes=axes)
    return spec, flagged


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
        for t in _mesh_axes_of(entry):
            if t not in mesh.shape:
                raise PartitioningError(
                    f"{_describe(path, shape, logical_axes, mesh)}: PartitionSpec {spec} names "
                    f"mesh axis {t!r}, which the mesh does not have"
                )
            if t in used:
                raise PartitioningError(
                    f"{_describe(path, shape, logical_axes, mesh)}: illegal layout {spec}: "
                    f"dimensions {used[t]} and {dim} are both mapped to mesh axis {t!r}"
                )
            used[t] = dim
    if shape is None:
        return
    if len(spec) > len(shape):
        raise PartitioningError(
            f"{_describe(path, shape, logical_axes, mesh)}: PartitionSpec {spec} has more "
            "entries than the array has dimensions"
        )
    for dim, entry in enumerate(spec):
        size = math.prod(mesh.shape[t] for t in _mesh_axes_of(entry))
        if shape[dim] % size:
            raise PartitioningError(
                f"{_describe(path, shape, logical_axes, mesh)}: dimension {dim} of size "
                f"{shape[dim]} is not divisible by mesh axes {entry!r} of size {size}"
            )


def _shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        out[dim] //= math.prod(mesh.shape[t] for t in _mesh_axes_of(entry))
    return tuple(out)


def path_str(path: tuple[Any, ...]) -> str:
    """`('params', 'mlp', 'wi', 'kernel')`-style key paths as `params/mlp/wi/kernel`."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _is_axes_leaf(x: Any) -> bool:
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


# ---------------------------------------------------------------------------------------------
# The Partitioner
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """Which part of the global batch this process loads (t5x's `DataLayout`)."""

    batch_size: int  # global batch size
    shard_id: int  # this process's data shard
    num_shards: int  # number of distinct data shards across processes
    is_first_host_in_replica_set: bool  # False on processes that load a copy of another's shard

    @property
    def per_process_batch_size(self) -> int:
        return self.batch_size // self.num_shards


class Partitioner:
    """Turns logical axes into `NamedSharding`s and jits functions on one mesh with one table.

    The mesh and the rules table are the only places mesh axes appear; everything handed to the
    partitioner (parameters, optimizer state, batches) is described by logical axes.
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        *,
        num_partitions: int | None = None,
        model_parallel_submesh: Sequence[int] | None = None,
        ici_mesh_shape: Sequence[int] | None = None,
        dcn_mesh_shape: Sequence[int] | None = None,
        logical_axis_rules: LogicalRules | None = None,
        strict: bool = False,
        shard_if_divisible: Sequence[str] = ("kv_heads",),
    ):
        """Builds the partitioner.

        Args:
          mesh: a ready mesh; otherwise one is built by `create_mesh` from the next arguments.
          num_partitions, model_parallel_submesh, ici_mesh_shape, dcn_mesh_shape: see
            `create_mesh`.
          logical_axis_rules: the rules table (default: `standard_logical_axis_rules()`).
          strict: turn "replicated despite a rule" and unannotated parameters into errors.
          shard_if_divisible: logical names replicated, not rejected, when they do not divide.
        """
        if mesh is None:
            mesh = create_mesh(
                num_partitions,
                model_parallel_submesh=model_parallel_submesh,
                ici_mesh_shape=ici_mesh_shape,
                dcn_mesh_shape=dcn_mesh_shape,
            )
        _check_mesh_size(tuple(mesh.devices.shape), tuple(mesh.axis_names), mesh.devices.size)
        self.mesh = mesh
        self.rules = tuple(
            (str(n), tuple(a) if isinstance(a, list) else a)
            for n, a in (logical_axis_rules or standard_logical_axis_rules())
        )
        for name, axis in self.rules:
            for t in _mesh_axes_of(axis):
                if t not in mesh.shape:
                    raise PartitioningError(
                        f"rule ({name!r}, {axis!r}) names mesh axis {t!r}, which mesh "
                        f"{_mesh_str(mesh)} does not have"
                    )
        self.strict = strict
        self.shard_if_divisible = tuple(shard_if_divisible)

    # --- context --------------------------------------------------------------------------

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The mesh and rules under which model code's `with_logical_constraint` resolves."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    # --- logical -> physical --------------------------------------------------------------

    def placements(self, abstract_tree: PyTree, axes_tree: PyTree) -> PyTree:
        """One validated `Placement` per array of `abstract_tree` (arrays or ShapeDtypeStructs).

        `axes_tree` has the same structure with `PartitionSpec`s of logical names (or
        `ExplicitSpec`, or None for replicated) as leaves; it may also be a prefix of it.
        """
        flat_axes, axes_treedef = jax.tree_util.tree_flatten_with_path(
            axes_tree, is_leaf=_is_axes_leaf
        )
        # Broadcast a prefix tree of axes over the arrays (e.g. one spec for a whole batch dict).
        subtrees = axes_treedef.flatten_up_to(abstract_tree)
        out = []
        for (prefix, axes), sub in zip(flat_axes, subtrees):
            out.append(
                jax.tree_util.tree_map_with_path(
                    lambda p, x, axes=axes, q=prefix: self._place(path_str(q + p), x, axes), sub
                )
            )
        return jax.tree_util.tree_unflatten(axes_treedef, out)

    def _place(self, path: str, x: Any, axes: Any) -> Placement:
        shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
        dtype = np.dtype(getattr(x, "dtype", np.float32))
        flagged: tuple[str, ...] = ()
        if isinstance(axes, ExplicitSpec):
            spec, logical = axes.spec, tuple(axes.spec)
            validate_spec(spec, shape, self.mesh, path=path)
        elif axes is None:
            if self.strict and shape:
                raise PartitioningError(
                    f"{_describe(path, shape, None, self.mesh)}: has no logical axes "
                    "(strict partitioning requires every parameter to be annotated)"
                )
            spec, logical = PartitionSpec(), None
        else:
            logical = tuple(axes)
            if len(logical) < len(shape):  # a spec may leave trailing dimensions implicit
                logical = logical + (None,) * (len(shape) - len(logical))
            spec, flagged = resolve_logical_axes(
                logical,
                self.rules,
                shape=shape,
                mesh=self.mesh,
                path=path,
                shard_if_divisible=self.shard_if_divisible,
            )
            if flagged and self.strict:
                raise PartitioningError(
                    f"{_describe(path, shape, logical, self.mesh)}: logical axes {list(flagged)} "
                    f"have sharding rules but stay replicated under {spec} (strict mode)"
                )
        return Placement(
            path=path,
            shape=shape,
            dtype=dtype,
            logical_axes=logical,
            spec=spec,
            shard_shape=_shard_shape(shape, spec, self.mesh),
            replicated_despite_rule=flagged,
        )

    def shardings(self, abstract_tree: PyTree, axes_tree: PyTree) -> PyTree:
        """Validated `NamedSharding`s for every array of `abstract_tree`."""
        return jax.tree_util.tree_map(
            lambda p: NamedSharding(self.mesh, p.spec),
            self.placements(abstract_tree, axes_tree),
            is_leaf=lambda x: isinstance(x, Placement),
        )

    def logical_to_mesh_axes(self, axes_tree: PyTree) -> PyTree:
        """Shape-free translation of a tree of logical specs into mesh-axis `PartitionSpec`s."""

        def one(axes: Any) -> PartitionSpec:
            if axes is None:
                return PartitionSpec()
            if isinstance(axes, ExplicitSpec):
                validate_spec(axes.spec, None, self.mesh)
                return axes.spec
            return resolve_logical_axes(tuple(axes), self.rules, mesh=self.mesh)[0]

        return jax.tree_util.tree_map(one, axes_tree, is_leaf=_is_axes_leaf)

    def logical_to_sharding(self, axes_tree: PyTree) -> PyTree:
        """Shape-free translation of a tree of logical specs into `NamedSharding`s."""
        return jax.tree_util.tree_map(
            lambda s: NamedSharding(self.mesh, s),
            self.logical_to_mesh_axes(axes_tree),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def _to_sharding(self, resources: PyTree) -> PyTree:
        """Mesh-axis PartitionSpecs / None / NamedShardings -> NamedShardings."""

        def one(r: Any) -> Any:
            if r is None:
                return NamedSharding(self.mesh, PartitionSpec())
            if isinstance(r, PartitionSpec):
                validate_spec(r, None, self.mesh)
                return NamedSharding(self.mesh, r)
            return r

        return jax.tree_util.tree_map(
            one, resources, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
        )

    # --- initialisation and jit -----------------------------------------------------------

    def initialize(self, init_fn: Callable[..., PyTree], *args: Any) -> tuple[PyTree, PyTree]:
        """Partitioned initialisation: parameters are born sharded, never whole on one device.

        `init_fn(*args)` returns Flax variables whose leaves may be boxed with logical axes.
        Shapes come from `jax.eval_shape` (nothing allocated), shardings from the rules, and
        `init_fn` then runs under `jax.jit(out_shardings=...)`.

        Returns:
          `(variables, logical_axes)`: unboxed arrays and the matching tree of logical specs.
        """
        abstract_boxed = jax.eval_shape(init_fn, *args)
        axes = logical_axes_of(abstract_boxed)
        shardings = self.shardings(meta.unbox(abstract_boxed), axes)

        def unboxed_init(*a: Any) -> PyTree:
            return meta.unbox(init_fn(*a))

        with self.context():
            variables = jax.jit(unboxed_init, out_shardings=shardings)(*args)
        return variables, axes

    def abstract_initialize(
        self, init_fn: Callable[..., PyTree], *args: Any
    ) -> tuple[PyTree, PyTree]:
        """Like `initialize` but returns `ShapeDtypeStruct`s with shardings; allocates nothing."""
        abstract_boxed = jax.eval_shape(init_fn, *args)
        axes = logical_axes_of(abstract_boxed)
        abstract = meta.unbox(abstract_boxed)
        shardings = self.shardings(abstract, axes)
        return (
            jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract,
                shardings,
            ),
            axes,
        )

    def partition(
        self,
        fn: Callable[..., Any],
        in_axis_resources: PyTree,
        out_axis_resources: PyTree,
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
    ) -> PartitionedFunction:
        """Jits `fn` with explicit shardings; calls run under this partitioner's mesh and rules.

        Resources are pytrees (or prefixes) of `NamedSharding`, mesh-axis `PartitionSpec`, or
        None (replicated). Use `shardings` / `logical_to_sharding` to get them from logical axes.
        """
        jitted = jax.jit(
            fn,
            in_shardings=self._to_sharding(in_axis_resources),
            out_shardings=self._to_sharding(out_axis_resources),
            static_argnums=static_argnums,
            donate_argnums=donate_argnums,
        )
        return PartitionedFunction(jitted, self)

    def compile(self, partitioned_fn: PartitionedFunction, *args: Any) -> CompiledFunction:
        """Lowers and compiles ahead of time (args may be `ShapeDtypeStruct`s)."""
        with self.context():
            compiled = partitioned_fn.lower(*args).compile()
        return CompiledFunction(compiled, self)

    # --- data -------------------------------------------------------------------------------

    @functools.cached_property
    def data_partition_spec(self) -> PartitionSpec:
        """Mesh axes of the batch dimension, from the rule for `batch`."""
        spec, _ = resolve_logical_axes(("batch",), self.rules, mesh=self.mesh)
        return spec

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.mesh.shape[t] for t in _mesh_axes_of(self.data_partition_spec[0]))

    def _check_batch(self, batch_size: int) -> None:
        if batch_size % self.data_parallel_size:
            raise PartitioningError(
                f"global batch size {batch_size} is not divisible by the data-parallel size "
                f"{self.data_parallel_size} (batch → mesh axes {self.data_partition_spec[0]!r} "
                f"of mesh {_mesh_str(self.mesh)})"
            )

    def get_data_layout(self, batch_size: int) -> DataLayout:
        """Which slice of each global batch of `batch_size` examples this process must load."""
        self._check_batch(batch_size)
        sharding = NamedSharding(self.mesh, PartitionSpec(self.data_partition_spec[0]))
        owner: dict[tuple[int, int], int] = {}  # batch slice -> lowest process holding it
        for d, idx in sharding.devices_indices_map((batch_size,)).items():
            key = (idx[0].start or 0, idx[0].stop or batch_size)
            owner[key] = min(owner.get(key, d.process_index), d.process_index)
        mine = sorted(
            {
                (i[0].start or 0, i[0].stop or batch_size)
                for i in sharding.addressable_devices_indices_map((batch_size,)).values()
            }
        )
        start, stop = mine[0][0], mine[-1][1]
        if sum(b - a for a, b in mine) != stop - start:
            raise PartitioningError(
                f"this process's devices hold a non-contiguous part of the batch ({mine}); "
                "build the mesh so each process owns whole data shards"
            )
        local = stop - start
        return DataLayout(
            batch_size=batch_size,
            shard_id=start // local,
            num_shards=batch_size // local,
            is_first_host_in_replica_set=all(owner[k] == jax.process_index() for k in mine),
        )

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Sharding of a batch array: dimension 0 over the batch's mesh axes, the rest whole."""
        return NamedSharding(
            self.mesh, PartitionSpec(self.data_partition_spec[0], *([None] * (ndim - 1)))
        )

    def host_local_to_global(
        self, batch: Mapping[str, np.ndarray], global_batch_size: int
    ) -> dict[str, jax.Array]:
        """Assembles global `jax.Array`s from this process's slice of each batch feature."""
        self._check_batch(global_batch_size)
        layout = self.get_data_layout(global_batch_size)
        out = {}
        for name, local in batch.items():
            local = np.asarray(local)
            if local.shape[0] != layout.per_process_batch_size:
                raise PartitioningError(
                    f"batch feature {name!r} has {local.shape[0]} local examples; this process "
                    f"must load {layout.per_process_batch_size} of the global batch of "
                    f"{global_batch_size}"
                )
            out[name] = jax.make_array_from_process_local_data(
                self.batch_sharding(local.ndim), local, (global_batch_size, *local.shape[1:])
            )
        return out


class PartitionedFunction:
    """A jitted function bound to a partitioner: calls and lowering run under its mesh+rules."""

    def __init__(self, jitted: Any, partitioner: Partitioner):
        self._jitted = jitted
        self._partitioner = partitioner

    def __call__(self, *args: Any) -> Any:
        with self._partitioner.context():
            return self._jitted(*args)

    def lower(self, *args: Any) -> Any:
        with self._partitioner.context():
            return self._jitted.lower(*args)


class CompiledFunction:
    """An ahead-of-time compiled function with its memory and cost analyses."""

    def __init__(self, compiled: Any, partitioner: Partitioner):
        self._compiled = compiled
        self._partitioner = partitioner

    def __call__(self, *args: Any) -> Any:
        with self._partitioner.context():
            return self._compiled(*args)

    def memory_analysis(self) -> Any:
        return self._compiled.memory_analysis()

    def cost_analysis(self) -> dict[str, float]:
        cost = self._compiled.cost_analysis()
        # Older JAX returns a one-element list of dicts.
        return cost[0] if isinstance(cost, list | tuple) else (cost or {})

    def as_text(self) -> str:
        return self._compiled.as_text()
