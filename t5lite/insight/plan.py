"""`t5lite plan`: automatic layout search: analytic screening, then compiled on abstract devices.

For a model, a batch and a set of devices (fake CPU devices or a TPU topology's compile-only
devices) the planner enumerates
  * mesh shapes `data × model` (every factorisation of the device count),
  * rules presets: data parallel, and 1D/2D activations × 1D/2D parameters (t5x's table),
  * remat policies (`none | minimal | full`),
validates each layout (divisibility of heads, batch, ...) and screens it analytically (predicted
memory, and a step time from FLOPs, bytes and communication: `estimate.py`), which costs
milliseconds. Only the candidates that could win are compiled (a compile costs a minute on a
laptop): the `top_k` fastest that the prediction says could fit (within 10%), plus any within
`within` of the fastest; if none of those fits once compiled, the next ones are. Compiled
layouts that fit are ranked by the compiled step time: FLOPs over peak FLOP/s plus collective
bytes over link bandwidth, without overlap. The winner is written as a gin file to pass to
`t5lite train` after the model and run configs.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
from jax.sharding import Mesh

from t5lite.insight.communication import ExpectedCollective, fsdp_link_bytes
from t5lite.insight.estimate import estimate_step
from t5lite.insight.hardware import DeviceSpec, GiB, device_spec, device_spec_named
from t5lite.insight.memory import PredictedMemory
from t5lite.insight.meshes import mesh_over
from t5lite.insight.pipeline import PipelineFigures, pipeline_figures
from t5lite.insight.plan_output import (
    FIT_MARGIN,
    format_table,
    least_memory,
    pipeline_verdict,
    screen_line,
)
from t5lite.insight.plot import check_plot_path, plot_layouts
from t5lite.insight.report import analytic_figures, step_report
from t5lite.insight.sharding import format_bytes
from t5lite.insight.slices import dcn_axes, link_seconds, mesh_slices, slice_count
from t5lite.insight.tables import terminal_width
from t5lite.insight.tensor_nd import ranking_lines, whole_step_lines
from t5lite.insight.topology import get_topology
from t5lite.insight.tpu_pipeline_memory import TpuPipelineMemory, stage_memory
from t5lite.insight.types import AnalyticFigures, Candidate, Layout
from t5lite.model.config import PIPELINE_SCHEDULES, REMAT_POLICIES
from t5lite.model.models import BaseModel
from t5lite.partitioning import (
    DATA,
    MODEL,
    PRESETS,
    REPLICA,
    STAGE,
    Partitioner,
    PartitioningError,
    create_mesh,
    presets_for,
)
from t5lite.trainer import Trainer

# Used only to rank when the device's figures are unknown (CPU): the order of layouts then
# depends on their ratio, not on these values.
_ASSUMED_PEAK_FLOPS = 100e12
_ASSUMED_LINK_BYTES_PER_S = 100e9
_ASSUMED_HBM_BYTES_PER_S = 1e12


def enumerate_layouts(
    num_devices: int,
    presets: Sequence[str] = tuple(PRESETS),
    remat_policies: Sequence[str] = REMAT_POLICIES,
    model_sizes: Sequence[int] | None = None,
    stage_counts: Sequence[int] = (1,),
    batch_size: int | None = None,
    schedules: Sequence[str] = ("gpipe",),
    slices: int = 1,
) -> list[Layout]:
    """Every distinct (stages, mesh, preset, remat) for `num_devices` devices.

    Data parallelism ignores the mesh shape (the batch takes every axis), so it is tried on one
    mesh; `model = 1` is kept only for presets where it differs from data parallelism (FSDP).
    Each stage count `p > 1` that divides the devices adds GPipe layouts: the rest of the
    devices laid out as above in every stage, with `pipeline_microbatches(p, ...)`, once for
    each of `schedules`. Over `slices > 1` slices the layouts without stages come twice: laid
    over all the devices, and as `replicas = slices` copies of a mesh over one slice's devices.
    """
    for name in schedules:
        if name not in PIPELINE_SCHEDULES:
            raise ValueError(f"plan: unknown schedule {name!r}; known: {PIPELINE_SCHEDULES}")
    for p in presets:
        if p not in PRESETS:
            raise ValueError(f"plan: unknown preset {p!r}; known: {', '.join(PRESETS)}")
    for r in remat_policies:
        if r not in REMAT_POLICIES:
            raise ValueError(f"plan: unknown remat policy {r!r}; known: {REMAT_POLICIES}")
    for p in stage_counts:
        if p < 1 or num_devices % p:
            raise ValueError(f"plan: stage count {p} does not divide {num_devices} devices")
    if slices < 1 or num_devices % slices:
        raise ValueError(f"plan: slices={slices} does not divide {num_devices} devices")
    out = []
    for p in stage_counts:
        per_stage = num_devices // p
        sizes = [m for m in range(1, per_stage + 1) if per_stage % m == 0]
        if model_sizes is not None:
            sizes = [m for m in sizes if m in model_sizes]
        for preset in presets:
            for m in sizes:
                if preset == "data_parallel" and m != 1:
                    continue
                if m == 1 and preset not in ("data_parallel", "fsdp"):
                    continue
                mb = pipeline_microbatches(p, batch_size, per_stage // m) if p > 1 else 0
                for schedule in schedules if p > 1 else ("gpipe",):
                    for remat in remat_policies:
                        out.append(Layout(per_stage // m, m, preset, remat, p, mb, schedule))
    if slices > 1:
        out += [
            dataclasses.replace(x, replicas=slices)
            for x in enumerate_layouts(num_devices // slices, presets, remat_policies, model_sizes)
            if x.preset != "data_parallel"  # the batch takes every axis: the same program
        ]
    return out


def pipeline_microbatches(stages: int, batch_size: int | None, data: int) -> int:
    """GPipe's microbatches for a planned pipeline: `4p` (a bubble of `(p-1)/(5p-1)`, under a
    quarter) when the batch cuts into them over `data`, else `p`."""
    m = 4 * stages
    if batch_size is None or (batch_size % m == 0 and (batch_size // m) % data == 0):
        return m
    return stages


def with_remat(model: BaseModel, remat: str) -> BaseModel:
    """`model` with another remat policy."""
    cfg = dataclasses.replace(model.network_config, remat_policy=remat)
    return dataclasses.replace(model, network_config=cfg)


def build_trainer(
    layout: Layout,
    model: BaseModel,
    devices: Sequence[Any],
    batch_size: int,
    lengths: Mapping[str, int],
    num_microbatches: int = 1,
) -> Trainer:
    """The trainer of one layout (PartitioningError/ValueError if the layout is invalid)."""
    if layout.replicas > 1:  # consecutive device blocks are the slices (`create_mesh`)
        shape = {REPLICA: layout.replicas, DATA: layout.data, MODEL: layout.model}
        grid = np.asarray(list(devices), dtype=object).reshape(tuple(shape.values()))
        mesh = Mesh(grid, tuple(shape))
    elif layout.stages == 1 and (n := slice_count(devices)) > 1 and layout.data % n == 0:
        # across slices: the outer part of `data` over DCN, each process's batch contiguous
        ici, dcn = (layout.data // n, layout.model), (n, 1)
        mesh = create_mesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, devices=list(devices))
    elif layout.stages == 1:
        mesh = mesh_over({"data": layout.data, "model": layout.model}, devices)
    else:
        # Stages are consecutive device blocks, each a data x model mesh (as `create_mesh`).
        grid = np.asarray(list(devices), dtype=object)
        mesh = Mesh(grid.reshape(layout.stages, layout.data, layout.model), (STAGE, DATA, MODEL))
        # A pipeline splits the scanned stack's `layers` dimension (model/pipeline.py).
        cfg = dataclasses.replace(
            model.network_config,
            scan_layers=True,
            pipeline_microbatches=layout.microbatches,
            pipeline_schedule=layout.schedule,
        )
        model = dataclasses.replace(model, network_config=cfg)
    part = Partitioner(mesh, logical_axis_rules=layout.rules())
    return Trainer(
        with_remat(model, layout.remat),
        part,
        batch_size=batch_size,
        lengths=lengths,
        num_microbatches=num_microbatches,
    )


def screen_layout(
    layout: Layout,
    model: BaseModel,
    devices: Sequence[Any],
    device: DeviceSpec,
    batch_size: int,
    lengths: Mapping[str, int],
    num_microbatches: int = 1,
) -> tuple[Candidate, Trainer | None]:
    """Builds a layout and gives its analytic figures (no compilation)."""
    try:
        trainer = build_trainer(layout, model, devices, batch_size, lengths, num_microbatches)
    except (PartitioningError, ValueError, NotImplementedError) as e:
        # Indivisible heads or batch, or a mesh the topology cannot be cut into.
        return Candidate(layout, f"invalid: {_first_line(e)}"), None
    try:
        a = analytic_figures(trainer, device)
    except (PartitioningError, ValueError) as e:  # a pipeline's layers or microbatches
        return Candidate(layout, f"invalid: {_first_line(e)}"), None
    if layout.stages > 1:
        a = pipeline_analytic(trainer, a, device)
    screened = Candidate(layout, "screened", predicted=a.predicted, estimate=a.estimate, analytic=a)
    return screened, trainer


def pipeline_analytic(trainer: Trainer, a: AnalyticFigures, device: DeviceSpec) -> AnalyticFigures:
    """A pipelined layout's analytic figures: its schedule's memory (`pipeline_memory`; GPipe:
    every tick's residuals of one stage's layers) and a step whose compute runs `T / m` times
    the work of the microbatches (every stage computes through the `p - 1` bubble ticks too;
    1F1B's is below)."""
    pm = stage_memory(trainer)
    f = pipeline_figures(trainer)
    if pm is None or f is None:
        return a
    # On TPU the executable, the heap's scalar slots and (past test size) the weight-sized
    # values in HBM count too (tpu_pipeline_memory).
    tpu = isinstance(pm, TpuPipelineMemory)
    code, slots = (pm.code, pm.scalars + pm.position_bias + pm.weight_values) if tpu else (0, 0)
    activations = pm.in_flight + pm.stack_buffers + pm.working + pm.weight_split + slots
    terms = (
        ("residuals in flight", pm.in_flight),
        ("stack buffers", pm.stack_buffers),
        ("working set", pm.working),
    )
    predicted = PredictedMemory(pm.state, pm.batch, pm.gradients, 0, activations, terms, code=code)
    est = estimate_step(trainer, predicted, a.communication, a.report, device)
    hardware = est.hardware_flops * f.ticks / f.microbatches
    if f.schedule == "1f1b":
        # 1F1B (model/schedules.py): the forward pass through the bubble ticks (a forward is
        # about a third of a step's work), then the schedule's forwards and its backwards,
        # each recomputing its forward; its idle half-ticks compute nothing.
        hardware = est.hardware_flops * (f.ticks / f.microbatches + 4) / 3
    expected = a.communication.expected
    mesh = trainer.partitioner.mesh
    slow = dcn_axes(mesh, mesh_slices(mesh, device))
    link = est.link_bytes + _fsdp_repeats(f, expected)
    dcn = est.dcn_bytes + _fsdp_repeats(f, [e for e in expected if slow & set(e.axes)])
    est = dataclasses.replace(
        est,
        hardware_flops=hardware,
        compute_s=hardware / device.peak_flops if device.peak_flops else None,
        link_bytes=link,
        dcn_bytes=dcn,
        communication_s=link_seconds(link, dcn, device),
    )
    return dataclasses.replace(a, predicted=predicted, estimate=est)


def _fsdp_repeats(f: PipelineFigures, expected: Sequence[ExpectedCollective]) -> float:
    """The link bytes FSDP inside a stage sends beyond the unpipelined step's one round of
    gathers and scatters: GPipe's forward and backward gather the stage's weights and scatter
    their gradients in every tick, `T` times a step. 1F1B (model/schedules.py) gathers in each
    of its forward pass's `T` ticks, in each microbatch's F and twice in its B (recomputing,
    then pulling back), and scatters once a B: `(T + 3m) / 2` rounds of the forward-and-backward
    gathers and `m` of the scatters."""
    gathers, scatters = fsdp_link_bytes(expected)
    if f.schedule == "1f1b":
        return ((f.ticks + 3 * f.microbatches) / 2 - 1) * gathers + (f.microbatches - 1) * scatters
    return (f.ticks - 1) * (gathers + scatters)


def compile_candidate(c: Candidate, trainer: Trainer, device: DeviceSpec) -> Candidate:
    """Compiles and measures a screened candidate (a compiler's refusal becomes its status)."""
    t0 = time.perf_counter()
    try:
        step = step_report(trainer, device=device, analytic=c.analytic)
    except Exception as e:  # a compiler's refusal is a result of the search, not a crash
        status = f"failed: {_first_line(e)}"
        return dataclasses.replace(c, status=status, compile_seconds=time.perf_counter() - t0)
    assert step.memory is not None
    status = "does not fit" if step.memory.fits is False else "fits"
    return dataclasses.replace(
        c, status=status, step=step, compile_seconds=time.perf_counter() - t0
    )


def _first_line(e: BaseException) -> str:
    """The gist of an error for a table cell: its first line, the array's path kept and the
    shape/mesh details (already in the table) dropped."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    m = re.match(r"parameter '([^']*)'.*?\}: (.*)", text)
    if m:
        text = f"{m.group(1).removeprefix('params/')}: {m.group(2)}"
    return text[:200]


def predicted_fits(c: Candidate, memory_bytes: int | None) -> bool:
    """Whether the prediction could fit, within `FIT_MARGIN` (True if memory unknown)."""
    if c.predicted is None:
        return False
    return memory_bytes is None or c.predicted.total <= (1 + FIT_MARGIN) * memory_bytes


def select_for_compile(
    screened: Sequence[Candidate],
    memory_bytes: int | None,
    top_k: int = 3,
    within: float = 0.10,
) -> tuple[list[Candidate], int]:
    """The screened candidates worth compiling, fastest first, and how many to compile before
    looking for a fit: the first `top_k` and any within `within` of the fastest. The rest are
    compiled only while none of those fits."""

    def seconds(c: Candidate) -> float:
        return (c.estimate.step_s if c.estimate else None) or 0.0

    ok = [c for c in screened if predicted_fits(c, memory_bytes)]
    ok.sort(key=lambda c: (seconds(c), c.predicted.total if c.predicted else 0))
    if not ok:
        return [], 0
    close = sum(1 for c in ok if seconds(c) <= seconds(ok[0]) * (1 + within))
    return ok, max(min(top_k, len(ok)), close)


def rank(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Compiled layouts that fit by compiled step time; then the uncompiled ones that the
    prediction says fit, by estimated step time; then compiled ones that do not fit and those
    screened out for memory, by memory; invalid and failed layouts last."""

    def key(c: Candidate) -> tuple:
        est = (c.estimate.step_s if c.estimate else None) or 0.0
        if c.fits:
            return (0, c.step_seconds if c.step_seconds is not None else 0.0, c.memory or 0)
        if c.step is None and c.predicted is not None and c.status.startswith("screened: slow"):
            return (1, est, c.predicted.total)
        if c.memory is not None:
            return (2, c.memory, 0)
        if c.predicted is not None:
            return (3, c.predicted.total, 0)
        return (4, 0, 0)

    return sorted(candidates, key=key)


def _resolve_devices(
    num_devices: int | None, topology: str | None, device_name: str | None
) -> tuple[Sequence[Any], DeviceSpec]:
    """The devices to lay meshes over and the per-device figures to judge them by."""
    named = device_spec_named(device_name) if device_name else None  # fails before any work
    if topology:
        topo = get_topology(topology)
        return topo.devices, named or topo.spec
    all_devices = jax.devices()
    n = num_devices or len(all_devices)
    if n > len(all_devices):
        raise ValueError(
            f"plan: num_devices={n} but only {len(all_devices)} devices exist "
            "(fake more with --host_device_count, or plan for a --topology)"
        )
    devices = all_devices[:n]
    return devices, named or device_spec(devices[0])


def plan(
    *,
    model: BaseModel,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    num_devices: int | None = None,
    topology: str | None = None,
    device: str | None = None,
    device_memory_gib: float | None = None,
    link_bandwidth_gbps: float | None = None,
    peak_tflops: float | None = None,
    slices: int = 1,
    dcn_bandwidth_gbps: float | None = None,
    presets: Sequence[str] | None = None,
    remat_policies: Sequence[str] = REMAT_POLICIES,
    model_sizes: Sequence[int] | None = None,
    stage_counts: Sequence[int] = (1,),
    num_microbatches: int = 1,
    top_k: int = 3,
    schedules: Sequence[str] = ("gpipe",),
    output_gin: str | None = None,
    wide: bool = False,
    plot: str | None = None,
    stream: TextIO | None = None,
    progress: TextIO | None = None,
) -> list[Candidate]:
    """Searches layouts, prints the ranked table and writes the best fitting one as gin.

    Args:
      model, task_feature_lengths, batch_size, num_microbatches: what is trained.
      num_devices: devices to plan for (default: every device; fake CPU devices with
        `--host_device_count`).
      topology: a TPU topology name ('v5e:16x16'): plan for its compile-only devices with the
        real TPU compiler and its chip's memory, FLOP/s and link bandwidth.
      device: a name of the hardware table ('v5p', 'h100', ...): judge fit and speed by its
        figures (compiling still happens on the devices at hand).
      device_memory_gib, link_bandwidth_gbps, peak_tflops: per-device figures; override the
        device's (required to drop layouts when the device's memory is unknown, e.g. CPU).
      slices, dcn_bandwidth_gbps: plan for `slices` slices of consecutive devices joined by a
        data-center network of `dcn_bandwidth_gbps` GB/s a device each way (default: the
        device's DCN figure, where the hardware table has one): collectives that cross slices
        run at that rate (`slices.py`), and `replica x data x model` layouts (one copy of the
        model a slice) join the search.
      presets, remat_policies, model_sizes: restrict the search space (presets default:
        every preset that applies to the model, `presets_for`).
      stage_counts: pipeline stage counts to search (1: no pipeline); each `p > 1` adds GPipe
        layouts with a `stage` axis of size `p` (the layers scanned), one per schedule of
        `schedules` ('gpipe', '1f1b'): each screened with its own memory and compute.
      top_k: how many of the analytically fastest fitting layouts to compile (more when their
        estimates are within 10% of the fastest, or when none of them fits once compiled).
      output_gin: where to write the winner's gin bindings.
      wide: print tables at full width (default: at most 100 columns).
      plot: also draw memory and communication per layout to this .png or .svg file.
      stream: where to print the result (default stdout); progress: where to say what is
        being done (default stderr).

    Returns:
      Every candidate, best first.
    """
    stream, progress = stream or sys.stdout, progress or sys.stderr
    if plot:
        check_plot_path(plot)  # before anything slow
    devices, spec = _resolve_devices(num_devices, topology, device)
    spec = _with_overrides(spec, device_memory_gib, link_bandwidth_gbps, peak_tflops)
    spec = _with_slices(spec, slices, dcn_bandwidth_gbps, devices)
    if presets is None:
        presets = presets_for(getattr(model.network_config, "num_experts", 0))
    search = (presets, remat_policies, model_sizes, stage_counts, batch_size, schedules)
    layouts = enumerate_layouts(len(devices), *search, slice_count(devices, spec))
    say = _progress(progress)
    say(f"plan: screening {len(layouts)} layouts on {len(devices)} devices analytically")
    screened, trainers = [], {}
    for i, layout in enumerate(layouts, 1):
        c, trainer = screen_layout(
            layout, model, devices, spec, batch_size, task_feature_lengths, num_microbatches
        )
        say(f"[{i}/{len(layouts)}] {layout.name}: {screen_line(c)}")
        screened.append(c)
        if trainer is not None:
            trainers[layout] = trainer
    results = _compile_winners(screened, trainers, spec, top_k, say)
    ranked = rank(results)
    stream.write(format_table(ranked, spec, width=None if wide else terminal_width()) + "\n")
    nd = ranking_lines(model.network_config, task_feature_lengths, batch_size, len(devices), spec)
    nd += whole_step_lines(
        model.network_config, task_feature_lengths, batch_size, len(devices), spec
    )
    stream.write("\n".join(nd) + "\n")
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
    if any(c.layout.stages > 1 for c in ranked):
        stream.write(pipeline_verdict(ranked) if best else least_memory(ranked))
        stream.write("\n")
    if plot:
        plot_layouts([c for c in ranked if c.predicted is not None], plot)
        stream.write(f"plot: {plot}\n")
    return ranked


def _with_overrides(
    spec: DeviceSpec, memory_gib: float | None, link_gbps: float | None, tflops: float | None
) -> DeviceSpec:
    """The device's figures with the user's overrides, and assumed rates where unknown (CPU)."""
    return dataclasses.replace(
        spec,
        memory_bytes=int(memory_gib * GiB) if memory_gib else spec.memory_bytes,
        peak_flops=tflops * 1e12 if tflops else spec.peak_flops or _ASSUMED_PEAK_FLOPS,
        link_bytes_per_s=(
            link_gbps * 1e9 if link_gbps else spec.link_bytes_per_s or _ASSUMED_LINK_BYTES_PER_S
        ),
        hbm_bytes_per_s=spec.hbm_bytes_per_s or _ASSUMED_HBM_BYTES_PER_S,
    )


def _with_slices(
    spec: DeviceSpec, slices: int, dcn_gbps: float | None, devices: Sequence[Any]
) -> DeviceSpec:
    """The device's figures with `slices` slices of consecutive devices and their DCN rate (a
    multi-slice topology's own slices where `slices` is 1)."""
    n = len(devices)
    if slices < 1 or n % slices:
        raise ValueError(f"plan: slices={slices} does not divide the {n} devices")
    slices = max(slices, slice_count(devices))
    dcn = dcn_gbps * 1e9 if dcn_gbps else spec.dcn_bytes_per_s
    if slices > 1 and not dcn:
        raise ValueError(
            f"plan: slices={slices} needs plan.dcn_bandwidth_gbps: the hardware table has no "
            f"DCN figure for {spec.device_kind!r}"
        )
    size = n // slices if slices > 1 and slice_count(devices) == 1 else None
    return dataclasses.replace(spec, dcn_bytes_per_s=dcn, slice_devices=size)


def _progress(out: TextIO) -> Callable[[str], None]:
    """A printer of progress lines, each stamped with the seconds since the search began."""
    t0 = time.perf_counter()

    def say(line: str) -> None:
        out.write(f"{time.perf_counter() - t0:5.0f}s {line}\n")
        out.flush()

    return say


def _compile_winners(
    screened: Sequence[Candidate],
    trainers: Mapping[Layout, Trainer],
    spec: DeviceSpec,
    top_k: int,
    say: Callable[[str], None],
) -> list[Candidate]:
    """Compiles the candidates that could win; every other layout keeps its analytic figures
    with the reason it was not compiled. A preset whose rules table equals an already compiled
    one's on the same mesh and remat (`tensor_2d` is `fully_sharded`'s table) is the same
    program: it is not compiled again, and says so."""
    order, n_first = select_for_compile(screened, spec.memory_bytes, top_k)
    done: dict[Layout, Candidate] = {}
    compiled: dict[tuple, Layout] = {}  # (mesh, remat, rules) -> the layout compiled for it
    say(
        f"plan: compiling the {n_first} analytically fastest of the {len(order)} layouts "
        "that could fit"
    )
    for j, c in enumerate(order):
        if j >= n_first and any(d.fits for d in done.values()):
            break
        key = (c.layout.data, c.layout.model, c.layout.remat, c.layout.rules())
        if key in compiled:
            twin = compiled[key]
            status = f"same rules as {twin.preset}: not compiled again"
            done[c.layout] = dataclasses.replace(done[twin], layout=c.layout, status=status)
            say(f"[{j + 1}/{max(n_first, j + 1)}] {c.layout.name}: {status}")
            continue
        compiled[key] = c.layout
        say(f"[{j + 1}/{max(n_first, j + 1)}] {c.layout.name}: compiling...")
        d = compile_candidate(c, trainers[c.layout], spec)
        mem = f", {format_bytes(d.memory)} compiled" if d.memory is not None else ""
        say(f"    {d.status}{mem} ({d.compile_seconds:.0f} s)")
        done[c.layout] = d
    out = []
    for c in screened:
        if c.layout in done:
            out.append(done[c.layout])
        elif c.predicted is None:
            out.append(c)
        elif c in order:  # the `est ms` column says by how much
            out.append(dataclasses.replace(c, status="screened: slower"))
        else:
            out.append(dataclasses.replace(c, status="screened: memory"))
    return out
