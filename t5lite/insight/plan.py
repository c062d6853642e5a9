"""`t5lite plan`: automatic layout search, compiled ahead of time on abstract devices.

For a model, a batch and a set of devices (fake CPU devices or a TPU topology's compile-only
devices) the planner enumerates
  * mesh shapes `data × model` (every factorisation of the device count),
  * rules presets: data parallel, and 1D/2D activations × 1D/2D parameters (t5x's table),
  * remat policies (`none | minimal | full`),
validates each layout (divisibility of heads, batch, ...), compiles its train step abstractly,
drops what does not fit in device memory and ranks the rest by an estimated step time: compiled
FLOPs over peak FLOP/s plus collective bytes over link bandwidth, without overlap. The winner is
written as a gin file to pass to `t5lite train` after the model and run configs.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax

from t5lite.insight.hardware import DeviceSpec, GiB, device_spec
from t5lite.insight.report import StepReport, mesh_over, step_report
from t5lite.insight.sharding import _fmt_bytes
from t5lite.insight.topology import get_topology
from t5lite.model.config import REMAT_POLICIES
from t5lite.model.models import BaseModel
from t5lite.partitioning import PRESETS, Partitioner, PartitioningError, preset_rules
from t5lite.trainer import Trainer

# Used only to rank when the device's figures are unknown (CPU): the order of layouts then
# depends on their ratio, not on these values.
_ASSUMED_PEAK_FLOPS = 100e12
_ASSUMED_LINK_BYTES_PER_S = 100e9


@dataclasses.dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    data: int
    model: int
    preset: str
    remat: str

    @property
    def name(self) -> str:
        return f"{self.data}x{self.model} {self.preset} remat={self.remat}"

    def rules(self) -> tuple[tuple[str, Any], ...]:
        return preset_rules(self.preset)

    def gin(self, config_class: str) -> str:
        """Gin bindings that reproduce this layout for `t5lite train` (include after the run)."""
        rules = [
            "Partitioner.logical_axis_rules = @preset_rules()",
            f"preset_rules.name = '{self.preset}'",
        ]
        return "\n".join(
            [
                f"# Written by `t5lite plan`: mesh data={self.data} x model={self.model}, "
                f"{self.preset} rules, remat={self.remat}.",
                "# Pass it after the model and run configs: --gin_file=<this file>.",
                *rules,
                f"NUM_PARTITIONS = {self.model}",
                "Partitioner.num_partitions = %NUM_PARTITIONS",
                f"REMAT_POLICY = '{self.remat}'",
                f"network.{config_class}.remat_policy = %REMAT_POLICY",
                "",
            ]
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout and what compiling it showed."""

    layout: Layout
    status: str  # "fits" | "does not fit" | "invalid: ..." | "failed: ..."
    step: StepReport | None = None
    compile_seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    @property
    def memory(self) -> int | None:
        return self.step.memory.total if self.step and self.step.memory else None

    @property
    def step_seconds(self) -> float | None:
        return self.step.step_seconds if self.step else None


