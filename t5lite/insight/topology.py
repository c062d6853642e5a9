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

from t5lite.insight.hardware import TPU_CHIPS, ChipSpec, DeviceSpec, GiB, device_spec_of_kind

__all__ = ["DeviceSpec", "GiB", "Topology", "TopologyError", "get_topology", "num_devices"]


class TopologyError(ValueError):
    """A topology name libtpu cannot build, or libtpu missing; the message says which."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named TPU slice: its abstract devices and the per-device figures of its chip."""

    name: str
    devices: tuple[Any, ...]
    spec: DeviceSpec


def _parse(name: str) -> tuple[ChipSpec, tuple[int, ...], int]:
    """The chip, the slice's shape and the number of slices (`2xv5e:4x4`: two v5e:4x4 slices
    joined by DCN)."""
    m = re.fullmatch(r"(?:(\d+)x)?(v\d+[a-z]?):(\d+(?:x\d+)*)", name.strip())
    if not m or m.group(2) not in TPU_CHIPS or int(m.group(1) or 1) < 1:
        known = ", ".join(sorted(TPU_CHIPS))
        raise TopologyError(
            f"topology {name!r}: expected [SLICESx]GENERATION:AxB[xC] with a generation in "
            f"({known}), e.g. 'v5e:4x4', 'v4:2x2x2' or '2xv5e:4x4' (two slices)"
        )
    dims = tuple(int(d) for d in m.group(3).split("x"))
    return TPU_CHIPS[m.group(2)], dims, int(m.group(1) or 1)


def num_devices(name: str) -> int:
    """Devices of a topology, from its name alone (no JAX): slices × chips × cores per chip."""
    chip, dims, slices = _parse(name)
    return slices * math.prod(dims) * chip.cores_per_chip


def libtpu_available() -> bool:
    """Whether the `libtpu` wheel (the `jax[tpu]` extra) is importable."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def quiet_stderr() -> Iterator[list[str]]:
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
    """Compile-only TPU devices of topology `name` (e.g. 'v5e:2x2', 'v4:2x2x2', 'v6e:16x16';
    '2xv5e:4x4': two slices, each device with its `slice_index`, collectives between them
    compiled as the DCN runtime's transfers, `hlo.py`).

    Raises:
      TopologyError: an unknown name, or libtpu not installed (`pip install -e ".[tpu]"`).
    """
    chip, dims, slices = _parse(name)
    if not libtpu_available():
        raise TopologyError(
            f'topology {name!r} needs libtpu to compile for TPU: pip install -e ".[tpu]"'
        )
    # libtpu guards real chips with a lock file; compile-only use needs no chip, and several
    # processes (tests, other users) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with quiet_stderr() as log:
            desc = topologies.get_topology_desc(
                topology_name=f"{chip.name}:{'x'.join(map(str, dims))}",
                platform="tpu",
                num_slices=slices,
            )
    except Exception as e:  # libtpu reports bad names as runtime errors
        detail = log[0].strip().splitlines()[-1:] if log else []
        raise TopologyError(f"topology {name!r}: libtpu cannot build it: {e} {detail}") from e
    devices = tuple(desc.devices)
    chips = {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices}
    spec = device_spec_of_kind(devices[0].device_kind, len(devices) // max(len(chips), 1))
    if spec.memory_bytes is None:  # a generation newer than the table: still compilable
        spec = dataclasses.replace(spec, device_kind=chip.device_kind)
    return Topology(name, devices, spec)
