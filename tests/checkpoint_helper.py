"""Child process for the checkpoint tests (crash, preemption, multi-process).

    python checkpoint_helper.py loop DIR        save steps 1, 2, ... forever (killed by the test)
    python checkpoint_helper.py train DIR       train-like loop with a SIGTERM handler
    python checkpoint_helper.py exit DIR        start an async save of step 3 and exit at once
    python checkpoint_helper.py multi DIR PORT PID   one of 2 processes x 4 devices saving step 7
    python checkpoint_helper.py multi_fail DIR PORT PID   the same, with process 1's write failing
    python checkpoint_helper.py multi_restore DIR PORT PID   one of 2 processes restoring
        `state_at(7, n=4)`'s params onto the 2 x 4 mesh (each reads its own half)

The state at step s is `state_at(s)`, so the parent can check a restored step bit for bit.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def say(line: str) -> None:
    """Prints `line` on a line of its own in one write: Gloo's C++ code prints to the same
    stdout from its own threads, and a line split by its text once failed a test."""
    sys.stdout.flush()
    os.write(1, f"\n{line}\n".encode())


def state_at(step: int, mesh: jax.sharding.Mesh, n: int = 24) -> dict:
    """A deterministic tree of sharded arrays for `step` (n arrays of 64x256 fp32)."""
    out = {}
    for i in range(n):
        host = np.arange(64 * 256, dtype=np.float32).reshape(64, 256) * (step + 1) + i
        out[f"w{i}"] = host
    sh = NamedSharding(mesh, P("data", "model"))
    return {
        "params": {
            k: jax.make_array_from_callback(v.shape, sh, lambda ix, v=v: v[ix])
            for k, v in out.items()
        }
    }


def multi_state(mesh: jax.sharding.Mesh) -> dict:
    """`state_at(7)` plus `rows`, whose chunks (4, 512) at `MULTI_CHUNK_BYTES` each take two
    rows from each process: the params go through the direct chunk writer on both processes,
    `rows` through TensorStore's merging writes."""
    rows = np.arange(4 * 2048, dtype=np.float32).reshape(4, 2048)
    sh = NamedSharding(mesh, P("data", None))
    return {
        **state_at(7, mesh, n=4),
        "rows": jax.make_array_from_callback(rows.shape, sh, rows.__getitem__),
    }


# Chunks of (32, 64) for the (64, 256) params: one per shard of the 2 x 4 mesh.
MULTI_CHUNK_BYTES = 8192


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    from t5lite.checkpoint import CheckpointManager

    if mode in ("multi", "multi_fail", "multi_restore"):
        port, pid = int(sys.argv[3]), int(sys.argv[4])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        if mode == "multi_restore":
            from t5lite.checkpoint import CheckpointError

            sh = NamedSharding(mesh, P("data", "model"))
            target = {"params": {f"w{i}": jax.ShapeDtypeStruct((64, 256), np.float32, sharding=sh)
                                 for i in range(4)}}  # fmt: skip
            try:
                got, _ = CheckpointManager(directory).restore(target)
            except CheckpointError as e:
                say(f"REFUSED {e}")
                return
            shards = [s for v in got["params"].values() for s in v.addressable_shards]
            say(f"RESTORED {sum(float(np.asarray(s.data).sum()) for s in shards)}")
            return
        if mode == "multi_fail" and pid == 1:  # process 1's disk write fails
            from t5lite.checkpoint import tensorstore_io

            def broken(*args, **kwargs):
                raise OSError("disk full (simulated)")

            tensorstore_io.write_arrays = broken
        mgr = CheckpointManager(directory, async_save=True, chunk_bytes=MULTI_CHUNK_BYTES)
        mgr.save(7, multi_state(mesh), extra={"step": 7, "pid_count": jax.process_count()})
        try:
            mgr.close()
        except Exception as e:
            say(f"FAILED {e}")
            return
        st = mgr.last_save_stats
        say(f"DONE direct={st['direct_arrays']} tensorstore={st['tensorstore_arrays']}")
        return

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    if mode == "loop":
        mgr = CheckpointManager(directory, async_save=False)
        step = 1
        while True:
            mgr.save(step, state_at(step, mesh), extra={"step": step})
            if step == 1:
                print("READY", flush=True)
            step += 1
    if mode == "exit":
        mgr = CheckpointManager(directory, async_save=True)
        mgr.save(3, state_at(3, mesh), extra={"step": 3})
        return  # no wait(), no close(): the pending save must still be committed
    if mode == "train":
        mgr = CheckpointManager(directory, save_period=1000)
        mgr.install_preemption_handler()
        step = 0
        while True:
            step += 1
            time.sleep(0.01)  # a "train step"
            if step == 5:
                print("READY", flush=True)
            if mgr.maybe_save(step, state_at(step, mesh, n=2), extra={"step": step}):
                mgr.close()
                print(f"PREEMPTED {step}", flush=True)
                sys.exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
