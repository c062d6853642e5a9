"""Laying a layout's mesh over given devices: fake CPU devices, or a TPU topology's compile-only
devices (`topology.get_topology`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from t5lite.partitioning import DATA, STAGE, Partitioner, create_mesh


def mesh_over(shape: Mapping[str, int], devices: Sequence[Any]) -> Mesh:
    """A mesh of `shape` (axis name -> size) over `devices`, topology-aware on TPU.

    `create_mesh` maps each mesh axis onto whole physical axes; when a shape needs a physical
    axis split (model=2 on a 4x4 slice) this falls back to letting JAX split it.
    """
    try:
        return create_mesh(ici_mesh_shape=tuple(shape.values()), devices=list(devices))
    except NotImplementedError:
        arr = mesh_utils.create_device_mesh(
            tuple(shape.values()), list(devices), allow_split_physical_axes=True
        )
        return Mesh(arr, tuple(shape))


def partitioner_on(partitioner: Partitioner, devices: Sequence[Any]) -> Partitioner:
    """The same rules (and model-parallel size) over other devices, e.g. a TPU topology's.

    Every mesh axis keeps its size except `data`, which takes the remaining devices.
    """
    shape = dict(partitioner.mesh.shape)
    others = math.prod(v for k, v in shape.items() if k != DATA)
    if len(devices) % others:
        raise ValueError(
            f"the mesh {shape} cannot be laid over {len(devices)} devices: "
            f"{others} (all axes but data) does not divide it"
        )
    shape[DATA] = len(devices) // others
    if STAGE in shape:
        # Stages are consecutive device blocks, each a mesh of the other axes (as
        # plan.build_trainer lays them): only stage-to-stage activations cross between blocks.
        grid = np.asarray(list(devices), dtype=object).reshape(tuple(shape.values()))
        mesh = Mesh(grid, tuple(shape))
    else:
        mesh = mesh_over(shape, devices)
    return Partitioner(
        mesh,
        logical_axis_rules=partitioner.rules,
        strict=partitioner.strict,
        shard_if_divisible=partitioner.shard_if_divisible,
    )
