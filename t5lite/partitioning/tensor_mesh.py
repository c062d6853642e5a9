"""Meshes and rules of 2D (Optimus / SUMMA) and 3D (Colossal-AI) tensor parallelism.

`tensor_mesh('summa_2d')` builds `('data', 'tensor_row', 'tensor_col')` with a q x q tensor
group; `tensor_mesh('tensor_3d')` builds `('data', 'tensor_i', 'tensor_j', 'tensor_l')` with a
q x q x q one; `data` takes the remaining devices. `tensor_nd_rules(scheme)` is the rules table
that places parameters and activations as the papers do; `t5lite.tensor_nd` writes the
contractions (the strategies `summa_2d` and `tensor_3d`).

The tables lean on the rules' priority with fallback (a later rule for a name is used when an
earlier one's mesh axis is taken by another dimension of the same array): an activation's batch
takes `tensor_row` (2D) or `tensor_i` (3D) first, so its features fall back to the activation
rule, while a kernel (no batch) takes the kernel rule. Embeddings and the norms' scales are
laid out by the same names (the lookup and the tied logits stay with the partitioner); experts
are not split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from t5lite.partitioning.mesh import DATA, PartitioningError, _device_array
from t5lite.partitioning.rules import _REPLICATED_NAMES
from t5lite.tensor_nd import (
    AXES_2D,
    AXES_3D,
    SUMMA_2D,
    TENSOR_3D,
    TENSOR_COL,
    TENSOR_I,
    TENSOR_J,
    TENSOR_L,
    TENSOR_ROW,
)

SCHEMES = {SUMMA_2D: AXES_2D, TENSOR_3D: AXES_3D}
# Every name the presets replicate, and the experts too (these layouts leave them unsplit).
_REPLICATED = (*_REPLICATED_NAMES, "expert", "expert_mlp", "expert_replicas", "expert_capacity")


def _check_scheme(scheme: str, who: str) -> tuple[str, ...]:
    if scheme not in SCHEMES:
        raise PartitioningError(
            f"{who}: unknown scheme {scheme!r}; known: {', '.join(sorted(SCHEMES))}"
        )
    return SCHEMES[scheme]


def tensor_mesh(
    scheme: str,
    q: int | None = None,
    *,
    tensor_shape: Sequence[int] | None = None,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """The mesh of a 2D or 3D scheme: `data` outermost, then the tensor axes.

    Args:
      scheme: 'summa_2d' (q x q) or 'tensor_3d' (q x q x q).
      q: the side of the tensor group (default: the largest that divides the devices).
      tensor_shape: the tensor axes' sizes instead of `q`; they must all be equal.
      devices: default `jax.devices()`.
    """
    axes = _check_scheme(scheme, "tensor_mesh")
    devices = list(jax.devices() if devices is None else devices)
    kind = "square" if scheme == SUMMA_2D else "cubic"
    if tensor_shape is not None:
        shape = tuple(int(s) for s in tensor_shape)
        if len(shape) != len(axes) or len(set(shape)) != 1:
            raise PartitioningError(
                f"tensor_mesh: {scheme} needs a {kind} tensor mesh ({' x '.join('q' * len(axes))}"
                f" over {', '.join(axes)}), got tensor_shape={shape}"
            )
        q = shape[0]
    if q is None:
        q = max(s for s in range(1, len(devices) + 1) if len(devices) % s ** len(axes) == 0)
    group = int(q) ** len(axes)
    if q < 1 or len(devices) % group:
        raise PartitioningError(
            f"tensor_mesh: {scheme} with q={q} needs {group} devices per tensor group, which "
            f"does not divide the {len(devices)} devices present"
        )
    shape = (len(devices) // group,) + (int(q),) * len(axes)
    try:
        arr = _device_array(shape, devices)
    except NotImplementedError:  # e.g. 8 x 8 on a 4x4x4 torus: an axis spans a split one
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(arr, (DATA, *axes))


def tensor_nd_rules(
    scheme: str, data_axis: str | tuple[str, ...] = DATA
) -> tuple[tuple[str, Any], ...]:
    """The rules table of a 2D or 3D scheme (see the module docstring).

    2D: activations [batch -> (data, row), features -> col]; kernels [embed -> row, mlp / heads
    / vocab -> col]. 3D: activations [batch -> (data, i), embed -> (l, j), mlp / heads / vocab
    -> (j, l)]; kernels [embed -> (l, i), mlp / heads / vocab -> j].
    """
    _check_scheme(scheme, "tensor_nd_rules")
    data = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    features = ("mlp", "heads", "kv_heads", "joined_kv", "vocab")
    if scheme == SUMMA_2D:
        rules: list[tuple[str, Any]] = [
            ("batch", (*data, TENSOR_ROW)),
            ("embed", TENSOR_ROW),
            ("embed", TENSOR_COL),
        ]
        rules += [(name, TENSOR_COL) for name in features]
    else:
        rules = [
            ("batch", (*data, TENSOR_I)),
            ("embed", (TENSOR_L, TENSOR_I)),
            ("embed", (TENSOR_L, TENSOR_J)),
        ]
        for name in features:
            rules += [(name, (TENSOR_J, TENSOR_L)), (name, TENSOR_J)]
    return tuple(rules + [(name, None) for name in _REPLICATED])
