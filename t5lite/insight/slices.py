"""Multi-slice links: which collectives cross the data-center network (DCN) between slices.

Within a slice devices talk over ICI (or NVLink); between slices over DCN, one to two orders of
magnitude slower (v5e: 400 GB/s ICI against 25 Gbit/s DCN a chip). A collective whose device
groups span two slices runs at the DCN's rate: every group moves at its slowest hop, and the
collective ends with its slowest group. Step times charge such a collective's ring bytes at the
DCN bandwidth and every other one at the link bandwidth (`link_seconds`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from t5lite.insight.communication import ExpectedCollective, link_bytes
from t5lite.insight.hardware import DeviceSpec
from t5lite.insight.hlo import Collective, axes_along, device_slices


def slice_ids(devices: np.ndarray, device: DeviceSpec | None = None) -> np.ndarray:
    """Each device's slice, shaped as `devices`: `device.slice_devices` consecutive device ids
    a slice where it is set (fake CPU devices, or one slice's compile-only devices planned as
    several), else the devices' own `slice_index` (a multi-slice machine or topology)."""
    if device is not None and device.slice_devices:
        size = device.slice_devices
        return np.vectorize(lambda d: d.id // size, otypes=[int])(devices)
    return device_slices(devices)


def slice_count(devices: Sequence[Any], device: DeviceSpec | None = None) -> int:
    """How many slices `devices` span (`slice_ids`)."""
    return len(np.unique(slice_ids(np.asarray(devices, dtype=object), device)))


def mesh_slices(mesh: Mesh, device: DeviceSpec) -> np.ndarray | None:
    """Each mesh position's slice, shaped as the mesh (`slice_ids`); None: all in one slice."""
    ids = slice_ids(mesh.devices, device)
    return ids if len(np.unique(ids)) > 1 else None


def dcn_axes(mesh: Mesh, slices: np.ndarray | None) -> frozenset[str]:
    """The mesh axes along which the slice changes: collectives over them cross DCN."""
    return frozenset(axes_along(mesh, slices)) if slices is not None else frozenset()


def crosses_slices(c: Collective, slices: np.ndarray | None) -> bool:
    """Whether one of `c`'s device groups (a permute's pairs) spans two slices; groups name
    positions in the mesh's device order, as the compiled program's replica groups do."""
    if slices is None:
        return False
    flat = slices.reshape(-1)
    return any(len({int(flat[i]) for i in g}) > 1 for g in c.groups)


def compiled_link_bytes(
    collectives: Sequence[Collective], slices: np.ndarray | None
) -> tuple[float, float]:
    """Ring-algorithm bytes each device sends: (over ICI, over DCN)."""
    ici = dcn = 0.0
    for c in collectives:
        if crosses_slices(c, slices):
            dcn += link_bytes(c)
        else:
            ici += link_bytes(c)
    return ici, dcn


def expected_dcn_bytes(expected: Iterable[ExpectedCollective], slow: frozenset[str]) -> float:
    """The analytic collectives' ring bytes over axes that cross DCN."""
    return sum(e.link_bytes for e in expected if slow & set(e.axes))


def link_seconds(total_bytes: float, dcn_bytes: float, device: DeviceSpec) -> float | None:
    """Seconds to send `total_bytes` (of which `dcn_bytes` cross DCN) one collective after
    another (None when a needed bandwidth is unknown)."""
    if not device.link_bytes_per_s:
        return None
    if not dcn_bytes:
        return total_bytes / device.link_bytes_per_s
    if not device.dcn_bytes_per_s:
        return None
    return (total_bytes - dcn_bytes) / device.link_bytes_per_s + dcn_bytes / device.dcn_bytes_per_s
