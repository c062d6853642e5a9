"""`t5lite inspect`: how a model is split over the mesh and what that costs, computed abstractly.

Three views of one layout, side by side:
  * the per-parameter sharding report (where every array lives);
  * the compiled train step: memory per device from XLA's memory analysis (arguments, outputs,
    temporaries) against the device's memory, and every collective counted and sized per kind
    and per mesh axis;
  * the analytic estimate of Mesh-TensorFlow's Table 1: data parallelism all-reduces about the
    parameters over the batch axes, model parallelism about the activations of the split layers
    over `model`.

Nothing is allocated: state and batch are `ShapeDtypeStruct`s, so full-size models are inspected
on fake CPU devices or compiled ahead of time for a TPU topology (`topology.get_topology`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from jax.sharding import Mesh

from t5lite.insight.communication import (
    analytic_communication,
    collective_rows,
)
from t5lite.insight.estimate import estimate_step
from t5lite.insight.explain import explain_oom
from t5lite.insight.hardware import DeviceSpec, GiB, device_spec, device_spec_named
from t5lite.insight.hlo import parse_collectives
from t5lite.insight.memory import memory_report, predict_memory
from t5lite.insight.meshes import partitioner_on
from t5lite.insight.pipeline import pipeline_figures
from t5lite.insight.plot import check_plot_path, plot_steps
from t5lite.insight.sharding import ShardingReport, format_bytes, sharding_report
from t5lite.insight.slices import compiled_link_bytes, link_seconds, mesh_slices
from t5lite.insight.summary import format_summary, memory_verdict
from t5lite.insight.tables import terminal_width
from t5lite.insight.tensor_nd import step_part_lines, tensor_nd_lines
from t5lite.insight.topology import get_topology
from t5lite.insight.tpu_pipeline_memory import stage_memory
from t5lite.insight.types import AnalyticFigures, StepReport
from t5lite.model.models import BaseModel
from t5lite.partitioning import CompiledFunction, Partitioner
from t5lite.trainer import Trainer

# XLA:CPU options for a compile that is only read (memory, HLO, FLOPs), never run: LLVM's
# optimisation level and its expensive passes only change the machine code, which none of those
# figures read (buffer assignment and the optimised HLO come before code generation), and they
# are most of a CPU compile's time. tests/test_insight.py checks the figures are identical.
INSPECTION_CPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def inspection_compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    """Compiler options for compiling on `mesh`'s devices only to read the figures: the cheap
    code generation on CPU; None (the defaults) elsewhere, e.g. a TPU topology's compiler,
    whose option names differ."""
    platform = mesh.devices.flat[0].platform
    return dict(INSPECTION_CPU_COMPILER_OPTIONS) if platform == "cpu" else None


def compile_train_step(
    trainer: Trainer,
    progress: Callable[[str], None] | None = None,
    *,
    for_inspection: bool = True,
) -> CompiledFunction:
    """Lowers and compiles `trainer.train_step` ahead of time on abstract state and batch,
    saying which stage it is in through `progress` (large models take minutes).

    `for_inspection` (the default: `inspect` and `plan` only read the compiled figures) compiles
    with `inspection_compiler_options`: the same memory, HLO and FLOPs, generated faster as
    slower machine code; False compiles as `train` does.
    """
    say = progress or (lambda _: None)
    part = trainer.partitioner
    t0 = time.perf_counter()
    say("lowering the train step to StableHLO...")
    with part.context():
        lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.batch_abstract)
    t1 = time.perf_counter()
    say(f"lowered in {t1 - t0:.0f} s; compiling with XLA (SPMD partitioning, buffer assignment)...")
    options = inspection_compiler_options(part.mesh) if for_inspection else None
    with part.context():
        compiled = lowered.compile(compiler_options=options)
    say(f"compiled in {time.perf_counter() - t1:.0f} s")
    return CompiledFunction(compiled, part)


def analytic_figures(
    trainer: Trainer, device: DeviceSpec, report: ShardingReport | None = None
) -> AnalyticFigures:
    """The analytic figures of `trainer`'s train step on `device` (no compilation)."""
    part = trainer.partitioner
    report = report or sharding_report(part, trainer.abstract_state().params, trainer.params_axes)
    predicted = predict_memory(trainer)
    analytic = analytic_communication(trainer, report)
    est = estimate_step(trainer, predicted, analytic, report, device)
    return AnalyticFigures(report, predicted, analytic, est)


