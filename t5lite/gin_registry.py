"""The one place where library objects become gin configurables.

Library modules never import gin; importing this module registers them (the CLI and notebooks do),
so a gin file can say `Partitioner.logical_axis_rules = @standard_logical_axis_rules()`.
The names below are the configurable versions; call them (not the library originals) to have gin
bindings applied.
"""

import gin

from t5lite import partitioning

# --- partitioning -------------------------------------------------------------------------
standard_logical_axis_rules = gin.external_configurable(
    partitioning.standard_logical_axis_rules, module="t5lite"
)
data_parallel_logical_axis_rules = gin.external_configurable(
    partitioning.data_parallel_logical_axis_rules, module="t5lite"
)
create_mesh = gin.external_configurable(partitioning.create_mesh, module="t5lite")
Partitioner = gin.external_configurable(partitioning.Partitioner, module="t5lite")

# --- models (network configs and constructors) ----------------------------------------------
from t5lite import network  # noqa: E402

T5Config = gin.external_configurable(network.T5Config, module="network")
DecoderOnlyConfig = gin.external_configurable(network.DecoderOnlyConfig, module="network")
EncoderDecoder = gin.external_configurable(network.EncoderDecoder, module="network")
DecoderOnly = gin.external_configurable(network.DecoderOnly, module="network")

# --- models, optimizers, programs -------------------------------------------------------------
from t5lite import models, optimizers, train_loop  # noqa: E402
from t5lite.insight import report  # noqa: E402

EncoderDecoderModel = gin.external_configurable(models.EncoderDecoderModel, module="t5lite")
DecoderOnlyModel = gin.external_configurable(models.DecoderOnlyModel, module="t5lite")
AdamW = gin.external_configurable(optimizers.AdamW, module="t5lite")
Adafactor = gin.external_configurable(optimizers.Adafactor, module="t5lite")
rsqrt_schedule = gin.external_configurable(optimizers.rsqrt_schedule, module="t5lite")
warmup_cosine_schedule = gin.external_configurable(
    optimizers.warmup_cosine_schedule, module="t5lite"
)
constant_schedule = gin.external_configurable(optimizers.constant_schedule, module="t5lite")
train = gin.external_configurable(train_loop.train, module="t5lite")
evaluate = gin.external_configurable(train_loop.evaluate, module="t5lite")
infer = gin.external_configurable(train_loop.infer, module="t5lite")
inspect = gin.external_configurable(report.inspect, module="t5lite")

# --- insight: layout search -------------------------------------------------------------------
from t5lite.insight import plan as _plan  # noqa: E402

plan = gin.external_configurable(_plan.plan, module="t5lite")
