"""Sharded TensorStore checkpoints: each process writes and reads only its own shards.

- `manager.py`: the save policy (periods, keep rules, async saves, atomic commit, preemption)
  and restore onto any mesh.
- `layout.py`: the on-disk layout (names, `metadata.json`, `extra.json`, the commit marker).
- `staging.py`: a save's blocking part, the snapshot of this process's shards.
- `tensorstore_io.py`: raw array I/O (chunked zarr3 writes, aligned reads).
"""

from t5lite.checkpoint.layout import (
    COMMIT_FILE,
    DELETING_SUFFIX,
    EXTRA_FILE,
    FORMAT,
    FORMAT_VERSION,
    METADATA_FILE,
    TMP_SUFFIX,
    CheckpointError,
    committed_steps,
    is_committed,
    read_metadata,
)
from t5lite.checkpoint.manager import CheckpointManager, restore_checkpoint

__all__ = [
    "COMMIT_FILE",
    "DELETING_SUFFIX",
    "EXTRA_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "TMP_SUFFIX",
    "CheckpointError",
    "CheckpointManager",
    "committed_steps",
    "is_committed",
    "read_metadata",
    "restore_checkpoint",
]
