"""The reports' types: one compiled train step (`StepReport`), a layout's analytic figures, and
`plan`'s layouts and candidates. Shared by `report`, `summary`, `explain`, `plot` and `plan`, so
that none of those imports another for a type.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from t5lite.insight.communication import (
    AnalyticCommunication,
)
from t5lite.insight.comparison import compare_communication, format_comparison
from t5lite.insight.estimate import StepEstimate
from t5lite.insight.experts import format_expert_all_to_all
from t5lite.insight.hardware import DeviceSpec
from t5lite.insight.hlo import KINDS, CollectiveRow
from t5lite.insight.memory import MemoryReport, PredictedMemory
from t5lite.insight.sharding import ShardingReport, format_bytes
from t5lite.insight.zero3 import format_zero3
from t5lite.partitioning import DATA, MODEL, REPLICA, pipeline_rules, preset_rules


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Memory, collectives, compute and communication of one compiled train step per device."""

    mesh_shape: dict[str, int]
    device: DeviceSpec
    memory: MemoryReport | None
    predicted: PredictedMemory
    collectives: tuple[CollectiveRow, ...]
    analytic: AnalyticCommunication
    flops: float | None  # per device, from the compiled cost analysis
    compute_seconds: float | None
    communication_seconds: float | None
    estimate: StepEstimate | None = None  # analytic step time on `device`

    @property
    def step_seconds(self) -> float | None:
        """Compute plus communication, without overlap: a pessimistic, comparable estimate."""
        if self.compute_seconds is None or self.communication_seconds is None:
            return None
        return self.compute_seconds + self.communication_seconds

    def bytes_over(self, axes: Sequence[str], kind: str | None = None) -> int:
        """Compiled collective bytes (per device) over exactly these mesh axes."""
        return sum(
            r.bytes
            for r in self.collectives
            if r.axes is not None and set(r.axes) == set(axes) and kind in (None, r.kind)
        )

    def count(self, kind: str, axes: Sequence[str] | None = None) -> int:
        return sum(
            r.count
            for r in self.collectives
            if r.kind == kind
            and (axes is None or (r.axes is not None and set(r.axes) == set(axes)))
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh_shape,
            "device": dataclasses.asdict(self.device),
            "memory": self.memory.to_json() if self.memory else None,
            "predicted_memory": {
                **dataclasses.asdict(self.predicted),
                "total": self.predicted.total,
            },
            "collectives": [
                {**dataclasses.asdict(r), "axes": list(r.axes) if r.axes is not None else None}
                for r in self.collectives
            ],
            "analytic_communication": self.analytic.to_json(),
            "flops": self.flops,
            "step_seconds": self.step_seconds,
            "estimate": (
                {**dataclasses.asdict(self.estimate), "step_s": self.estimate.step_s}
                if self.estimate
                else None
            ),
        }

    def format(self, width: int | None = None) -> str:
        """Plain-text tables: memory, collectives, analytic vs compiled communication (long
        lines wrapped at `width`)."""
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        dev_mem = self.device.memory_bytes
        lines = [f"train step per device ({self.device.device_kind}, mesh {mesh}):"]
        p = self.predicted
        if self.memory is not None:
            m = self.memory
            rows = [
                ("arguments", m.arguments, "train state + batch"),
                ("outputs", m.outputs, "new train state + metrics"),
                ("aliased", -m.aliased, "outputs written into donated arguments"),
                ("temporaries", m.temporaries, "activations, gradients, workspace"),
                ("code", m.generated_code, ""),
            ]
            for name, n, why in rows:
                lines.append(f"  {name:<12}{format_bytes(n):>12}   {why}".rstrip())
            of = ""
            if dev_mem:
                verdict = "fits" if m.total <= dev_mem else "DOES NOT FIT"
                of = f" of {format_bytes(dev_mem)} ({100 * m.total / dev_mem:.1f}%): {verdict}"
            lines.append(f"  {'total':<12}{format_bytes(m.total):>12}{of}")
        predicted = (
            f"  predicted (analytic): {format_bytes(p.total)} = state {format_bytes(p.state)} + "
            f"batch {format_bytes(p.batch)} + gradients {format_bytes(p.gradients)} + "
            f"update {format_bytes(p.update)} + activations {format_bytes(p.activations)}"
        )
        if p.activation_kinds:
            predicted += "; activations by layer kind: " + ", ".join(
                f"{kind} {format_bytes(n)}" for kind, n in p.activation_kinds
            )
        lines += (
            textwrap.wrap(predicted, width, subsequent_indent=" " * 4) if width else [predicted]
        )
        if self.memory is None and dev_mem:
            verdict = "fits" if p.total <= dev_mem else "DOES NOT FIT"
            lines.append(f"  of {format_bytes(dev_mem)}: {verdict} (predicted)")
        if self.memory is not None:
            lines += ["", "collectives of the compiled step (per device):", *self._collectives()]
        a = self.analytic
        data = "+".join(a.data_axes) or DATA
        lines += [
            "",
            "communication per device per step".ljust(31)
            + "compiled".ljust(16)
            + "analytic (Mesh-TF)",
            f"  over the batch axes ({data}):".ljust(31)
            + f"{format_bytes(self.bytes_over(a.data_axes)) if self.memory else '-':<16}"
            + f"{format_bytes(a.data_axes_bytes)}   (≈ parameters)",
            f"  over {MODEL}:".ljust(31)
            + f"{format_bytes(self.bytes_over((MODEL,))) if self.memory else '-':<16}"
            + f"{format_bytes(a.model_axis_bytes)}   (≈ activations of split layers)",
        ]
        if self.memory is not None:  # compiled: bytes sent per mesh axes, each gap named
            lines += ["", "bytes sent per device, compiled vs analytic:"]
            lines += format_comparison(compare_communication(self.collectives, a), width)
        if a.zero3 is not None:
            lines += ["", *format_zero3(a.zero3, self.collectives if self.memory else None)]
        if a.experts is not None:
            compiled = self.collectives if self.memory else None
            lines += ["", *format_expert_all_to_all(a.experts, compiled)]
        if self.flops is not None:
            est = f"{self.flops / 1e9:,.4g} GFLOP per device"
            if self.step_seconds is not None:
                est += (
                    f"; estimated step {1e3 * self.step_seconds:.2f} ms = compute "
                    f"{1e3 * (self.compute_seconds or 0):.2f} ms + communication "
                    f"{1e3 * (self.communication_seconds or 0):.2f} ms"
                )
            lines += ["", est]
        return "\n".join(lines)

    def _collectives(self) -> list[str]:
        """The compiled step's collectives, one row per kind and mesh axes, then per kind."""
        table = [("kind", "mesh axes", "count", "bytes", "sent per device")]
        for r in self.collectives:
            row = (r.kind, r.axes_str, str(r.count), format_bytes(r.bytes))
            table.append((*row, format_bytes(r.link_bytes)))
        if len(table) == 1:
            table.append(("(none)", "", "", "", ""))
        table.append(("per kind:", "", "", "", ""))
        for kind in KINDS:  # every kind, zeros included, so an absence is visible
            rs = [r for r in self.collectives if r.kind == kind]
            count, size = sum(r.count for r in rs), sum(r.bytes for r in rs)
            link = sum(r.link_bytes for r in rs)
            table.append((f"  {kind}", "(any)", str(count), format_bytes(size), format_bytes(link)))
        widths = [max(len(t[i]) for t in table) for i in range(5)]
        return ["  " + "  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]


@dataclasses.dataclass(frozen=True)
class AnalyticFigures:
    """What a layout implies before compiling: its sharding, memory, communication and step
    estimate (built once; `plan` screens with them and hands them on to `step_report`)."""

    report: ShardingReport
    predicted: PredictedMemory
    communication: AnalyticCommunication
    estimate: StepEstimate


@dataclasses.dataclass(frozen=True)
class Layout:
    """One point of the search space (`stages > 1`: a GPipe pipeline of that many stages, each
    a `data x model` mesh, its layers split by `pipeline_rules(preset)`; `replicas > 1`: that
    many copies of a `data x model` mesh, one a slice, the batch split over `('replica',
    'data')` and the gradients all-reduced between them)."""

    data: int
    model: int
    preset: str
    remat: str
    stages: int = 1
    microbatches: int = 0  # pipeline microbatches (0: none, or as many as stages)
    schedule: str = "gpipe"  # the pipeline's schedule (model/config.py PIPELINE_SCHEDULES)
    replicas: int = 1  # the `replica` mesh axis (multi-slice data parallelism)

    @property
    def name(self) -> str:
        replica = f" replica={self.replicas}" if self.replicas > 1 else ""
        name = f"{self.preset}{replica} data={self.data} model={self.model} remat={self.remat}"
        if self.stages > 1:
            name += f" stage={self.stages} m={self.microbatches}"
            if self.schedule != "gpipe":
                name += f" {self.schedule}"
        return name

    @property
    def mesh(self) -> str:
        """The mesh as plan's table writes it: `[stages:]data x model` (a schedule other than
        GPipe after it), or `replicas x data x model`."""
        if self.replicas > 1:
            return f"{self.replicas}x{self.data}x{self.model}"
        if self.stages == 1:
            return f"{self.data}x{self.model}"
        schedule = f" {self.schedule}" if self.schedule != "gpipe" else ""
        return f"{self.stages}:{self.data}x{self.model}{schedule}"

    def rules(self) -> tuple[tuple[str, Any], ...]:
        if self.stages > 1:
            return pipeline_rules(self.preset)
        return preset_rules(self.preset, data_axis=(REPLICA, DATA) if self.replicas > 1 else DATA)

    def gin(self, config_class: str) -> str:
        """Gin bindings that reproduce this layout for `t5lite train` (include after the run)."""
        rules = [
            "Partitioner.logical_axis_rules = @preset_rules()",
            f"preset_rules.name = '{self.preset}'",
        ]
        stage = []
        if self.stages > 1:
            rules = [
                "Partitioner.logical_axis_rules = @pipeline_rules()",
                f"pipeline_rules.base = '{self.preset}'",
            ]
            stage = [
                f"Partitioner.num_stages = {self.stages}",
                f"network.{config_class}.scan_layers = True",
                f"network.{config_class}.pipeline_microbatches = {self.microbatches}",
                f"network.{config_class}.pipeline_schedule = '{self.schedule}'",
            ]
        if self.replicas > 1:  # one data x model mesh a slice, the slices over DCN
            stage = [
                f"Partitioner.ici_mesh_shape = (1, {self.data}, {self.model})",
                f"Partitioner.dcn_mesh_shape = ({self.replicas}, 1, 1)",
                "preset_rules.data_axis = ('replica', 'data')",
            ]
        mesh = f"stage={self.stages} x " if self.stages > 1 else ""
        mesh += f"replica={self.replicas} x " if self.replicas > 1 else ""
        return "\n".join(
            [
                f"# Written by `t5lite plan`: mesh {mesh}data={self.data} x model={self.model}, "
                f"{self.preset} rules, remat={self.remat}.",
                "# Pass it after the model and run configs: --gin_file=<this file>.",
                *rules,
                f"NUM_PARTITIONS = {self.model}",
                "Partitioner.num_partitions = %NUM_PARTITIONS",
                *stage,
                f"REMAT_POLICY = '{self.remat}'",
                f"network.{config_class}.remat_policy = %REMAT_POLICY",
                "",
            ]
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout, its analytic figures and, if it was compiled, what compiling showed.

    status: "fits" | "does not fit" (compiled), "screened: ..." (analytic only, with the
    reason), "invalid: ..." (the layout cannot be built), "failed: ..." (the compiler refused).
    """

    layout: Layout
    status: str
    step: StepReport | None = None
    compile_seconds: float = 0.0
    predicted: PredictedMemory | None = None
    estimate: StepEstimate | None = None
    analytic: AnalyticFigures | None = None  # what screening built, reused when compiling

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    @property
    def memory(self) -> int | None:
        """Compiled memory per device (None if not compiled)."""
        return self.step.memory.total if self.step and self.step.memory else None

    @property
    def step_seconds(self) -> float | None:
        """Compiled step estimate (None if not compiled)."""
        return self.step.step_seconds if self.step else None
