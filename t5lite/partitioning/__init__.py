"""Mesh, logical-axis rules and the Partitioner: how logical names become `NamedSharding`s.

- `mesh.py`: mesh construction (`create_mesh`, TPU submeshes, hybrid DCN × ICI meshes).
- `rules.py`: the rules tables, the `PRESETS` table, resolution and validation of layouts.
- `tensor_mesh.py`: meshes and rules of 2D (SUMMA) and 3D tensor parallelism.
- `partitioner.py`: the `Partitioner` (shardings, data layout, jit with explicit shardings).
"""

from t5lite.partitioning.mesh import (
    DATA,
    MODEL,
    REPLICA,
    STAGE,
    PartitioningError,
    create_mesh,
    submesh_device_array,
)
from t5lite.partitioning.partitioner import (
    CompiledFunction,
    DataLayout,
    PartitionedFunction,
    Partitioner,
)
from t5lite.partitioning.rules import (
    PRESETS,
    ExplicitSpec,
    LogicalRules,
    MeshAxis,
    Placement,
    data_parallel_logical_axis_rules,
    logical_axes_of,
    mesh_axes_of,
    pipeline_rules,
    preset_rules,
    presets_for,
    resolve_logical_axes,
    standard_logical_axis_rules,
    validate_spec,
)
from t5lite.partitioning.tensor_mesh import tensor_mesh, tensor_nd_rules
from t5lite.pytree import path_str

__all__ = [
    "DATA",
    "MODEL",
    "PRESETS",
    "REPLICA",
    "STAGE",
    "CompiledFunction",
    "DataLayout",
    "ExplicitSpec",
    "LogicalRules",
    "MeshAxis",
    "PartitionedFunction",
    "Partitioner",
    "PartitioningError",
    "Placement",
    "create_mesh",
    "data_parallel_logical_axis_rules",
    "logical_axes_of",
    "mesh_axes_of",
    "path_str",
    "pipeline_rules",
    "preset_rules",
    "presets_for",
    "resolve_logical_axes",
    "standard_logical_axis_rules",
    "submesh_device_array",
    "tensor_mesh",
    "tensor_nd_rules",
    "validate_spec",
]
