"""Checkpoint policy: step directories, async saves, atomic commit, keep rules.

Raw array I/O lives in `tensorstore_io.py`, the on-disk layout (names, metadata, commit marker)
in `layout.py`, reading one checkpoint back in `restore.py`; this module decides what goes where
and when.

A save is written to `checkpoint_<step>.tmp`; after every process has written its shards,
process 0 writes the metadata and `COMMIT` (fsynced) and renames the directory to its final
name. A crash at any point leaves at most a `.tmp` directory, which restore ignores and
`CheckpointManager` removes. An existing committed step is never overwritten.

Trainer loop:

    mgr = CheckpointManager(workdir, save_period=1000, keep=3, keep_period=10000)
    mgr.install_preemption_handler()
    state, extra = mgr.restore(abstract_state) if mgr.latest_step() is not None else (init, {})
    for step in range(start, num_steps + 1):
        state = train_step(state, batch)
        if mgr.maybe_save(step, state, extra={"step": step, ...}, is_final=step == num_steps):
            break  # preempted: the checkpoint is committed, exit cleanly
    mgr.close()
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from t5lite import distributed
from t5lite.checkpoint import layout, staging
from t5lite.checkpoint import tensorstore_io as tsio
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
)
from t5lite.checkpoint.restore import restore_checkpoint

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Processes


def _is_process0() -> bool:
    return jax.process_index() == 0


def _any_process_failed(name: str, ok: bool) -> bool:
    """Barrier from the writer thread; returns True if any process reported a failure."""
    if jax.process_count() == 1:
        return not ok
    client = distributed.coordination_client()
    if not ok:
        client.key_value_set(f"{name}_failed/{jax.process_index()}", "1")
    distributed.barrier(f"{name}_written")
    return bool(client.key_value_dir_get(f"{name}_failed/"))


def _preemption_sync_manager() -> Any:
    """JAX's preemption sync manager of a multi-process run (None when there is none)."""
    from jax._src import distributed as jax_distributed  # no public accessor for it

    return getattr(jax_distributed.global_state, "preemption_sync_manager", None)


# ---------------------------------------------------------------------------------------------
# Manager


