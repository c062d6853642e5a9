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

import collections
import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
from jax.sharding import Mesh

from t5lite.insight.hardware import DeviceSpec, GiB, device_spec
from t5lite.insight.hlo import KINDS, Collective, parse_collectives
from t5lite.insight.sharding import ShardingReport, format_bytes, sharding_report
from t5lite.insight.topology import get_topology
from t5lite.model.models import BaseModel
from t5lite.partitioning import (
    DATA,
    MODEL,
    CompiledFunction,
    Partitioner,
    create_mesh,
    mesh_axes_of,
)
from t5lite.trainer import Trainer

# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one compiled program (XLA's memory analysis)."""

    arguments: int
    outputs: int
    aliased: int  # outputs living in donated argument buffers (the train state)
    temporaries: int
    generated_code: int
    device_memory: int | None = None

    @property
    def total(self) -> int:
        """Peak bytes the program needs on a device: buffers live at once, plus its code."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "fits": self.fits}


def memory_report(compiled: CompiledFunction, device_memory: int | None = None) -> MemoryReport:
    """Reads the compiled program's memory analysis (per device for an SPMD program)."""
    m = compiled.memory_analysis()
    return MemoryReport(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        generated_code=int(getattr(m, "generated_code_size_in_bytes", 0) or 0),
        device_memory=device_memory,
    )


def _tree_bytes_per_device(tree: Any) -> int:
    """Bytes of one device's shards of a tree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """An analytic estimate of the train step's memory per device (no compilation).

    `state` and `batch` are exact (from the shardings). `gradients` are whole over the batch's
    mesh axes until they are reduced (for 2D parameters, before the reduce-scatter); `update`
    is the optimizer's parameter-sized update; `activations` counts what each layer saves for
    the backward pass under the remat policy (a model of it, not XLA's buffer assignment, so
    expect it to drift for large batches).
    """

    state: int
    batch: int
    gradients: int
    update: int
    activations: int

    @property
    def total(self) -> int:
        return self.state + self.batch + self.gradients + self.update + self.activations


def _activations_saved_per_token(
    cfg: Any, remat: str, self_len: int, cross_len: int | None
) -> tuple[int, int]:
    """(values split over `model`, values kept whole) per token that one layer saves for its
    backward pass under a remat policy."""
    d, f, h, hk = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.num_heads * cfg.head_dim
    n_in = len(cfg.mlp_activations)
    if remat == "full":
        return 0, d  # the layer input only; everything else is recomputed
    # Per attention: q, k, v, context (split by heads) and the logits and probabilities
    # [H, L_kv] per query; per MLP: the input projections and the gated hidden (split by mlp).
    attns = [self_len] + ([cross_len] if cross_len else [])
    if remat == "minimal":  # matmul outputs without batch dims: projections only
        split = sum(3 * hk for _ in attns) + n_in * f
        return split, d * (len(attns) + 1)
    split = sum(4 * hk + 2 * h * kv for kv in attns) + n_in * f + f
    return split, 2 * d * (len(attns) + 1)


def predict_memory(trainer: Trainer) -> PredictedMemory:
    """Memory per device of `trainer.train_step`, from shapes and shardings alone."""
    state = trainer.abstract_state()
    cfg = trainer.model.network_config
    act_bytes = np.dtype(cfg.dtype).itemsize
    data_size = trainer.partitioner.data_parallel_size
    b = trainer.batch_size // data_size
    # The model axis splits MLP and heads; activations' embed stays whole (1D activations).
    model_size = math.prod(
        trainer.partitioner.mesh.shape[t]
        for t in mesh_axes_of(_rule_of(trainer.partitioner, "mlp"))
    )
    acts = 0
    if hasattr(cfg, "num_encoder_layers"):
        li, lt = trainer.lengths["inputs"], trainer.lengths["targets"]
        per = [(cfg.num_encoder_layers, li, None), (cfg.num_decoder_layers, lt, li)]
    else:
        lt = trainer.lengths["targets"]
        per = [(cfg.num_layers, lt, None)]
    for n_layers, length, cross_len in per:
        split, whole = _activations_saved_per_token(cfg, cfg.remat_policy, length, cross_len)
        acts += int(n_layers * b * length * (split / model_size + whole) * act_bytes)
    # Logits [B, L, V] in fp32 and their gradient, vocab-sharded over `model`.
    v_shard = cfg.vocab_size // max(model_size, 1)
    acts += 2 * b * trainer.lengths["targets"] * v_shard * 4
    return PredictedMemory(
        state=_tree_bytes_per_device(state),
        batch=_tree_bytes_per_device(
            jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                trainer.batch_abstract,
                trainer.batch_shardings,
            )
        ),
        gradients=_unreduced_gradient_bytes(trainer),
        update=_tree_bytes_per_device(state.params),
        activations=acts,
    )


def _unreduced_gradient_bytes(trainer: Trainer) -> int:
    """Gradient bytes per device before the reduction over the batch's mesh axes."""
    part = trainer.partitioner
    batch_axes = set(mesh_axes_of(part.data_partition_spec[0]))
    total = 0
    for x, s in zip(
        jax.tree_util.tree_leaves(trainer.state_abstract.params),
        jax.tree_util.tree_leaves(trainer.state_shardings.params),
    ):
        split = math.prod(
            part.mesh.shape[t] for e in s.spec for t in mesh_axes_of(e) if t not in batch_axes
        )
        total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // split
    return total


