"""Bytes one device holds of an array, from its logical axes and the rules table: the unit the
analytic memory models (memory.py, moe_memory.py, pipeline.py) size every buffer in."""

from __future__ import annotations

import math

from t5lite.partitioning import Partitioner, mesh_axes_of, resolve_logical_axes


def bytes_per_device(
    partitioner: Partitioner, axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int
) -> int:
    """Bytes one device holds of an array with these logical axes under the rules table."""
    spec, _ = resolve_logical_axes(axes, partitioner.rules)
    mesh = partitioner.mesh.shape
    split = math.prod(mesh[t] for e in spec for t in mesh_axes_of(e) if t in mesh)
    return math.prod(shape) * itemsize // max(split, 1)
