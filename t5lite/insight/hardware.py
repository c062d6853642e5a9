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
    source: str  # the data sheet or page each figure was read from (printed with --device)
    cores_per_chip: int = 1  # JAX devices per chip (TPU v4 exposes its two cores)
    # TPU: on-chip vector memory per core, where XLA's memory-space assignment keeps buffers
    # out of HBM (jax/_src/pallas/mosaic/tpu_info.py's `vmem_capacity_bytes`); 0 elsewhere
    vmem_bytes: int = 0
    # TPU: physical TensorCores per chip; v4 and v5p run two as one "megacore" JAX device
    # (jax/_src/pallas/mosaic/tpu_info.py's `num_physical_tensor_cores_per_chip`)
    tensor_cores: int = 1
    # TPU: one direction of the data-center network bandwidth of one chip, the links between
    # slices (multi-slice); 0 where the data sheet gives none
    dcn_bytes_per_s: float = 0.0


_TPU_DOCS = "https://cloud.google.com/tpu/docs/"
_NV = "https://www.nvidia.com/en-us/data-center/"
# Links are one direction of one chip's total: Google's pages quote ICI "bidirectional (per chip)"
# in GBps (earlier revisions: one direction in Gbit/s, the same figure x 8) and NVIDIA quotes
# NVLink's total of both directions, so both are halved here. GPU peaks: the data sheets' bf16
# tensor-core figure without sparsity (they print it with 2:4 sparsity, twice this). HBM sizes
# are GiB: Google's pages write "GB" for v5e/v6e but the runtime's `bytes_limit` is in GiB.
# Checked against the pages named in each entry's `source` (Nov 2026).
_CHIPS = (
    ChipSpec(
        "v4",
        "TPU v4",
        32 * GiB,
        275e12,
        2400e9 / 8,
        1200e9,
        _TPU_DOCS + "v4 (275 TFLOPs bf16; HBM2 32 GiB, 1200 GBps); ICI: Jouppi et al., "
        "'TPU v4', ISCA 2023 (6 links x 400 Gbit/s each way)",
        cores_per_chip=2,
        vmem_bytes=16 * 2**20,
        tensor_cores=2,
    ),
    ChipSpec(
        "v5e",
        "TPU v5 lite",
        16 * GiB,
        197e12,
        400e9 / 2,
        819e9,
        _TPU_DOCS + "v5e (197 TFLOPs bf16; HBM2 16 GB, 819 GBps; ICI 400 GBps bidirectional; "
        "DCN: 2 x 100 Gbps NICs a host of 8 chips)",
        vmem_bytes=128 * 2**20,
        dcn_bytes_per_s=2 * 100e9 / 8 / 8,
    ),
    ChipSpec(
        "v5p",
        "TPU v5",
        95 * GiB,
        459e12,
        1200e9 / 2,
        2765e9,
        _TPU_DOCS + "v5p-training (459 TFLOPs bf16; HBM2e 95 GiB, 2765 GBps; ICI 1200 GBps "
        "bidirectional; DCN 50 Gbps a chip)",
        vmem_bytes=64 * 2**20,
        tensor_cores=2,
        dcn_bytes_per_s=50e9 / 8,
    ),
    ChipSpec(
        "v6e",
        "TPU v6 lite",
        32 * GiB,
        918e12,
        800e9 / 2,
        1638e9,
        _TPU_DOCS + "v6e (918 TFLOPs bf16; HBM 32 GB, 1638 GBps; ICI 800 GBps bidirectional)",
        vmem_bytes=128 * 2**20,
    ),
    ChipSpec(
        "a100-40gb",
        "NVIDIA A100-SXM4-40GB",
        40 * GiB,
        312e12,
        600e9 / 2,
        1555e9,
        _NV + "a100 (NVIDIA A100 Tensor Core GPU datasheet, SXM4 40GB: 312 TFLOPS bf16 "
        "dense, 1,555 GB/s, NVLink 600 GB/s)",
    ),
    ChipSpec(
        "a100-80gb",
        "NVIDIA A100-SXM4-80GB",
        80 * GiB,
        312e12,
        600e9 / 2,
        2039e9,
        _NV + "a100 (NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB: 312 TFLOPS bf16 "
        "dense, 2,039 GB/s, NVLink 600 GB/s)",
    ),
    ChipSpec(
        "h100",
        "NVIDIA H100 80GB HBM3",
        80 * GiB,
        989e12,
        900e9 / 2,
        3350e9,
        _NV + "h100 (NVIDIA H100 Tensor Core GPU datasheet, SXM: 1,979 TFLOPS bf16 with "
        "sparsity, 3.35 TB/s, NVLink 900 GB/s)",
    ),
    ChipSpec(
        "h200",
        "NVIDIA H200",
        141 * GiB,
        989e12,
        900e9 / 2,
        4800e9,
        _NV + "h200 (NVIDIA H200 Tensor Core GPU datasheet, SXM: 1,979 TFLOPS bf16 with "
        "sparsity, 141 GB, 4.8 TB/s, NVLink 900 GB/s)",
    ),
)
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
    source: str | None = None  # where the figures come from (None: the runtime, or unknown)
    # Multi-slice: the data-center network between slices, per device one way, and how many
    # consecutive device ids form a slice (None: the devices' own `slice_index`, if any)
    dcn_bytes_per_s: float | None = None
    slice_devices: int | None = None


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
        chip.source,
        chip.dcn_bytes_per_s / n or None,
    )


def vmem_bytes_of_kind(device_kind: str) -> int:
    """On-chip vector memory per core of a TPU `device_kind` (0: not a TPU, or unknown)."""
    chip = _BY_KIND.get(device_kind)
    return chip.vmem_bytes if chip else 0


def tensor_cores_per_device(device_kind: str) -> int:
    """Physical TensorCores one JAX device of a TPU `device_kind` runs on (2: a megacore)."""
    chip = _BY_KIND.get(device_kind)
    return max(1, chip.tensor_cores // chip.cores_per_chip) if chip else 1


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
