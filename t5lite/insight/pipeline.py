"""A pipelined train step's schedule figures: the bubble, the stage-to-stage permutes and the
activations in flight, analytic beside what the compiled HLO implies (model/pipeline.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from t5lite.insight import activation_memory, memory
from t5lite.insight.hlo import collective_ops
from t5lite.insight.sharding import format_bytes
from t5lite.model.config import T5Config
from t5lite.partitioning import resolve_logical_axes
from t5lite.partitioning.rules import mesh_axes_of
from t5lite.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Stack:
    """One pipelined layer stack: its name, the positions of its activations."""

    name: str
    length: int


@dataclasses.dataclass(frozen=True)
class PipelineFigures:
    """GPipe's figures for one train step (per device; both passes)."""

    stage_axes: tuple[str, ...]
    stages: int  # p
    microbatches: int  # m
    schedule: str
    stacks: tuple[Stack, ...]
    permute_bytes: tuple[int, ...]  # one stage-to-stage transfer of each stack, per device
    in_flight_bytes: int  # stack inputs a stage keeps for its backward pass, all stacks
    compiled_ticks: int | None = None  # the schedule loop's trip count in the compiled step
    compiled_permutes: int | None = None  # collective-permutes in the schedule loops
    compiled_permute_bytes: int | None = None  # their bytes, per device

    @property
    def ticks(self) -> int:
        """Clock ticks of one pass: `m + p - 1`."""
        return self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Each stage's idle share: `(p - 1) / (m + p - 1)`."""
        return (self.stages - 1) / self.ticks

    @property
    def compiled_bubble(self) -> float | None:
        """The idle share the compiled loop implies: its ticks less the `m` that do work."""
        t = self.compiled_ticks
        return None if not t else (t - self.microbatches) / t

    @property
    def permutes(self) -> int:
        """Stage-to-stage collective-permutes per step: one per tick, forward and backward."""
        return 2 * self.ticks * len(self.stacks)

    @property
    def permute_bytes_total(self) -> int:
        return 2 * self.ticks * sum(self.permute_bytes)

    def format(self) -> str:
        axes = "x".join(self.stage_axes)
        lines = [
            f"pipeline ({self.schedule}): {self.stages} stages over {axes}, {self.microbatches} "
            f"microbatches, {self.ticks} ticks a pass",
            f"  bubble: analytic (p-1)/(m+p-1) = {self.bubble:.1%}"
            + (
                f"; compiled schedule ({self.compiled_ticks} ticks) {self.compiled_bubble:.1%}"
                if self.compiled_ticks
                else ""
            ),
            f"  stage-to-stage permutes per step: analytic {self.permutes} x "
            f"{'/'.join(format_bytes(b) for b in self.permute_bytes)} = "
            f"{format_bytes(self.permute_bytes_total)}"
            + (
                f"; compiled {self.compiled_permutes} = {format_bytes(self.compiled_permute_bytes)}"
                if self.compiled_permutes is not None
                else ""
            ),
            f"  activations in flight per device: {self.ticks} stack inputs per stack "
            f"({self.microbatches} microbatches + the bubble) = "
            f"{format_bytes(self.in_flight_bytes)} before each layer's saved residuals",
        ]
        return "\n".join(lines)


def _stacks(trainer: Trainer) -> tuple[Stack, ...]:
    cfg = trainer.model.network_config
    lengths = trainer.lengths
    if isinstance(cfg, T5Config):
        return (Stack("encoder", lengths["inputs"]), Stack("decoder", lengths["targets"]))
    return (Stack("decoder", sum(lengths.values())),)


def pipeline_figures(trainer: Trainer, hlo_text: str | None = None) -> PipelineFigures | None:
    """The schedule's figures for `trainer` (None when its rules do not split `layers` over
    devices), with the compiled step's loop and permutes when `hlo_text` is given."""
    part = trainer.partitioner
    cfg = getattr(trainer.model, "network_config", None)
    if cfg is None or not getattr(cfg, "scan_layers", False):
        return None
    spec, _ = resolve_logical_axes(("layers",), part.rules, mesh=part.mesh)
    axes = mesh_axes_of(spec[0]) if len(spec) else ()
    stages = math.prod(part.mesh.shape[a] for a in axes)
    if stages <= 1:
        return None
    m = cfg.pipeline_microbatches or stages
    rows = trainer.batch_size // m // part.data_parallel_size
    itemsize = np.dtype(cfg.policy.compute).itemsize
    stacks = _stacks(trainer)
    sizes = tuple(rows * s.length * cfg.emb_dim * itemsize for s in stacks)
    ticks = m + stages - 1
    figures = PipelineFigures(
        tuple(axes), stages, m, cfg.pipeline_schedule, stacks, sizes, ticks * sum(sizes)
    )
    if hlo_text is None:
        return figures
    loops = [
        op
        for op in collective_ops(hlo_text, part.mesh)
        if op.collective.kind == "collective-permute"
        and op.collective.axes == tuple(axes)
        and op.runs > 1
    ]
    return dataclasses.replace(
        figures,
        compiled_ticks=max((op.runs for op in loops), default=0),
        compiled_permutes=sum(op.runs for op in loops),
        compiled_permute_bytes=sum(op.runs * op.collective.bytes for op in loops),
    )


