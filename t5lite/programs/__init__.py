"""The programs a user runs, one module each: `train`, `evaluate`, `infer`.

Each module's function of the same name is an ordinary function (gin binds its arguments in the
CLI; a notebook calls it directly), e.g. `from t5lite.programs.train import train`. The grouped
settings they take live in `configs`. `train` is built from `train_loop` (the loop: a
generator of steps, and how hooks attach to it), `train_hooks` (saving, evaluation, logging,
stall detection, the watchdog, preemption), `recovery` (bad steps, known-good checkpoints,
rollbacks) and `run_dir` (the run lock, `config.gin`, the vocabulary copy).
"""

from t5lite.programs.configs import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    RecoveryConfig,
)

__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "LogConfig", "RecoveryConfig"]
