"""The one table of accelerator figures: peak FLOP/s, memory and links per device kind.

Every consumer (MFU in the train log, `inspect`'s time estimates, `plan`'s fit and ranking,
TPU topologies) reads it here. Figures are the vendors' data sheets: dense bf16 peak without
sparsity, HBM per chip, interconnect bandwidth per chip. Unknown kinds (CPUs among them) give
None, and callers say "n/a" rather than guess.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Published figures of one accelerator chip."""

    name: str  # TPU generations as written in topology names (v4, v5e, ...); GPUs' model names
    device_kind: str  # `jax.Device.device_kind`
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    link_bytes_per_s: float  # TPU: total ICI bandwidth of one chip; GPU: NVLink, one direction
    hbm_bytes_per_s: float  # HBM bandwidth of one chip
    source: str  # where the figures come from
    cores_per_chip: int = 1  # JAX devices per chip (TPU v4 exposes its two cores)


_TPU_DOCS = "https://cloud.google.com/tpu/docs/"
# TPU: Google Cloud's system-architecture pages (ICI quoted in Gbit/s, hence / 8). GPU: NVIDIA's
# data sheets, SXM parts, dense (no sparsity) bf16 tensor-core peaks; NVLink's quoted total is
# both directions, halved here.
_CHIPS = (
    ChipSpec("v4", "TPU v4", 32 * GiB, 275e12, 2400e9 / 8, 1200e9, _TPU_DOCS + "v4",
             cores_per_chip=2),
    ChipSpec("v5e", "TPU v5 lite", 16 * GiB, 197e12, 1600e9 / 8, 819e9, _TPU_DOCS + "v5e"),
    ChipSpec("v5p", "TPU v5", 95 * GiB, 459e12, 4800e9 / 8, 2765e9, _TPU_DOCS + "v5p"),
    ChipSpec("v6e", "TPU v6 lite", 32 * GiB, 918e12, 3584e9 / 8, 1640e9, _TPU_DOCS + "v6e"),
    ChipSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 40 * GiB, 312e12, 300e9, 1555e9,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)"),
    ChipSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", 80 * GiB, 312e12, 300e9, 2039e9,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
    ChipSpec("h100", "NVIDIA H100 80GB HBM3", 80 * GiB, 989e12, 450e9, 3350e9,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    ChipSpec("h200", "NVIDIA H200", 141 * GiB, 989e12, 450e9, 4800e9,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
)  # fmt: skip
CHIPS: dict[str, ChipSpec] = {c.name: c for c in _CHIPS}
TPU_CHIPS: dict[str, ChipSpec] = {n: c for n, c in CHIPS.items() if c.device_kind.startswith("TPU")}
_BY_KIND = {c.device_kind: c for c in _CHIPS}
# Short names a person types for `--device`.
_ALIASES = {"a100": "a100-80gb"}


def chip_named(name: str) -> ChipSpec:
    """The chip `--device=NAME` names (case-insensitive; `a100` is the 80 GB part).

    Raises:
      ValueError: an unknown name; the message lists the known ones.
    """
    key = name.strip().lower()
    chip = CHIPS.get(_ALIASES.get(key, key))
    if chip is None:
        known = ", ".join([*CHIPS, *_ALIASES])
        raise ValueError(f"--device={name!r} is not a known device; known: {known}")
    return chip


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What a planner needs to know about one JAX device (None: unknown)."""

    device_kind: str
    memory_bytes: int | None
    peak_flops: float | None
    link_bytes_per_s: float | None
    hbm_bytes_per_s: float | None = None


def device_spec_of_kind(device_kind: str, cores_per_chip: int | None = None) -> DeviceSpec:
    """Per-device figures for a `device_kind` (a chip's HBM and FLOPs split over its cores)."""
    chip = _BY_KIND.get(device_kind)
    if chip is None:
        return DeviceSpec(device_kind, None, None, None)
    n = cores_per_chip or chip.cores_per_chip
    return DeviceSpec(
        device_kind,
        chip.hbm_bytes // n,
        chip.peak_flops / n,
        chip.link_bytes_per_s / n,
        chip.hbm_bytes_per_s / n,
    )


def device_spec_named(name: str) -> DeviceSpec:
    """Per-device figures of the chip `--device=NAME` names (ValueError if unknown)."""
    return device_spec_of_kind(chip_named(name).device_kind)


def device_spec(device: Any) -> DeviceSpec:
    """Figures of a real (or compile-only) JAX device: memory from the runtime when it knows."""
    spec = device_spec_of_kind(device.device_kind)
    with contextlib.suppress(Exception):  # compile-only and CPU devices have no memory stats
        limit = (device.memory_stats() or {}).get("bytes_limit")
        if limit:
            spec = dataclasses.replace(spec, memory_bytes=int(limit))
    return spec


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind, or None if unknown."""
    return device_spec_of_kind(device_kind).peak_flops