def _rule_of(partitioner: Partitioner, name: str) -> Any:
    for n, axis in partitioner.rules:
        if n == name:
            return axis
    return None


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """All collectives of one kind over the same mesh axes."""

    kind: str
    axes: tuple[str, ...] | None
    count: int
    bytes: int  # sum of their result sizes per device
    link_bytes: float  # bytes each device sends over its links (ring algorithms)

    @property
    def axes_str(self) -> str:
        return "?" if self.axes is None else ("+".join(self.axes) or "-")


def _link_bytes(c: Collective) -> float:
    """Bytes one device sends for `c` with ring algorithms (results sized per device)."""
    n = c.group_size
    if n <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return 2 * (n - 1) / n * c.bytes
    if c.kind == "reduce-scatter":  # the result is the 1/n shard of the reduced input
        return (n - 1) * c.bytes
    if c.kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * c.bytes
    return float(c.bytes)  # collective-permute: each device sends its buffer once


def collective_rows(collectives: Sequence[Collective]) -> list[CollectiveRow]:
    """Collectives grouped by (kind, mesh axes), kinds in `KINDS` order."""
    groups: dict[tuple[str, Any], list[Collective]] = collections.defaultdict(list)
    for c in collectives:
        groups[(c.kind, c.axes)].append(c)
    rows = [
        CollectiveRow(k, a, len(cs), sum(c.bytes for c in cs), sum(map(_link_bytes, cs)))
        for (k, a), cs in groups.items()
    ]
    return sorted(rows, key=lambda r: (KINDS.index(r.kind), str(r.axes)))


def communication_seconds(collectives: Sequence[Collective], link_bytes_per_s: float) -> float:
    """Time to run every collective one after another at `link_bytes_per_s` per device."""
    return sum(map(_link_bytes, collectives)) / link_bytes_per_s


