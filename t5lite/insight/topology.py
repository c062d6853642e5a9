"""TPU topologies without a TPU: abstract devices to compile for, and each chip's vital numbers.

`get_topology("v5e:16x16")` asks libtpu (the `jax[tpu]` extra; it installs on any Linux machine)
for compile-only devices of that slice. A mesh built over them (`create_mesh(...,
devices=topology.devices)`) lowers and compiles with the real TPU compiler on a CPU-only host, so
its memory analysis and collectives are what the pod would see.

This module imports JAX lazily: the CLI reads `num_devices` before JAX may start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

GiB = 2**30


class TopologyError(ValueError):
    """A topology name libtpu cannot build, or libtpu missing; the message says which."""


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Published figures of one TPU generation (per chip)."""

    generation: str  # as written in topology names: v4, v5e, v5p, v6e
    device_kind: str  # `jax.Device.device_kind`
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    ici_bytes_per_s: float  # total inter-chip interconnect bandwidth of one chip
    cores_per_chip: int  # devices libtpu's topology gives per chip


# Google Cloud's TPU system-architecture pages (bf16 peak, HBM, ICI per chip).
TPU_CHIPS: dict[str, ChipSpec] = {
    c.generation: c
    for c in (
        ChipSpec("v4", "TPU v4", 32 * GiB, 275e12, 2400e9 / 8, 2),
        ChipSpec("v5e", "TPU v5 lite", 16 * GiB, 197e12, 1600e9 / 8, 1),
        ChipSpec("v5p", "TPU v5", 95 * GiB, 459e12, 4800e9 / 8, 1),
        ChipSpec("v6e", "TPU v6 lite", 32 * GiB, 918e12, 3584e9 / 8, 1),
    )
}
_BY_KIND = {c.device_kind: c for c in TPU_CHIPS.values()}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What a planner needs to know about one device (None: unknown)."""

    device_kind: str
    memory_bytes: int | None
    peak_flops: float | None
    link_bytes_per_s: float | None


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named TPU slice: its abstract devices and the per-device figures of its chip."""

    name: str
    devices: tuple[Any, ...]
    spec: DeviceSpec


def _parse(name: str) -> tuple[ChipSpec, tuple[int, ...]]:
    m = re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)*)", name.strip())
    if not m or m.group(1) not in TPU_CHIPS:
        known = ", ".join(sorted(TPU_CHIPS))
        raise TopologyError(
            f"topology {name!r}: expected GENERATION:AxB[xC] with a generation in ({known}), "
            "e.g. 'v5e:4x4' or 'v4:2x2x2'"
        )
    return TPU_CHIPS[m.group(1)], tuple(int(d) for d in m.group(2).split("x"))


def num_devices(name: str) -> int:
    """Devices of a topology, from its name alone (no JAX): chips × cores per chip."""
    chip, dims = _parse(name)
    return math.prod(dims) * chip.cores_per_chip


def device_spec_of_kind(device_kind: str, cores_per_chip: int | None = None) -> DeviceSpec:
    """Per-device figures for a TPU `device_kind` (a chip's HBM and FLOPs split over its cores)."""
    chip = _BY_KIND.get(device_kind)
    if chip is None:
        return DeviceSpec(device_kind, None, None, None)
    n = cores_per_chip or chip.cores_per_chip
    return DeviceSpec(
        device_kind, chip.hbm_bytes // n, chip.peak_flops / n, chip.ici_bytes_per_s / n
    )


def device_spec(device: Any) -> DeviceSpec:
    """Figures of a real (or compile-only) JAX device: memory from the runtime when it knows."""
    spec = device_spec_of_kind(device.device_kind)
    with contextlib.suppress(Exception):  # compile-only and CPU devices have no memory stats
        limit = (device.memory_stats() or {}).get("bytes_limit")
        if limit:
            spec = dataclasses.replace(spec, memory_bytes=int(limit))
    if spec.peak_flops is None:
        from t5lite.metrics_writer import peak_flops

        spec = dataclasses.replace(spec, peak_flops=peak_flops(device.device_kind))
    return spec


def libtpu_available() -> bool:
    """Whether the `libtpu` wheel (the `jax[tpu]` extra) is importable."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Silences libtpu's start-up warnings about cloud metadata (written straight to fd 2).

    Yields a list that receives what was written, so a failure can still show it.
    """
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode(errors="replace"))


def get_topology(name: str) -> Topology:
    """Compile-only TPU devices of topology `name` (e.g. 'v5e:2x2', 'v4:2x2x2', 'v6e:16x16').

    Raises:
      TopologyError: an unknown name, or libtpu not installed (`pip install -e ".[tpu]"`).
    """
    chip, _ = _parse(name)
    if not libtpu_available():
        raise TopologyError(
            f'topology {name!r} needs libtpu to compile for TPU: pip install -e ".[tpu]"'
        )
    # libtpu guards real chips with a lock file; compile-only use needs no chip, and several
    # processes (tests, other users) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with _quiet_stderr() as log:
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # libtpu reports bad names as runtime errors
        detail = log[0].strip().splitlines()[-1:] if log else []
        raise TopologyError(f"topology {name!r}: libtpu cannot build it: {e} {detail}") from e
    devices = tuple(desc.devices)
    chips = {tuple(d.coords) for d in devices}
    spec = device_spec_of_kind(devices[0].device_kind, len(devices) // max(len(chips), 1))
    if spec.memory_bytes is None:  # a generation newer than the table: still compilable
        spec = dataclasses.replace(spec, device_kind=chip.device_kind)
    return Topology(name, devices, spec)