class CheckpointManager:
    """Saves and restores `checkpoint_<step>` directories under one directory.

    Args:
      directory: where step directories live (created if absent).
      save_period: `maybe_save` saves when `step % save_period == 0` (0: only final/preemption).
      keep: number of most recent checkpoints to keep (None: all).
      keep_period: also keep every checkpoint whose step is a multiple of this, forever.
      async_save: `save` returns once arrays are copied to host (or the copies dispatched, see
        `device_copy`); disk writes overlap the next steps. An error surfaces at the next
        `save`, `wait` or `close`.
      concurrency: TensorStore I/O concurrency.
      chunk_bytes: upper bound on one stored chunk.
      checksum: store a crc32c per chunk, so corruption is an error on restore. Costs CPU
        (hardware crc32c, several GB/s per core); turn off only on CPU-starved hosts.
      keep_host_buffers: keep the host copy of the last save and copy the next save into it
        (when shapes and shardings match): the blocking part of a save then writes into memory
        that is already mapped instead of faulting in fresh pages. Costs host memory equal to
        this process's share of the state between saves. Used where `device_copy` is not.
      device_copy: when every array is on CPU devices, `save` only dispatches a copy of each
        shard (the runtime runs it asynchronously; see `staging.stage_on_device`) and returns;
        the writer waits for the copies. The next step may still donate the state: it waits
        for the copies, so their cost moves into it unless the trainer has other work first.
        False: `save` copies to host memory itself before returning.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_period: int = 0,
        keep: int | None = None,
        keep_period: int | None = None,
        async_save: bool = True,
        concurrency: int = 128,
        chunk_bytes: int = tsio.DEFAULT_CHUNK_BYTES,
        checksum: bool = True,
        keep_host_buffers: bool = True,
        device_copy: bool = True,
    ):
        self.directory = Path(directory)
        self.save_period = save_period
        self.keep = keep
        self.keep_period = keep_period
        self.async_save = async_save
        self.concurrency = concurrency
        self.chunk_bytes = chunk_bytes
        self.checksum = checksum
        self.keep_host_buffers = keep_host_buffers
        self.device_copy = device_copy
        # Host copies of the last committed save, by array path (see `keep_host_buffers`).
        self._spare: dict[str, staging.HostShards] = {}
        # (writer thread, [error]) of the save in flight. A plain non-daemon thread: the
        # interpreter joins it before exiting, so a pending save still commits.
        self._pending: tuple[threading.Thread, list[BaseException]] | None = None
        self._preempted = threading.Event()
        self._saves = 0
        self._last_saved_step: int | None = None
        # Where the last save's time went (seconds; see `tsio.write_arrays`): `stage_s` (the
        # blocking part: copies to host, or only their dispatch with `device_copy`),
        # `stage_wait_s` (the writer waiting for `device_copy`'s copies), `write_s` (shards
        # written and fsynced), `commit_s` (process 0's metadata, marker and rename), with the
        # writer's own breakdown and counts.
        self.last_save_stats: dict[str, float] = {}
        # Steps the keep policy never deletes (the trainer's newest checkpoint known to be good,
        # which newer ones must not push out).
        self.protected: frozenset[int] = frozenset()
        if _is_process0():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._cleanup()
        # Pending writes finish (and their errors are reported) before the interpreter exits.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- queries ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        """The final directory of `step`."""
        return self.directory / f"checkpoint_{step}"

    # -- save ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        extra: dict | None = None,
        logical_axes: Any = None,
    ) -> None:
        """Saves `state` (a tree of arrays) and `extra` (JSON) as `checkpoint_<step>`.

        Returns once device data is copied to host, or (CPU, `device_copy`) once the copies are
        dispatched, with async saves; or once the checkpoint is committed.

        Args:
          step: the training step; its checkpoint must not already exist.
          state: tree of jax.Arrays (any sharding), numpy arrays or scalars.
          extra: JSON-serialisable dict (data iterator state, rng as ints, step, ...).
          logical_axes: optional parallel tree of logical-axis PartitionSpecs, stored in metadata.

        Raises:
          CheckpointError: the step exists, the state cannot be stored, or a previous async
            save failed.
        """
        self.wait()
        step = int(step)
        final = self.step_dir(step)
        if final.exists():
            raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
        leaves, _ = layout.flatten(state)
        axes = layout.logical_axes_by_path(logical_axes)
        taken: set[str] = set()
        meta_arrays: dict[str, dict] = {}
        staged = []
        try:
            extra_json = json.dumps(extra if extra is not None else {}, indent=1)
        except TypeError as e:
            raise CheckpointError(
                f"extra state for step {step} is not JSON-serialisable: {e}"
            ) from e

        # `wait` above joined the previous writer: nothing reads the spare buffers any more.
        spare, self._spare = self._spare, {}

        def error(path: str, e: TypeError) -> CheckpointError:
            return CheckpointError(f"cannot save array '{path}': {e}")

        t_stage = time.perf_counter()
        hosts = staging.stage_leaves(leaves, self.device_copy, spare, error)
        stats = {"stage_s": time.perf_counter() - t_stage}
        self.last_save_stats = stats  # completed by the writer (read it after `wait`)
        for (path, _), host in zip(leaves, hosts):
            d = layout.array_dir(path, taken)
            meta_arrays[path] = {
                "shape": list(host.shape),
                "dtype": host.dtype.name,
                "logical_axes": axes.get(path),
                "dir": d,
            }
            staged.append((d, host))
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "tree": layout.tree_json(state),
            "arrays": meta_arrays,
            "process_count": jax.process_count(),
        }
        tmp = self.directory / f"checkpoint_{step}{TMP_SUFFIX}"
        if _is_process0():
            if tmp.exists():  # Left by a crashed save of the same step: never committed.
                shutil.rmtree(tmp)
            (tmp / "arrays").mkdir(parents=True)
        self._saves += 1
        self._last_saved_step = step
        distributed.barrier(f"t5lite_ckpt_{step}_{self._saves}_mkdir")
        n = self._saves
        job = lambda: self._write_and_commit(step, n, tmp, final, staged, meta, extra_json, stats)
        if self.async_save:
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    job()
                except BaseException as e:
                    errors.append(e)

            thread = threading.Thread(target=run, name=f"ckpt-save-{step}")
            thread.start()
            self._pending = (thread, errors)
        else:
            job()

    def _write_and_commit(self, step, n, tmp, final, staged, meta, extra_json, stats) -> None:
        """Writes this process's shards, then (process 0) metadata, marker and rename."""
        ctx = tsio.make_context(self.concurrency)
        items = [(str(tmp / "arrays" / d), h) for d, h in staged]
        error: BaseException | None = None
        t_write = time.perf_counter()
        try:
            t_ready = time.perf_counter()
            for _, h in staged:
                h.ready()
            stats["stage_wait_s"] = time.perf_counter() - t_ready
            tsio.write_arrays(items, ctx, self.chunk_bytes, self.checksum, stats=stats)
        except Exception as e:
            error = e
        # Every process reaches the barrier, failed or not, so none waits forever for a peer
        # whose write failed; then all of them see the failure and none commits.
        failed = _any_process_failed(f"t5lite_ckpt_{step}_{n}", error is None)
        if error is not None:
            raise CheckpointError(f"writing checkpoint {tmp} failed: {error}") from error
        if failed:
            raise CheckpointError(
                f"writing checkpoint {tmp} failed on another process; not committed"
            )
        stats["write_s"] = time.perf_counter() - t_write
        t_commit = time.perf_counter()
        if _is_process0():
            layout.write_json(tmp / EXTRA_FILE, extra_json)
            layout.write_json(tmp / METADATA_FILE, meta)
            layout.write_json(tmp / COMMIT_FILE, {"step": step, "time": time.time()})
            layout.fsync_dir(tmp)
            os.rename(tmp, final)
            layout.fsync_dir(self.directory)
            stats["commit_s"] = time.perf_counter() - t_commit
            self._apply_keep_policy()
        distributed.barrier(f"t5lite_ckpt_{step}_{n}_committed")
        if self.keep_host_buffers:
            self._spare = {
                path: h for path, (_, h) in zip(meta["arrays"], staged) if not h.device_copies
            }

    def wait(self) -> None:
        """Blocks until the pending save is committed; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        thread, errors = pending
        thread.join()
        if not errors:
            return
        if isinstance(errors[0], CheckpointError):
            raise errors[0]
        raise CheckpointError(f"asynchronous checkpoint save failed: {errors[0]!r}") from errors[0]

    def _apply_keep_policy(self) -> None:
        steps = self.all_steps()
        if self.keep is None:
            return
        keep = set(steps[-self.keep :]) if self.keep > 0 else set()
        if self.keep_period:
            keep |= {s for s in steps if s % self.keep_period == 0}
        keep |= self.protected
        for s in steps:
            if s not in keep:
                d = self.step_dir(s)
                # Rename first: a crash mid-delete leaves a '.deleting' dir, never a half
                # checkpoint that still looks committed.
                gone = d.with_name(d.name + DELETING_SUFFIX)
                os.rename(d, gone)
                shutil.rmtree(gone)

    def _cleanup(self) -> None:
        """Removes uncommitted leftovers of crashed saves or deletes (process 0)."""
        for p in self.directory.iterdir():
            name = p.name
            for suffix in (TMP_SUFFIX, DELETING_SUFFIX):
                step_name = name[: -len(suffix)]
                if name.endswith(suffix) and layout.STEP_RE.match(step_name) and p.is_dir():
                    log.info("removing uncommitted checkpoint directory %s", p)
                    shutil.rmtree(p, ignore_errors=True)

    # -- policy -------------------------------------------------------------------------------

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """On SIGTERM, `maybe_save` saves at the next step and tells the trainer to stop.

        Must be called from the main thread. With several processes JAX's preemption notifier
        (set up by `jax.distributed.initialize`) hears SIGTERM on any process and its sync point
        makes all processes stop at one step; a Python handler would replace the notifier's
        (SIGTERM was then ignored), so none is installed there.
        """
        if jax.process_count() > 1 and _preemption_sync_manager() is not None:
            return
        for sig in signals:
            signal.signal(sig, lambda *_: self._preempted.set())

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption signal arrived (agreed across processes at `step`)."""
        if jax.process_count() > 1 and _preemption_sync_manager() is not None:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._preempted.is_set()

    def should_save(self, step: int, is_final: bool = False, preempted: bool | None = None) -> bool:
        """The save policy: period, final step, or preemption (queried unless given)."""
        if preempted is None:
            preempted = self.reached_preemption(step)
        if preempted or is_final:
            return True
        return bool(self.save_period) and step % self.save_period == 0

    def maybe_save(
        self,
        step: int,
        state: Any,
        extra: dict | None = None,
        logical_axes: Any = None,
        is_final: bool = False,
        preempted: bool | None = None,
    ) -> bool:
        """Saves if the policy says so; returns True when the trainer must stop (preempted).

        On preemption or at the final step the save is waited for (committed) before returning.

        Args:
          step: current step (after the update).
          state: train state tree.
          extra: JSON state.
          logical_axes: optional logical-axis tree.
          is_final: the last training step.
          preempted: `reached_preemption(step)` when the caller has already asked it (with
            several processes that sync point must be reached once per step); None: asked here.

        Returns:
          True if a preemption signal arrived: the checkpoint is committed, exit cleanly.
        """
        if preempted is None:
            preempted = self.reached_preemption(step)
        # The local record (not only the file system) decides "already saved", so processes
        # agree even while process 0 is committing that step.
        already = step == self._last_saved_step or self.step_dir(step).exists()
        if self.should_save(step, is_final, preempted) and not already:
            self.save(step, state, extra, logical_axes)
        if preempted or is_final:
            self.wait()
        return preempted

    # -- restore ------------------------------------------------------------------------------

    def restore(
        self,
        target: Any = None,
        step: int | str | os.PathLike | None = None,
        *,
        with_extra: bool = True,
        strict: bool = True,
        assignment_map: Sequence[tuple[str, str | None]] | None = None,
        params_only: bool = False,
        allow_non_finite: bool = False,
    ) -> tuple[Any, dict | None]:
        """Restores the latest committed step, a given step, or a checkpoint path.

        Args:
          target: see `restore_checkpoint`.
          step: None (latest), a step number, or a path to a `checkpoint_<step>` directory.
          with_extra, strict, assignment_map, params_only, allow_non_finite: see
            `restore_checkpoint`.

        Returns:
          (state, extra).

        Raises:
          CheckpointError: no checkpoint, or any bad input (names the array).
        """
        self.wait()
        if _is_process0() and self.directory.is_dir():
            self._cleanup()
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise CheckpointError(f"no committed checkpoint in {self.directory}")
            path = self.step_dir(latest)
        elif isinstance(step, int | np.integer):
            path = self.step_dir(int(step))
        else:
            path = Path(step)
        return restore_checkpoint(
            path,
            target,
            with_extra=with_extra,
            strict=strict,
            assignment_map=assignment_map,
            params_only=params_only,
            concurrency=self.concurrency,
            allow_non_finite=allow_non_finite,
        )

    def close(self) -> None:
        """Waits for the pending save; re-raises its error."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_at_exit(ref: weakref.ref) -> None:
    mgr = ref()
    if mgr is not None and mgr._pending is not None:
        try:
            mgr.close()
        except CheckpointError as e:
            log.error("checkpoint save pending at exit failed: %s", e)