@dataclasses.dataclass(frozen=True)
class AnalyticCommunication:
    """Mesh-TensorFlow Table 1 for one layout: bytes per device per training step.

    data_axes_bytes: gradients reduced over the batch's mesh axes, i.e. the parameter bytes of
      one model-parallel shard (plus, for 2D parameters, the weights gathered back forward and
      backward).
    model_axis_bytes: activations [B/data, L, D] of every split block, all-reduced over `model`
      once forward and once backward (Megatron: one per attention or MLP block).
    """

    data_axes: tuple[str, ...]
    data_axes_bytes: int
    model_axis_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def analytic_communication(trainer: Trainer, report: ShardingReport) -> AnalyticCommunication:
    """Per-device communication the layout implies, before any compiler gets to it."""
    part = trainer.partitioner
    mesh_shape = dict(part.mesh.shape)
    batch_axes = tuple(t for t in mesh_axes_of(part.data_partition_spec[0]) if mesh_shape[t] > 1)
    data_bytes = 0
    if batch_axes:
        for p in report.placements:
            used = {t for e in p.spec for t in mesh_axes_of(e)}
            # The gradient of the part of p one batch group shares: sharded over model axes only.
            model_split = math.prod(mesh_shape[t] for t in used if t not in batch_axes)
            grad = p.bytes_total // model_split
            data_bytes += grad
            if used & set(batch_axes):  # 2D parameters: gathered for forward and backward
                data_bytes += 2 * grad
    model_axes = tuple(
        t for t in mesh_axes_of(_rule_of(part, "mlp")) if mesh_shape[t] > 1 and t not in batch_axes
    )
    model_bytes = 0
    if model_axes:
        cfg = trainer.model.network_config
        b = trainer.batch_size // part.data_parallel_size
        act = np.dtype(cfg.dtype).itemsize * cfg.emb_dim * b
        if hasattr(cfg, "num_encoder_layers"):
            blocks = cfg.num_encoder_layers * 2 * trainer.lengths["inputs"]
            blocks += cfg.num_decoder_layers * 3 * trainer.lengths["targets"]
        else:
            blocks = cfg.num_layers * 2 * trainer.lengths["targets"]
        model_bytes = 2 * blocks * act  # forward and backward
    return AnalyticCommunication(batch_axes, data_bytes, model_bytes)


# ---------------------------------------------------------------------------------------------
# The step report
# ---------------------------------------------------------------------------------------------


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
        }

    def format(self) -> str:
        """Plain-text tables: memory, collectives, analytic vs compiled communication."""
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
        lines.append(
            f"  predicted (analytic): {format_bytes(p.total)} = state {format_bytes(p.state)} + "
            f"batch {format_bytes(p.batch)} + gradients {format_bytes(p.gradients)} + "
            f"update {format_bytes(p.update)} + activations {format_bytes(p.activations)}"
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
            "communication per device per step   compiled (collective bytes)   analytic (Mesh-TF)",
            f"  over the batch axes ({data}):".ljust(37)
            + f"{format_bytes(self.bytes_over(a.data_axes)) if self.memory else '-':<30}"
            + f"{format_bytes(a.data_axes_bytes)}   (≈ parameters)",
            f"  over {MODEL}:".ljust(37)
            + f"{format_bytes(self.bytes_over((MODEL,))) if self.memory else '-':<30}"
            + f"{format_bytes(a.model_axis_bytes)}   (≈ activations of split layers)",
        ]
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


def compile_train_step(trainer: Trainer) -> CompiledFunction:
    """Lowers and compiles `trainer.train_step` ahead of time on abstract state and batch."""
    return trainer.partitioner.compile(
        trainer.train_step, trainer.abstract_state(), trainer.batch_abstract
    )


def step_report(
    trainer: Trainer,
    *,
    device: DeviceSpec | None = None,
    compiled: CompiledFunction | None = None,
    compile: bool = True,
    report: ShardingReport | None = None,
) -> StepReport:
    """Compiles (unless `compile=False`) and measures the train step of `trainer`.

    Args:
      trainer: the trainer whose `train_step` is measured.
      device: memory, peak FLOP/s and link bandwidth per device (default: the mesh's device).
      compiled: an already compiled train step (skips compilation).
      compile: False gives only the analytic figures (for models too large to compile here).
      report: the parameters' sharding report, if already built.
    """
    part = trainer.partitioner
    device = device or device_spec(part.mesh.devices.flat[0])
    report = report or sharding_report(part, trainer.abstract_state().params, trainer.params_axes)
    mem, rows, flops, comp_s, comm_s = None, (), None, None, None
    if compiled is None and compile:
        compiled = compile_train_step(trainer)
    if compiled is not None:
        mem = memory_report(compiled, device.memory_bytes)
        collectives = parse_collectives(compiled.as_text(), part.mesh)
        rows = tuple(collective_rows(collectives))
        flops = compiled.cost_analysis().get("flops")
        if flops is not None and device.peak_flops:
            comp_s = flops / device.peak_flops
        if device.link_bytes_per_s:
            comm_s = communication_seconds(collectives, device.link_bytes_per_s)
    return StepReport(
        mesh_shape=dict(part.mesh.shape),
        device=device,
        memory=mem,
        predicted=predict_memory(trainer),
        collectives=rows,
        analytic=analytic_communication(trainer, report),
        flops=flops,
        compute_seconds=comp_s,
        communication_seconds=comm_s,
    )