def pipeline_collectives(trainer: Trainer) -> tuple[list[tuple], list[tuple]]:
    """GPipe's collectives over the stage axes (model/pipeline.py), per stack of `T = m + p - 1`
    ticks and one microbatch's activations `a`: the schedule's permutes (one a tick each way),
    the stack input's gradient summed over stages each backward tick (the input is whole over
    `stage`), and the stack output handed from the last stage to all (the last stage's `T`
    outputs permuted and its `m` microbatches all-reduced forward, their gradient permuted
    back). As `ExpectedCollective` and `CompilerChoice` fields (communication.py)."""
    f = pipeline_figures(trainer)
    if f is None:
        return [], []
    axes, p, m, t = f.stage_axes, f.stages, f.microbatches, f.ticks
    n = len(f.stacks)
    a = sum(f.permute_bytes)
    expected = [
        (
            "collective-permute",
            axes,
            2 * t * n,
            2 * t * a,
            2,
            "GPipe: each tick's microbatch activations to the next stage, forward and backward",
        ),
        (
            "all-reduce",
            axes,
            t * n,
            t * a,
            p,
            "pipeline: the stack input's gradient summed over stages each backward tick",
        ),
        (
            "collective-permute",
            axes,
            2 * n,
            (t + m) * a,
            2,
            "pipeline: the last stage's outputs to the first, their gradient back",
        ),
        (
            "all-reduce",
            axes,
            n,
            m * a,
            p,
            "pipeline: the stack output (m microbatches) from the last stage to all",
        ),
    ]
    # The embedding lookup runs outside the stages; the partitioner may split its rows over the
    # stage devices as well and sum the lookup over them.
    cfg = trainer.model.network_config
    rows = trainer.batch_size // trainer.partitioner.data_parallel_size
    size = rows * sum(s.length for s in f.stacks[:1]) * cfg.emb_dim * 4
    lookup = (
        "the embedding lookup also split over the stage devices, then all-reduced",
        axes,
        2 * (p - 1) / p * size,
        (("all-reduce", 1, size),),
    )
    return expected, [lookup]


@dataclasses.dataclass(frozen=True)
class PipelineMemory:
    """A pipelined train step's peak bytes per device, by term (GPipe: every tick's residuals
    are live when the backward pass starts)."""

    state: int  # parameters and optimizer state (this stage's layers)
    batch: int
    gradients: int  # unreduced, this stage's layers
    in_flight: int  # each of this stage's layers' saved residuals, for each of the T ticks
    stack_buffers: int  # the stacks' microbatched inputs (m), tick outputs (T), merged output (m)
    working: int  # the larger of one layer's backward on one microbatch and the loss's buffers

    @property
    def total(self) -> int:
        return (
            self.state
            + self.batch
            + self.gradients
            + self.in_flight
            + self.stack_buffers
            + self.working
        )

    def format(self, compiled: int | None = None) -> str:
        line = (
            f"  memory per device: analytic {format_bytes(self.total)} = state "
            f"{format_bytes(self.state)} + batch {format_bytes(self.batch)} + gradients "
            f"{format_bytes(self.gradients)} + residuals in flight {format_bytes(self.in_flight)}"
            f" + stack buffers {format_bytes(self.stack_buffers)} + working set "
            f"{format_bytes(self.working)}"
        )
        if compiled:
            line += f"; compiled {format_bytes(compiled)} ({compiled / self.total:.2f}x)"
        return line


def pipeline_memory(trainer: Trainer) -> PipelineMemory | None:
    """GPipe's peak memory per device for `trainer` (None without stages): the backward pass
    starts with all `T = m + p - 1` ticks' residuals of the stage's `L/p` layers live, each
    sized for one microbatch by insight/memory.py's per-layer model."""
    f = pipeline_figures(trainer)
    if f is None:
        return None
    part, cfg = trainer.partitioner, trainer.model.network_config
    b = trainer.batch_size // f.microbatches
    if isinstance(cfg, T5Config):
        li, lt = trainer.lengths["inputs"], trainer.lengths["targets"]
        stacks = [(cfg.num_encoder_layers, li, [li]), (cfg.num_decoder_layers, lt, [lt, li])]
    else:
        lt = sum(trainer.lengths.values())
        stacks = [(cfg.num_layers, lt, [lt])]
    in_flight, works, stack_buffers = 0, [], 0
    act = memory.activation_itemsize(cfg, memory.platform_of(trainer))
    for n, q, kv in stacks:
        a = memory.layer_bytes(part, cfg, b, q, kv, act)
        saved = activation_memory.layer_saved(a, cfg.remat_policy)
        in_flight += n // f.stages * f.ticks * sum(saved.values())
        work = activation_memory.layer_saved(a, "none", activation_memory.SCORES_WORKING)
        # With one layer a stage the backward of a tick works in the buffers of the residuals
        # that tick saved and allocates only what it recomputes beside them (under remat
        # 'none' almost nothing; under 'full' the whole layer). With more layers a stage, a
        # layer's backward runs while the other layers' residuals of the tick are held, so
        # its whole working set is live on top of them.
        kept = sum(saved.values()) if n // f.stages == 1 else 0
        works.append(sum(work.values()) - kept)
        stack_buffers += (2 * f.microbatches + f.ticks) * a["x"]
    logits = memory.bytes_per_device(
        part, ("batch", "length", "vocab"), (trainer.batch_size, lt, cfg.vocab_size), 4
    )
    working = max(works)
    predicted = memory.predict_memory(trainer)
    return PipelineMemory(
        predicted.state,
        predicted.batch,
        predicted.gradients,
        in_flight,
        stack_buffers,
        max(working, activation_memory.LOSS_BUFFERS * logits),
    )