def enumerate_layouts(
    num_devices: int,
    presets: Sequence[str] = tuple(PRESETS),
    remat_policies: Sequence[str] = REMAT_POLICIES,
    model_sizes: Sequence[int] | None = None,
) -> list[Layout]:
    """Every distinct (mesh, preset, remat) for `num_devices` devices.

    Data parallelism ignores the mesh shape (the batch takes every axis), so it is tried on one
    mesh; `model = 1` is kept only for presets where it differs from data parallelism (FSDP).
    """
    for p in presets:
        if p not in PRESETS:
            raise ValueError(f"plan: unknown preset {p!r}; known: {', '.join(PRESETS)}")
    for r in remat_policies:
        if r not in REMAT_POLICIES:
            raise ValueError(f"plan: unknown remat policy {r!r}; known: {REMAT_POLICIES}")
    sizes = [m for m in range(1, num_devices + 1) if num_devices % m == 0]
    if model_sizes is not None:
        sizes = [m for m in sizes if m in model_sizes]
    out = []
    for preset in presets:
        for m in sizes:
            if preset == "data_parallel" and m != 1:
                continue
            if m == 1 and preset not in ("data_parallel", "fsdp"):
                continue
            for remat in remat_policies:
                out.append(Layout(num_devices // m, m, preset, remat))
    return out


def _with_remat(model: BaseModel, remat: str) -> BaseModel:
    cfg = dataclasses.replace(model.network_config, remat_policy=remat)
    return dataclasses.replace(model, network_config=cfg)


def evaluate_layout(
    layout: Layout,
    model: BaseModel,
    devices: Sequence[Any],
    device: DeviceSpec,
    batch_size: int,
    lengths: Mapping[str, int],
    num_microbatches: int = 1,
) -> Candidate:
    """Validates, compiles and measures one layout (exceptions become the candidate's status)."""
    try:
        mesh = mesh_over({"data": layout.data, "model": layout.model}, devices)
        part = Partitioner(mesh, logical_axis_rules=layout.rules())
        trainer = Trainer(
            _with_remat(model, layout.remat),
            part,
            batch_size=batch_size,
            lengths=lengths,
            num_microbatches=num_microbatches,
        )
    except (PartitioningError, ValueError, NotImplementedError) as e:
        # Indivisible heads or batch, or a mesh the topology cannot be cut into.
        return Candidate(layout, f"invalid: {_first_line(e)}")
    t0 = time.perf_counter()
    try:
        step = step_report(trainer, device=device)
    except Exception as e:  # a compiler's refusal is a result of the search, not a crash
        return Candidate(layout, f"failed: {_first_line(e)}", None, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    assert step.memory is not None
    status = "does not fit" if step.memory.fits is False else "fits"
    return Candidate(layout, status, step, seconds)


def _first_line(e: BaseException) -> str:
    """The gist of an error for a table cell: its first line, the array's path kept and the
    shape/mesh details (already in the table) dropped."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    m = re.match(r"parameter '([^']*)'.*?\}: (.*)", text)
    if m:
        text = f"{m.group(1).removeprefix('params/')}: {m.group(2)}"
    return text[:200]


def rank(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Fitting layouts by estimated step time (then memory); then the rest by memory; invalid
    and failed layouts last."""

    def key(c: Candidate) -> tuple:
        if c.fits:
            return (0, c.step_seconds if c.step_seconds is not None else 0.0, c.memory or 0)
        if c.memory is not None:
            return (1, c.memory, 0)
        return (2, 0, 0)

    return sorted(candidates, key=key)


def format_table(ranked: Sequence[Candidate], device: DeviceSpec) -> str:
    """The ranked table, one row per layout."""
    rows = [("#", "mesh", "preset", "remat", "memory/dev", "GFLOP/dev", "comm/dev", "step ms",
             "status")]  # fmt: skip
    for i, c in enumerate(ranked, 1):
        s = c.step
        comm = sum(r.link_bytes for r in s.collectives) if s else None
        rows.append(
            (
                str(i),
                f"{c.layout.data}x{c.layout.model}",
                c.layout.preset,
                c.layout.remat,
                _fmt_bytes(c.memory) if c.memory is not None else "-",
                f"{s.flops / 1e9:,.3g}" if s and s.flops is not None else "-",
                _fmt_bytes(comm) if comm is not None else "-",
                f"{1e3 * c.step_seconds:.3g}" if c.step_seconds is not None else "-",
                c.status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    mem = _fmt_bytes(device.memory_bytes) if device.memory_bytes else "unknown"
    lines.append(
        f"device: {device.device_kind}, memory {mem}, peak {device.peak_flops / 1e12:.0f} "
        f"TFLOP/s, links {device.link_bytes_per_s / 1e9:.0f} GB/s"
    )
    return "\n".join(lines)


def plan(
    *,
    model: BaseModel,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    num_devices: int | None = None,
    topology: str | None = None,
    device_memory_gib: float | None = None,
    link_bandwidth_gbps: float | None = None,
    peak_tflops: float | None = None,
    presets: Sequence[str] = tuple(PRESETS),
    remat_policies: Sequence[str] = REMAT_POLICIES,
    model_sizes: Sequence[int] | None = None,
    num_microbatches: int = 1,
    output_gin: str | None = None,
    stream: TextIO | None = None,
) -> list[Candidate]:
    """Searches layouts, prints the ranked table and writes the best fitting one as gin.

    Args:
      model, task_feature_lengths, batch_size, num_microbatches: what is trained.
      num_devices: devices to plan for (default: every device; fake CPU devices with
        `--host_device_count`).
      topology: a TPU topology name ('v5e:16x16'): plan for its compile-only devices with the
        real TPU compiler and its chip's memory, FLOP/s and link bandwidth.
      device_memory_gib, link_bandwidth_gbps, peak_tflops: per-device figures; override the
        device's (required to drop layouts when the device's memory is unknown, e.g. CPU).
      presets, remat_policies, model_sizes: restrict the search space.
      output_gin: where to write the winner's gin bindings.
      stream: where to print (default stdout).

    Returns:
      Every candidate, best first.
    """
    stream = stream or sys.stdout
    if topology:
        topo = get_topology(topology)
        devices: Sequence[Any] = topo.devices
        device = topo.spec
    else:
        all_devices = jax.devices()
        n = num_devices or len(all_devices)
        if n > len(all_devices):
            raise ValueError(
                f"plan: num_devices={n} but only {len(all_devices)} devices exist "
                "(fake more with --host_device_count, or plan for a --topology)"
            )
        devices = all_devices[:n]
        device = device_spec(devices[0])
    device = dataclasses.replace(
        device,
        memory_bytes=int(device_memory_gib * GiB) if device_memory_gib else device.memory_bytes,
        peak_flops=peak_tflops * 1e12 if peak_tflops else device.peak_flops or _ASSUMED_PEAK_FLOPS,
        link_bytes_per_s=(
            link_bandwidth_gbps * 1e9
            if link_bandwidth_gbps
            else device.link_bytes_per_s or _ASSUMED_LINK_BYTES_PER_S
        ),
    )
    layouts = enumerate_layouts(len(devices), presets, remat_policies, model_sizes)
    stream.write(f"planning {len(layouts)} layouts on {len(devices)} devices\n")
    candidates = []
    for layout in layouts:
        c = evaluate_layout(
            layout, model, devices, device, batch_size, task_feature_lengths, num_microbatches
        )
        stream.write(f"  {layout.name}: {c.status} ({c.compile_seconds:.1f} s)\n")
        stream.flush()
        candidates.append(c)
    ranked = rank(candidates)
    stream.write("\n" + format_table(ranked, device) + "\n")
    best = ranked[0] if ranked and ranked[0].fits else None
    if best is None:
        stream.write("no layout fits: use more devices, a smaller batch or microbatches\n")
    elif output_gin:
        config_class = type(model.network_config).__name__
        with open(output_gin, "w") as f:
            f.write(best.layout.gin(config_class))
        stream.write(f"best: {best.layout.name}; written to {output_gin}\n")
    else:
        stream.write(f"best: {best.layout.name}\n")
    return ranked