def mesh_over(shape: Mapping[str, int], devices: Sequence[Any]) -> Mesh:
    """A mesh of `shape` (axis name -> size) over `devices`, topology-aware on TPU.

    `create_mesh` maps each mesh axis onto whole physical axes; when a shape needs a physical
    axis split (model=2 on a 4x4 slice) this falls back to letting JAX split it.
    """
    try:
        return create_mesh(ici_mesh_shape=tuple(shape.values()), devices=list(devices))
    except NotImplementedError:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(
            tuple(shape.values()), list(devices), allow_split_physical_axes=True
        )
        return Mesh(arr, tuple(shape))


def partitioner_on(partitioner: Partitioner, devices: Sequence[Any]) -> Partitioner:
    """The same rules (and model-parallel size) over other devices, e.g. a TPU topology's.

    Every mesh axis keeps its size except `data`, which takes the remaining devices.
    """
    shape = dict(partitioner.mesh.shape)
    others = math.prod(v for k, v in shape.items() if k != DATA)
    if len(devices) % others:
        raise ValueError(
            f"the mesh {shape} cannot be laid over {len(devices)} devices: "
            f"{others} (all axes but data) does not divide it"
        )
    shape[DATA] = len(devices) // others
    mesh = mesh_over(shape, devices)
    return Partitioner(
        mesh,
        logical_axis_rules=partitioner.rules,
        strict=partitioner.strict,
        shard_if_divisible=partitioner.shard_if_divisible,
    )


def inspect(
    *,
    model: BaseModel,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    partitioner: Partitioner | None = None,
    num_microbatches: int = 1,
    topology: str | None = None,
    device_memory_gib: float | None = None,
    link_bandwidth_gbps: float | None = None,
    compile: bool = True,
    output_json: str | None = None,
    stream: TextIO | None = None,
) -> tuple[ShardingReport, StepReport]:
    """Prints the sharding report, then the train step's memory and communication per device.

    Args:
      model, task_feature_lengths, batch_size, num_microbatches: what is trained.
      partitioner: mesh + rules (default: `Partitioner()` on every device).
      topology: a TPU topology name (e.g. 'v5e:16x16'): the mesh is laid over its compile-only
        devices, keeping every mesh axis but `data`, and the real TPU compiler runs.
      device_memory_gib: per-device memory to compare against (default: the device's own, or
        the topology chip's HBM).
      link_bandwidth_gbps: per-device link bandwidth in GB/s for the time estimate.
      compile: False reports only the analytic figures (no XLA compilation).
      output_json: also write every figure there.
      stream: where to print (default stdout).

    Returns:
      The sharding report and the step report.
    """
    stream = stream or sys.stdout
    partitioner = partitioner or Partitioner()
    device = None
    if topology:
        topo = get_topology(topology)
        partitioner = partitioner_on(partitioner, topo.devices)
        device = topo.spec
    device = device or device_spec(partitioner.mesh.devices.flat[0])
    if device_memory_gib is not None:
        device = dataclasses.replace(device, memory_bytes=int(device_memory_gib * GiB))
    if link_bandwidth_gbps is not None:
        device = dataclasses.replace(device, link_bytes_per_s=link_bandwidth_gbps * 1e9)
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
    rules = ", ".join(f"{n}->{a}" for n, a in partitioner.rules)
    stream.write(f"rules: {rules}\n\n{report.format()}\n")
    stream.write(
        f"optimizer state ({type(model.optimizer).__name__}): {format_bytes(opt.bytes_total)} in "
        f"all, {format_bytes(opt.bytes_per_device)} per device\n"
        f"train state per device: {format_bytes(report.bytes_per_device + opt.bytes_per_device)} "
        f"on {partitioner.mesh.devices.size} devices\n\n"
    )
    step = step_report(trainer, device=device, compile=compile, report=report)
    stream.write(step.format() + "\n")
    if output_json:
        with open(output_json, "w") as f:
            json.dump({**report.to_json(), "train_step": step.to_json()}, f, indent=1)
    return report, step
