"""Staging: the blocking part of a save, which takes a snapshot of the state this process must
write (its replica-0 shards) so that training may go on, and donate the arrays, while
`tensorstore_io.write_arrays` writes the snapshot.

Two ways: `stage_to_host` copies to host memory (any platform; the transfers start together);
`stage_on_device` (CPU devices only) dispatches device copies and returns at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from t5lite.checkpoint.threads import parallel_map
from t5lite.checkpoint.zarr_format import Index, shard_ranges


def stage_leaves(
    leaves: Sequence[tuple[str, Any]],
    device_copy: bool,
    spare: dict[str, HostShards],
    error: Callable[[str, TypeError], Exception],
) -> list[HostShards]:
    """The snapshot of every (path, leaf): device copies when `device_copy` and every array is
    on CPU devices, else host copies (into `spare`'s buffers of the same path where they fit).
    A leaf that cannot be stored raises `error(path, TypeError)`."""
    for path, x in leaves:
        try:
            check_storable(x)
        except TypeError as e:
            raise error(path, e) from e
    if device_copy and all(on_cpu(x) for _, x in leaves if isinstance(x, jax.Array)):
        # CPU: the copies run on the runtime's threads; the writer waits for them.
        return stage_on_device([x for _, x in leaves])
    # numpy copies release the GIL: a few threads shorten the blocking part.
    return parallel_map(lambda item: stage_to_host(item[1], spare.get(item[0])), leaves, 4)


@dataclasses.dataclass
class HostShards:
    """Host copies of the pieces of one array that this process must write."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # numpy arrays; or, from `stage_on_device`, device copies that `ready` turns into views.
    pieces: list[tuple[Index, Any]]
    # The pieces are (or were) device copies: their memory belongs to the runtime, so they are
    # never reused as the next save's host buffers.
    device_copies: bool = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.pieces)

    def ready(self) -> None:
        """Waits for `stage_on_device`'s copies and swaps them for zero-copy numpy views."""
        if not self.device_copies:
            return
        jax.block_until_ready([p for _, p in self.pieces])
        self.pieces = [
            (i, p if isinstance(p, np.ndarray) else np.asarray(p)) for i, p in self.pieces
        ]


def stage_on_device(xs: Sequence[Any]) -> list[HostShards]:
    """Starts a copy of the shards this process owns (replica_id == 0) of every CPU array in
    `xs`, and returns without waiting for it; other leaves are staged by `stage_to_host`.

    On the CPU backend a device buffer *is* host memory, so a device-to-device copy is host
    staging, and the runtime runs it on its own threads after `device_put` returns: the caller
    gets control back after one dispatch instead of after copying every byte. The caller may
    donate `xs` in the very next computation: the runtime orders a computation that donates a
    buffer after the reads already enqueued on it, so the copy holds the values of the time of
    this call (tests/test_checkpoints.py checks this, with the donation actually taking place).
    The cost is moved, not gone: the donating computation starts only once the copy is done
    (benchmarks/checkpoint_io.py times a donating step right after the save); what the trainer
    gains is whatever it does before that step's inputs are needed (input pipeline, logging).

    Not used on accelerators: there a device copy would take HBM the size of the state, and the
    transfer to host has to happen anyway, so `stage_to_host` starts every transfer
    (`copy_to_host_async`) before waiting on the first.

    Call `HostShards.ready` (the writer thread does) before reading the pieces.

    Args:
      xs: leaves of the state: jax.Arrays on CPU devices, numpy arrays or scalars.

    Returns:
      One `HostShards` per leaf, in order.
    """
    out: list[HostShards | None] = [None] * len(xs)
    srcs, owners = [], []
    for k, x in enumerate(xs):
        if not on_cpu(x):
            out[k] = stage_to_host(x)
            continue
        check_storable(x)
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        pieces = [(shard_ranges(s.index, x.shape), None) for s in shards]
        out[k] = HostShards(tuple(x.shape), np.dtype(x.dtype), pieces, device_copies=True)
        srcs += [s.data for s in shards]
        owners += [(k, j) for j in range(len(shards))]
    if srcs:
        # One call for every shard: one dispatch, the copies run in parallel on the runtime's
        # threads. `may_alias=False` forces a copy onto the same device.
        copies = jax.device_put(srcs, [next(iter(a.devices())) for a in srcs], may_alias=False)
        for (k, j), c in zip(owners, copies):
            h = out[k]
            assert h is not None
            h.pieces[j] = (h.pieces[j][0], c)
    return out  # type: ignore[return-value]


def on_cpu(x: Any) -> bool:
    """Whether `x` is a jax.Array whose devices are all CPU devices."""
    return isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set)


def check_storable(x: Any) -> None:
    """Raises TypeError for arrays that have no on-disk dtype (typed PRNG keys)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        raise TypeError(
            f"cannot checkpoint an array of dtype {x.dtype}; store typed PRNG keys as "
            "jax.random.key_data(key)"
        )


def stage_to_host(x: Any, reuse: HostShards | None = None) -> HostShards:
    """Copies the shards this process owns (replica_id == 0) of `x` to host memory.

    The copy is what makes async saves safe: the caller may donate or overwrite `x` the moment
    this returns. (On CPU a zero-copy `np.asarray` view kept for the write would pin the device
    buffer instead, silently turning the next step's donation into a copy, and it stalled a
    multi-process save; here such a view lives only for the copy.)
    Non-jax leaves (numpy arrays, Python scalars) are written by process 0 only.

    Args:
      x: a jax.Array (any sharding), numpy array or scalar.
      reuse: the previous save's `HostShards` of the same array, no longer used by any write:
        copied into when its pieces match (same shape, dtype and shard ranges), since filling
        fresh memory costs a page fault per 4 KiB, most of the blocking copy's time (figures in
        docs/performance.md).

    Returns:
      The `HostShards` to pass to `write_arrays`.
    """
    if isinstance(x, jax.Array):
        check_storable(x)
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        # Start every device->host transfer before blocking on the first one.
        for s in shards:
            s.data.copy_to_host_async()
        indices = [shard_ranges(s.index, x.shape) for s in shards]
        dtype = np.dtype(x.dtype)
        if (
            reuse is not None
            and reuse.shape == tuple(x.shape)
            and reuse.dtype == dtype
            and [i for i, _ in reuse.pieces] == indices
        ):
            for s, (_, buf) in zip(shards, reuse.pieces):
                np.copyto(buf, np.asarray(s.data))
            return reuse
        pieces = [(i, np.array(s.data, copy=True)) for i, s in zip(indices, shards)]
        return HostShards(tuple(x.shape), dtype, pieces)
    arr = np.array(x, copy=True)
    pieces = [] if jax.process_index() != 0 else [(tuple((0, d) for d in arr.shape), arr)]
    return HostShards(tuple(arr.shape), arr.dtype, pieces)