def step_report(
    trainer: Trainer,
    *,
    device: DeviceSpec | None = None,
    compiled: CompiledFunction | None = None,
    compile: bool = True,
    report: ShardingReport | None = None,
    progress: Callable[[str], None] | None = None,
    analytic: AnalyticFigures | None = None,
) -> StepReport:
    """Compiles (unless `compile=False`) and measures the train step of `trainer`.

    Args:
      trainer: the trainer whose `train_step` is measured.
      device: memory, peak FLOP/s and link bandwidth per device (default: the mesh's device).
      compiled: an already compiled train step (skips compilation).
      compile: False gives only the analytic figures (for models too large to compile here).
      report: the parameters' sharding report, if already built.
      progress: called with a line at each compilation stage.
      analytic: the analytic figures for this trainer and `device`, if already built (`plan`
        screens with them first).
    """
    part = trainer.partitioner
    device = device or device_spec(part.mesh.devices.flat[0])
    figures = analytic or analytic_figures(trainer, device, report)
    mem, rows, flops, comp_s, comm_s = None, (), None, None, None
    if compiled is None and compile:
        compiled = compile_train_step(trainer, progress)
    if compiled is not None:
        mem = memory_report(compiled, device.memory_bytes)
        collectives = parse_collectives(compiled.as_text(), part.mesh, _branch_share(trainer))
        rows = tuple(collective_rows(collectives))
        flops = compiled.cost_analysis().get("flops")
        if flops is not None and device.peak_flops:
            comp_s = flops / device.peak_flops
        ici, dcn = compiled_link_bytes(collectives, mesh_slices(part.mesh, device))
        comm_s = link_seconds(ici + dcn, dcn, device)
    return StepReport(
        mesh_shape=dict(part.mesh.shape),
        device=device,
        memory=mem,
        predicted=figures.predicted,
        collectives=rows,
        analytic=figures.communication,
        flops=flops,
        compute_seconds=comp_s,
        communication_seconds=comm_s,
        estimate=figures.estimate,
    )


def _branch_share(trainer: Trainer) -> float:
    """How often a conditional's branch runs per run of it: 1F1B's `2T` half-ticks each switch
    a stage to its F, its B or idle (model/schedules.py), and a stage runs `m` of each, so a
    collective inside F or B runs `m / 2T` as often as the switch; nothing else branches."""
    f = pipeline_figures(trainer)
    return f.microbatches / (2 * f.ticks) if f is not None and f.schedule == "1f1b" else 1.0


def _resolve_device(
    partitioner: Partitioner,
    topology: str | None,
    named: DeviceSpec | None,
    memory_gib: float | None,
    link_gbps: float | None,
    say: Callable[[str], None],
) -> tuple[Partitioner, DeviceSpec]:
    """The partitioner over the topology's devices (if any) and the figures to judge it by."""
    if topology:
        say(f"building compile-only devices of {topology} (libtpu)...")
        topo = get_topology(topology)
        partitioner = partitioner_on(partitioner, topo.devices)
    spec = named or (topo.spec if topology else device_spec(partitioner.mesh.devices.flat[0]))
    spec = dataclasses.replace(
        spec,
        memory_bytes=int(memory_gib * GiB) if memory_gib else spec.memory_bytes,
        link_bytes_per_s=link_gbps * 1e9 if link_gbps else spec.link_bytes_per_s,
    )
    return partitioner, spec


