"""Joining one JAX program across processes, and not hanging when a peer dies.

`initialize` wraps `jax.distributed.initialize`: explicit coordinator flags, or automatic
detection on clusters JAX knows (Cloud TPU VMs, SLURM, Kubernetes/JobSet). On CPU the
collectives go through gloo, so a multi-process run works on plain machines and in tests.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

# Environment variables that mean "this process is one of several in a cluster JAX can detect".
_CLUSTER_ENV = (
    "SLURM_JOB_ID",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "JOBSET_NAME",
    "JAX_COORDINATOR_ADDRESS",
)


def _in_detectable_cluster() -> bool:
    if os.environ.get("SLURM_JOB_ID"):
        return int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return True
    return any(os.environ.get(k) for k in _CLUSTER_ENV[2:])


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 100,
    initialization_timeout_s: int = 300,
) -> bool:
    """Joins the multi-process runtime if asked to (or if the cluster says so).

    Args:
      coordinator_address: `HOST:PORT` of process 0's coordinator; with `num_processes` and
        `process_id`. None: detect a cluster from the environment, else stay single-process.
      heartbeat_timeout_s: a process whose peers stop heart-beating for this long is told to
        stop (JAX's coordination service), bounding the time a run hangs on a dead peer.
      initialization_timeout_s: how long to wait for every process to connect.

    Returns:
      True if the runtime spans several processes.
    """
    explicit = coordinator_address is not None
    if explicit and (num_processes is None or process_id is None):
        raise ValueError("--coordinator_address needs --num_processes and --process_id")
    if not explicit and not _in_detectable_cluster():
        return False
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU collectives across processes need an implementation; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {
        "heartbeat_timeout_seconds": heartbeat_timeout_s,
        "initialization_timeout": initialization_timeout_s,
    }
    if explicit:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    return jax.process_count() > 1


def is_chief() -> bool:
    """Process 0: the one that logs, writes metrics and prints."""
    return jax.process_index() == 0


# Processes agree on small host values through the coordination service, not through device
# collectives: `multihost_utils.process_allgather` / `broadcast_one_to_all` /
# `sync_global_devices` run a jitted collective on every local device and return when the
# first device's copy is ready. The other devices' parts can still be connecting to a peer
# that has already read its copy and exited; the process then hangs at exit in gloo's
# connect (a two-process restore test hung 1 run in ~8 on a loaded 2-core host).
_AGREE_TIMEOUT_MS = 30 * 60 * 1000
_exchanges = itertools.count()
# How often each barrier name has been waited at: a coordination-service barrier id is for
# one use, so a name used again (a second manager saving the same step) gets a fresh id.
# Counted per name, so threads that wait at different names stay in step across processes.
_barrier_uses: collections.Counter[str] = collections.Counter()
_barrier_lock = threading.Lock()


def coordination_client() -> Any:
    """The coordination service's client of a multi-process run."""
    from jax._src import distributed

    return distributed.global_state.client


def host_allgather(local: np.ndarray | np.generic) -> np.ndarray:
    """Every process's `local` (one shape and dtype on all), stacked in process order.

    Every process must call it, in the same order as its other agreements (the n-th call
    on one process meets the n-th call on the others).
    """
    local = np.asarray(local)
    if jax.process_count() == 1:
        return local[None]
    client, key = coordination_client(), f"t5lite_allgather/{next(_exchanges)}"
    client.key_value_set_bytes(f"{key}/{jax.process_index()}", local.tobytes())
    parts = [
        client.blocking_key_value_get_bytes(f"{key}/{i}", _AGREE_TIMEOUT_MS)
        for i in range(jax.process_count())
    ]
    return np.stack([np.frombuffer(b, local.dtype).reshape(local.shape) for b in parts])


def broadcast_from_chief(value: int) -> int:
    """Process 0's `value` on every process."""
    return int(host_allgather(np.int64(value))[0])


def barrier(name: str) -> None:
    """Every process waits here until all have arrived at `name` (each process's n-th wait at
    a name meets the others' n-th)."""
    if jax.process_count() > 1:
        with _barrier_lock:
            _barrier_uses[name] += 1
            n = _barrier_uses[name]
        coordination_client().wait_at_barrier(f"{name}/{n}", _AGREE_TIMEOUT_MS)


def exit_on_peer_failure(command: str, error: BaseException) -> None:
    """In a multi-process run, a runtime error in a collective means a peer died: say so in
    one line and exit at once. (A normal exit would wait on the runtime's shutdown barrier for
    the dead peer and then abort with pages of coordination-service logs.)"""
    if jax.process_count() <= 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    sys.stderr.write(
        f"t5lite {command}: error: process {jax.process_index()} of {jax.process_count()}: a "
        f"collective failed, a peer process has probably died ({first})\n"
    )
    sys.stderr.flush()
    os._exit(1)


class ProgressWatchdog:
    """Ends the process with a clear message when no step completes for `timeout_s` seconds.

    A collective whose peer died can block forever inside the runtime; this thread turns that
    into an error line and exit code 1 within a bounded time. `ping()` after every step.
    """

    def __init__(self, timeout_s: float | None, what: str = "training", command: str = "train"):
        self.timeout_s = timeout_s
        self.what = what
        self.command = command  # the message's prefix, as every other error line of the command
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s:
            self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog")
            self._thread.start()

    def ping(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        assert self.timeout_s is not None
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                sys.stderr.write(
                    f"t5lite {self.command}: error: process {jax.process_index()} of "
                    f"{jax.process_count()}: "
                    f"no {self.what} progress for {idle:.0f} s (step_timeout_s="
                    f"{self.timeout_s:g}); a peer process has probably died\n"
                )
                sys.stderr.flush()
                os._exit(1)  # the main thread is stuck in a collective: exit from here
