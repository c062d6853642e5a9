"""The programs a user runs, one module each: `train`, `evaluate`, `infer`.

Each module's function of the same name is an ordinary function (gin binds its arguments in the
CLI; a notebook calls it directly), e.g. `from t5lite.programs.train import train`. The grouped
settings they take live in `configs`.
"""

from t5lite.programs.configs import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    RecoveryConfig,
)

__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "LogConfig", "RecoveryConfig"]