def inspect(
    *,
    model: BaseModel,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    partitioner: Partitioner | None = None,
    num_microbatches: int = 1,
    topology: str | None = None,
    device: str | None = None,
    device_memory_gib: float | None = None,
    link_bandwidth_gbps: float | None = None,
    compile: bool = True,
    wide: bool = False,
    plot: str | None = None,
    output_json: str | None = None,
    stream: TextIO | None = None,
    progress: TextIO | None = None,
) -> tuple[ShardingReport, StepReport]:
    """Prints a summary (verdict, memory, step time, largest collectives), then the detail: the
    sharding report, the train step's memory and communication per device, and what would make
    a layout that does not fit fit.

    Args:
      model, task_feature_lengths, batch_size, num_microbatches: what is trained.
      partitioner: mesh + rules (default: `Partitioner()` on every device).
      topology: a TPU topology name (e.g. 'v5e:16x16'): the mesh is laid over its compile-only
        devices, keeping every mesh axis but `data`, and the real TPU compiler runs.
      device: a name of the hardware table ('v5p', 'h100', ...) to judge memory and speed by
        (default: the mesh's device, or the topology's chip).
      device_memory_gib: per-device memory to compare against (overrides the device's).
      link_bandwidth_gbps: per-device link bandwidth in GB/s for the time estimate.
      compile: False reports only the analytic figures (no XLA compilation).
      wide: every array on its own row and no width limit (default: identical layers folded,
        at most 100 columns).
      plot: also draw memory by category and communication by mesh axis to this .png/.svg.
      output_json: also write every figure there.
      stream: where to print (default stdout); progress: where to say what is being done
        while compiling (default stderr).

    Returns:
      The sharding report and the step report.
    """
    stream, progress = stream or sys.stdout, progress or sys.stderr
    named = device_spec_named(device) if device else None  # an unknown name fails first
    if plot:
        check_plot_path(plot)
    width = None if wide else terminal_width()

    def say(line: str) -> None:
        progress.write(f"inspect: {line}\n")
        progress.flush()

    partitioner, spec = _resolve_device(
        partitioner or Partitioner(), topology, named, device_memory_gib, link_bandwidth_gbps, say
    )
    say("tracing the model's abstract train state...")
    trainer = Trainer(
        model,
        partitioner,
        batch_size=batch_size,
        lengths=task_feature_lengths,
        num_microbatches=num_microbatches,
    )
    state = trainer.abstract_state()
    report = sharding_report(partitioner, state.params, trainer.params_axes)
    opt = sharding_report(partitioner, state.opt_state, trainer.state_axes.opt_state)
    compiled = compile_train_step(trainer, say) if compile else None
    step = step_report(
        trainer, device=spec, compiled=compiled, compile=compile, report=report, progress=say
    )
    stream.write(format_summary(step, width) + "\n\ndetail:\n")
    rules = "rules: " + ", ".join(f"{n}->{a}" for n, a in partitioner.rules)
    rules_lines = textwrap.wrap(rules, width, subsequent_indent="  ") if width else [rules]
    stream.write("\n".join(rules_lines) + f"\n\n{report.format(width, fold=not wide)}\n")
    stream.write(
        f"optimizer state ({type(model.optimizer).__name__}): {format_bytes(opt.bytes_total)} in "
        f"all, {format_bytes(opt.bytes_per_device)} per device\n"
        f"train state per device: {format_bytes(report.bytes_per_device + opt.bytes_per_device)} "
        f"on {partitioner.mesh.devices.size} devices\n\n"
    )
    stream.write(step.format(width) + "\n")
    stages = pipeline_figures(trainer, compiled.as_text() if compiled else None)
    if stages is not None:
        stream.write("\n" + stages.format() + "\n")
        pm = stage_memory(trainer)
        stream.write(pm.format(step.memory.total if step.memory else None) + "\n")
    if compile and (nd_lines := tensor_nd_lines(trainer)):
        nd_lines += step_part_lines(trainer, compiled.as_text())
        stream.write("\n" + "\n".join(nd_lines) + "\n")
    if memory_verdict(step)[0] is False:
        stream.write("\n" + explain_oom(trainer, step, report, opt, width) + "\n")
    if plot:
        plot_steps([("inspect", step)], plot)
        stream.write(f"plot: {plot}\n")
    if output_json:
        with open(output_json, "w") as f:
            json.dump({**report.to_json(), "train_step": step.to_json()}, f, indent=1)
    return report, step
