"""t5lite: a JAX sharding front-end for training transformers in the style of t5x / GSPMD.

The names a notebook needs are importable from here, loaded on first use so that `import
t5lite` stays cheap (the CLI sets XLA flags before JAX starts):

    from t5lite import Partitioner, create_mesh, preset_rules, EncoderDecoderModel, train

The layers, lowest first: `model/`, `partitioning/`, `checkpoint/` (each stands alone);
`trainer.py`; `insight/`, `hf/`; `programs/`; `cli/`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that owns it
_EXPORTS = {
    "Partitioner": "t5lite.partitioning",
    "create_mesh": "t5lite.partitioning",
    "standard_logical_axis_rules": "t5lite.partitioning",
    "data_parallel_logical_axis_rules": "t5lite.partitioning",
    "preset_rules": "t5lite.partitioning",
    "PRESETS": "t5lite.partitioning",
    "T5Config": "t5lite.model.network",
    "DecoderOnlyConfig": "t5lite.model.network",
    "EncoderDecoderModel": "t5lite.model.models",
    "DecoderOnlyModel": "t5lite.model.models",
    "AdamW": "t5lite.model.optimizers",
    "Adafactor": "t5lite.model.optimizers",
    "Trainer": "t5lite.trainer",
    "CheckpointManager": "t5lite.checkpoint",
    "DataConfig": "t5lite.programs.configs",
    "CheckpointConfig": "t5lite.programs.configs",
    "EvalConfig": "t5lite.programs.configs",
    "LogConfig": "t5lite.programs.configs",
    "RecoveryConfig": "t5lite.programs.configs",
    "train": "t5lite.programs.train",
    "evaluate": "t5lite.programs.evaluate",
    "infer": "t5lite.programs.infer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 't5lite' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
