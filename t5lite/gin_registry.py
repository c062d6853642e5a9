"""The one place where library objects become gin configurables.

Library modules never import gin; importing this module registers them (the CLI and notebooks do),
so a gin file can say `Partitioner.logical_axis_rules = @standard_logical_axis_rules()`.
"""

import gin

from t5lite import partitioning

# --- partitioning -------------------------------------------------------------------------
gin.external_configurable(partitioning.standard_logical_axis_rules, module="t5lite")
gin.external_configurable(partitioning.data_parallel_logical_axis_rules, module="t5lite")
gin.external_configurable(partitioning.create_mesh, module="t5lite")
gin.external_configurable(partitioning.Partitioner, module="t5lite")

# --- models (network configs and constructors) ----------------------------------------------
