"""Device meshes: `('data', 'model')`, hybrid `('replica', 'data', 'model')` and TPU submeshes,
each with a leading `stage` axis for pipeline parallelism when `num_stages > 1`.

The mesh axis names live here and in the rules tables only; model code never sees them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

DATA, MODEL, REPLICA = "data", "model", "replica"
STAGE = "stage"  # pipeline stages (t5lite/model/pipeline.py): the scanned `layers` split


class PartitioningError(ValueError):
    """A layout, mesh or batch that cannot be partitioned; the message names the culprit."""


def create_mesh(
    num_partitions: int | None = None,
    *,
    model_parallel_submesh: Sequence[int] | None = None,
    ici_mesh_shape: Sequence[int] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
    devices: Sequence[Any] | None = None,
    num_stages: int = 1,
) -> Mesh:
    """Builds the device mesh with axes `('data', 'model')`, or `('replica', 'data', 'model')`.

    Give one of (several only when they agree on the size of the `model` axis; the most
    specific one then builds the mesh, so a run preset's `num_partitions` and a user's
    multi-slice shapes combine):
      num_partitions: size of the `model` axis; `data` takes the remaining devices.
      model_parallel_submesh: the physical TPU block (e.g. `(2, 2, 1, 2)` = x, y, z, core) that
        forms one model-parallel group; its product is the `model` size. On devices without
        physical coordinates (CPU, GPU) only the product matters.
      ici_mesh_shape: explicit `(data, model)` or `(replica, data, model)` within a slice; with
        `dcn_mesh_shape` (same length) the mesh is hybrid: axis i has `dcn[i] * ici[i]` devices,
        the slow DCN links outermost.

      num_stages: pipeline stages; above 1 a `stage` axis of that size leads the mesh and the
        axes above are built, as described, from each stage's `1/num_stages` of the devices
        (consecutive device blocks, so on a multi-slice or multi-host machine whole slices or
        hosts form a stage and only stage-to-stage activations cross the slow links).

    Unlike t5x, `num_partitions` is honoured on CPU too, so fake-device tests see real meshes.
    Device order is topology-aware (`mesh_utils`) on TPU and GPU.
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_stages != 1:
        return _staged_mesh(
            num_stages,
            devices,
            num_partitions=num_partitions,
            model_parallel_submesh=model_parallel_submesh,
            ici_mesh_shape=ici_mesh_shape,
            dcn_mesh_shape=dcn_mesh_shape,
        )
    given = [
        n
        for n, v in (
            ("num_partitions", num_partitions),
            ("model_parallel_submesh", model_parallel_submesh),
            ("ici_mesh_shape", ici_mesh_shape),
        )
        if v is not None
    ]
    _check_model_sizes_agree(num_partitions, model_parallel_submesh, ici_mesh_shape, dcn_mesh_shape)
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
        check_mesh_size(shape, names, len(devices))
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


def _staged_mesh(num_stages: int, devices: list[Any], **shapes: Any) -> Mesh:
    """`('stage', *axes)`: each stage's block of devices is the mesh `create_mesh` would build."""
    if num_stages < 1 or len(devices) % num_stages:
        raise PartitioningError(
            f"create_mesh: num_stages={num_stages} does not divide the {len(devices)} devices "
            "present"
        )
    per_stage = len(devices) // num_stages
    inner = [
        create_mesh(devices=devices[i * per_stage : (i + 1) * per_stage], **shapes)
        for i in range(num_stages)
    ]
    arr = np.stack([m.devices for m in inner])
    return Mesh(arr, (STAGE, *inner[0].axis_names))


def _check_model_sizes_agree(
    num_partitions: int | None,
    submesh: Sequence[int] | None,
    ici: Sequence[int] | None,
    dcn: Sequence[int] | None,
) -> None:
    """Several mesh specifications are fine when they name the same `model` size."""
    sizes = []
    if num_partitions is not None:
        sizes.append((f"num_partitions={num_partitions}", int(num_partitions)))
    if submesh is not None:
        sizes.append((f"model_parallel_submesh={tuple(submesh)}", math.prod(submesh)))
    if ici is not None:
        model = int(ici[-1]) * (int(dcn[-1]) if dcn is not None and len(dcn) else 1)
        label = f"ici_mesh_shape={tuple(ici)}" + (
            f" x dcn_mesh_shape={tuple(dcn)}" if dcn is not None else ""
        )
        sizes.append((label, model))
    if len({size for _, size in sizes}) > 1:
        described = ", ".join(f"{label} (model axis {size})" for label, size in sizes)
        raise PartitioningError(
            f"create_mesh: {described} contradict each other; give one, or the same model size"
        )


def check_mesh_size(shape: tuple[int, ...], names: tuple[str, ...], num_devices: int) -> None:
    """Rejects a mesh shape whose device count differs from the devices present."""
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


def mesh_str(mesh: Mesh) -> str:
    """`{data: 2, model: 4}`: a mesh's shape for messages."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.shape.items()) + "}"
