"""The one place where library objects become gin configurables.

Library modules never import gin; importing this module registers them (the CLI and notebooks do),
so a gin file can say `Partitioner.logical_axis_rules = @standard_logical_axis_rules()`.
The names below are the configurable versions; call them (not the library originals) to have gin
bindings applied.
"""

import gin

import seqio_lite
from seqio_lite import file_tasks
from t5lite import partitioning
from t5lite.compat import seqio as seqio_compat
from t5lite.compat import t5x
from t5lite.insight import plan as _plan
from t5lite.insight import report
from t5lite.model import decoding, lora, network, optimizers
from t5lite.programs import cache as _cache
from t5lite.programs import configs, harness
from t5lite.programs import evaluate as _evaluate
from t5lite.programs import infer as _infer
from t5lite.programs import train as _train

# The configurables registered here -> their gin selectors. Nothing but gin (and the CLI, for
# the programs) calls them: the library calls the originals (gin_unused.py relies on it).
SELECTORS: dict[object, str] = {}


def _register(obj, module: str = "t5lite", name: str | None = None):
    configurable = gin.external_configurable(obj, name, module=module)
    SELECTORS[configurable] = f"{module}.{name or obj.__name__}"
    return configurable


# --- partitioning -------------------------------------------------------------------------
standard_logical_axis_rules = _register(partitioning.standard_logical_axis_rules)
data_parallel_logical_axis_rules = _register(partitioning.data_parallel_logical_axis_rules)
preset_rules = _register(partitioning.preset_rules)
pipeline_rules = _register(partitioning.pipeline_rules)
create_mesh = _register(partitioning.create_mesh)
tensor_mesh = _register(partitioning.tensor_mesh)
tensor_nd_rules = _register(partitioning.tensor_nd_rules)
Partitioner = _register(partitioning.Partitioner)

# --- network configs ---------------------------------------------------
T5Config = _register(t5x.T5Config, "network")  # t5lite's fields and t5x's names
DecoderOnlyConfig = _register(network.DecoderOnlyConfig, "network")

# --- models and optimizers -------------------------------------------------------------------
# The models and Adafactor are registered through their t5x aliases (t5lite's fields plus
# t5x's names for them; they build the same objects) under modules whose last part is t5x's, so
# both `EncoderDecoderModel.z_loss` and t5x's `models.EncoderDecoderModel.z_loss` resolve. A
# second registration of the same name would make the bare name ambiguous in gin.
EncoderDecoderModel = _register(t5x.EncoderDecoderModel, "t5lite.models")
DecoderOnlyModel = _register(t5x.DecoderOnlyModel, "t5lite.models")
AdamW = _register(optimizers.AdamW)
Adafactor = _register(t5x.Adafactor, "t5lite.adafactor")
standard_logical_factor_rules = _register(t5x.standard_logical_factor_rules, "t5lite.adafactor")
# t5x's network wrappers and decode functions, as t5x gin files name them.
Transformer = _register(t5x.Transformer, "network")
DecoderWrapper = _register(t5x.DecoderWrapper, "network")
beam_search = _register(decoding.beam_search, "decoding")
temperature_sample = _register(decoding.temperature_sample, "decoding")
FrozenParams = _register(optimizers.FrozenParams)
LoRA = _register(lora.LoRA)
rsqrt_schedule = _register(optimizers.rsqrt_schedule)
warmup_cosine_schedule = _register(optimizers.warmup_cosine_schedule)
constant_schedule = _register(optimizers.constant_schedule)

# --- programs ----------------------------------------------------------------------------------
DataConfig = _register(configs.DataConfig)
CheckpointConfig = _register(configs.CheckpointConfig)
EvalConfig = _register(configs.EvalConfig)
LogConfig = _register(configs.LogConfig)
RecoveryConfig = _register(configs.RecoveryConfig)
HarnessConfig = _register(harness.HarnessConfig)
train = _register(_train.train)
evaluate = _register(_evaluate.evaluate)
infer = _register(_infer.infer)
cache = _register(_cache.cache)
inspect = _register(report.inspect)
plan = _register(_plan.plan)

# --- data: tasks, mixtures and vocabularies from gin alone (see seqio_lite.file_tasks) ----
JsonlTask = _register(file_tasks.jsonl_task, "seqio_lite", "JsonlTask")
TextLinesTask = _register(file_tasks.text_lines_task, "seqio_lite", "TextLinesTask")
ParquetTask = _register(file_tasks.parquet_task, "seqio_lite", "ParquetTask")
HFDatasetTask = _register(file_tasks.hf_dataset_task, "seqio_lite", "HFDatasetTask")
Mixture = _register(file_tasks.mixture, "seqio_lite", "Mixture")
ByteVocabulary = _register(seqio_lite.ByteVocabulary, "seqio_lite")
SentencePieceVocabulary = _register(seqio_lite.SentencePieceVocabulary, "seqio_lite")
TrainedSentencePiece = _register(file_tasks.TrainedSentencePiece, "seqio_lite")

# --- what each command calls, and configurables that fill the same slot ----------------------
# The configurables each command calls itself; gin calls the rest from their bindings.
PROGRAMS = {
    "train": [SELECTORS[train]],
    "eval": [SELECTORS[evaluate]],
    "infer": [SELECTORS[infer]],
    "cache": [SELECTORS[cache], SELECTORS[DataConfig]],  # the training run's data
    "inspect": [SELECTORS[inspect]],
    "plan": [SELECTORS[plan]],
}
# A binding on one of a group that the run does not call, while it calls another that takes
# the same parameter, is an error naming that one (t5x's `standard_logical_axis_rules` where the
# presets call `preset_rules`). Tasks and vocabularies are not grouped: a user's gin file may
# define several of them for a flag to pick.
ALTERNATIVES = tuple(
    frozenset(SELECTORS[fn] for fn in group)
    for group in (
        (
            preset_rules,
            pipeline_rules,
            standard_logical_axis_rules,
            data_parallel_logical_axis_rules,
        ),
        (AdamW, Adafactor),
        (rsqrt_schedule, warmup_cosine_schedule, constant_schedule),
    )
)

# --- t5x's module names ----------------------------------------------------------------------
# t5x's gin files turn on dynamic registration and import t5x's modules by name (`from t5x
# import models`, `from t5x.examples.t5 import network`, `import seqio`). Where t5x and seqio
# are not installed, gin_config makes these names importable as modules holding the objects
# below: gin finds the registrations above through them, so such a file binds t5lite's objects.
# seqio.SentencePieceVocabulary is not registered here (a second `SentencePieceVocabulary`
# would make the bare name ambiguous); gin registers it when a t5x file names it.
T5X_MODULES: dict[str, dict[str, object]] = {  # the originals: gin keys registrations by them
    "seqio": {"SentencePieceVocabulary": seqio_compat.SentencePieceVocabulary},
    "t5x.models": {
        "EncoderDecoderModel": t5x.EncoderDecoderModel,
        "DecoderOnlyModel": t5x.DecoderOnlyModel,
    },
    "t5x.adafactor": {
        "Adafactor": t5x.Adafactor,
        "standard_logical_factor_rules": t5x.standard_logical_factor_rules,
    },
    "t5x.decoding": {
        "beam_search": decoding.beam_search,
        "temperature_sample": decoding.temperature_sample,
    },
    "t5x.examples.t5.network": {"T5Config": t5x.T5Config, "Transformer": t5x.Transformer},
}
