"""A pipelined train step's schedule figures: the bubble, the stage-to-stage permutes and the
activations in flight, analytic beside what the compiled HLO implies (model/pipeline.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from t5lite.insight import activation_memory, memory, parameter_bytes, sharded_bytes
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
    # GPipe's backward adds each tick's stage layer gradients to the step's (per device, bytes)
    tick_gradient_bytes: int | None = None

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
    def accumulation_bytes(self) -> int | None:
        """Memory traffic of GPipe's gradient accumulation: in each of the `T` backward ticks
        the stage's layer gradients are read, added to the step's sum and written back."""
        g = self.tick_gradient_bytes
        return None if g is None else 3 * self.ticks * g

    @property
    def permutes(self) -> int:
        """Stage-to-stage collective-permutes per step: one per tick, forward and backward
        (GPipe); `schedule_permutes` for the others."""
        return schedule_permutes(self.schedule, self.stages, self.microbatches) * len(self.stacks)

    @property
    def permute_bytes_total(self) -> int:
        return schedule_permutes(self.schedule, self.stages, self.microbatches) * sum(
            self.permute_bytes
        )

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
            (
                f"  activations in flight per device: {self.ticks} stack inputs per stack "
                f"({self.microbatches} microbatches + the bubble) = "
                f"{format_bytes(self.in_flight_bytes)} before each layer's saved residuals"
                if self.schedule == "gpipe"
                else _one_f_one_b_in_flight_line(self)
            ),
        ]
        if self.tick_gradient_bytes is not None:
            lines.insert(
                2,
                "  beyond the schedule's (m+p-1)/m work: each backward tick adds the stage's "
                f"layer gradients to the step's, 3 x {self.ticks} x "
                f"{format_bytes(self.tick_gradient_bytes)} = "
                f"{format_bytes(self.accumulation_bytes)} moved",
            )
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
    held = stages if cfg.pipeline_schedule == "1f1b" else ticks  # 1F1B: its p input slots
    figures = PipelineFigures(
        tuple(axes), stages, m, cfg.pipeline_schedule, stacks, sizes, held * sum(sizes)
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
    if not loops:  # no schedule loop: unrolled (XLA:TPU does so around DCN transfers)
        return figures
    # At least fp32, as XLA:CPU differentiates bf16 masters (insight/memory.py).
    gpipe = figures.schedule == "gpipe"
    grads = parameter_bytes.layer_gradient_bytes(trainer, 4)[0] if gpipe else None
    return dataclasses.replace(
        figures,
        tick_gradient_bytes=grads,
        compiled_ticks=max((op.runs for op in loops), default=0),
        compiled_permutes=sum(op.runs for op in loops),
        compiled_permute_bytes=sum(op.runs * op.collective.bytes for op in loops),
    )


def pipeline_collectives(trainer: Trainer) -> tuple[list[tuple], list[tuple]]:
    """GPipe's collectives over the stage axes (model/pipeline.py), per stack of `T = m + p - 1`
    ticks and one microbatch's activations `a`: the schedule's permutes (one a tick each way),
    the stack input's gradient summed over stages once after the backward ticks (the input is
    whole over `stage`; `m a`, T5's decoder also the encoder output's), and the stack output
    handed from the last stage to all (the last stage's `T` outputs permuted and its `m`
    microbatches all-reduced forward, their gradient permuted back). As `ExpectedCollective`
    and `CompilerChoice` fields (communication.py)."""
    f = pipeline_figures(trainer)
    if f is None:
        return [], []
    if f.schedule == "1f1b":
        return _one_f_one_b_collectives(trainer, f)
    axes, p, m, t = f.stage_axes, f.stages, f.microbatches, f.ticks
    n = len(f.stacks)
    a = sum(f.permute_bytes)
    # T5's decoder reads the encoder output: its gradient is summed with the decoder's input's.
    cross = m * f.permute_bytes[0] if n > 1 else 0
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
            n + (n > 1),
            m * a + cross,
            p,
            "pipeline: the stack input's gradient summed over stages once, after the backward "
            "ticks",
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
    return expected, [_lookup_choice(trainer, f)]


def _lookup_choice(trainer: Trainer, f: PipelineFigures) -> tuple:
    """The embedding lookup runs outside the stages; the partitioner may split its rows over the
    stage devices as well and sum the lookup over them."""
    axes, p = f.stage_axes, f.stages
    cfg = trainer.model.network_config
    rows = trainer.batch_size // trainer.partitioner.data_parallel_size
    size = rows * sum(s.length for s in f.stacks[:1]) * cfg.emb_dim * 4
    lookup = (
        "the embedding lookup also split over the stage devices, then all-reduced",
        axes,
        2 * (p - 1) / p * size,
        (("all-reduce", 1, size),),
    )
    return lookup


@dataclasses.dataclass(frozen=True)
class PipelineMemory:
    """A pipelined train step's peak bytes per device, by term (GPipe: every tick's residuals
    are live when the backward pass starts)."""

    state: int  # parameters and optimizer state (this stage's layers)
    batch: int
    gradients: int  # the tick's and the schedule loop's accumulator of this stage's layers'
    in_flight: int  # each of this stage's layers' saved residuals, for each of the T ticks
    stack_buffers: int  # the stacks' microbatched inputs (m), tick outputs (T), merged output (m)
    working: int  # the larger of one layer's backward on one microbatch and the loss's buffers
    position_bias: int = 0  # T5's relative-position one-hots (`_position_one_hots`)
    weight_split: int = 0  # GPipe's written-out stage: its layers' weights, split per layer

    @property
    def total(self) -> int:
        return (
            self.state
            + self.batch
            + self.gradients
            + self.in_flight
            + self.stack_buffers
            + self.working
            + self.position_bias
            + self.weight_split
        )

    def format(self, compiled: int | None = None) -> str:
        line = (
            f"  memory per device: analytic {format_bytes(self.total)} = state "
            f"{format_bytes(self.state)} + batch {format_bytes(self.batch)} + gradients "
            f"{format_bytes(self.gradients)} + residuals in flight {format_bytes(self.in_flight)}"
            f" + stack buffers {format_bytes(self.stack_buffers)} + working set "
            f"{format_bytes(self.working)}"
        )
        if self.position_bias:
            line += f" + position one-hots {format_bytes(self.position_bias)}"
        if self.weight_split:
            line += f" + stage weights split per layer {format_bytes(self.weight_split)}"
        if compiled:
            line += f"; compiled {format_bytes(compiled)} ({compiled / self.total:.2f}x)"
        return line


def _stage_layers(trainer: Trainer, f: PipelineFigures) -> tuple[list[tuple], int]:
    """Each stack's (layers, key lengths, one layer's bytes at one microbatch by
    memory.layer_bytes), and the loss's [B, L, V] fp32 logits per device."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    b = trainer.batch_size // f.microbatches
    if isinstance(cfg, T5Config):
        li, lt = trainer.lengths["inputs"], trainer.lengths["targets"]
        stacks = [(cfg.num_encoder_layers, li, [li]), (cfg.num_decoder_layers, lt, [lt, li])]
    else:
        lt = sum(trainer.lengths.values())
        stacks = [(cfg.num_layers, lt, [lt])]
    act = memory.activation_itemsize(cfg, memory.platform_of(trainer))
    layers = [(n, kv, memory.layer_bytes(part, cfg, b, q, kv, act)) for n, q, kv in stacks]
    logits = sharded_bytes.bytes_per_device(
        part, ("batch", "length", "vocab"), (trainer.batch_size, lt, cfg.vocab_size), 4
    )
    return layers, logits


def pipeline_memory(trainer: Trainer) -> PipelineMemory | None:
    """GPipe's peak memory per device for `trainer` (None without stages): the backward pass
    starts with all `T = m + p - 1` ticks' residuals of the stage's `L/p` layers live, each
    sized for one microbatch by insight/memory.py's per-layer model."""
    f = pipeline_figures(trainer)
    if f is None:
        return None
    if f.schedule == "1f1b":
        return one_f_one_b_memory(trainer, f)
    cfg = trainer.model.network_config
    layers, logits = _stage_layers(trainer, f)
    per = layers[0][0] // f.stages
    # As model/pipeline.py runs the stage: its layers written out in each tick unless a layer
    # saves only its input (remat 'full') or the rules split its weights over the batch's
    # axes (FSDP: a layer's gradient then has a part in hand, whole over them).
    layer_grads = parameter_bytes.layer_gradient_bytes(trainer)
    written_out = cfg.remat_policy != "full" and not layer_grads[1]
    remat_scan = per > 1 and not written_out and cfg.remat_policy != "none"
    in_flight, works, stack_buffers, encoder_x = 0, [], 0, 0
    for n, kv, a in layers:
        saved = activation_memory.layer_saved(a, cfg.remat_policy)
        in_flight += n // f.stages * f.ticks * sum(saved.values())
        work = activation_memory.layer_saved(a, "none", activation_memory.SCORES_WORKING)
        # With one layer a stage the backward of a tick works in the buffers of the residuals
        # that tick saved and allocates only what it recomputes beside them (under remat
        # 'none' almost nothing; under 'full' the whole layer). With more layers a stage, a
        # layer's backward runs while the other layers' residuals of the tick are held, so
        # its whole working set is live on top of them; in a layer scan under remat, the
        # recomputed layer's backward (`_recomputed_backward`).
        kept = sum(saved.values()) if n // f.stages == 1 else 0
        works.append(_recomputed_backward(a) if remat_scan else sum(work.values()) - kept)
        stack_buffers += (2 * f.microbatches + f.ticks) * a["x"]
        # T5's decoder reads the encoder output at every tick: its loop stashes the tick's
        # encoder microbatch for the backward pass (T of them) and its backward accumulates
        # the encoder output's gradient (m microbatches), both seen in the loops' carries.
        stack_buffers += (f.ticks + f.microbatches) * encoder_x if len(kv) > 1 else 0
        encoder_x = a["x"]
    working = max(works)
    predicted = memory.predict_memory(trainer)
    # The tick loop's backward carries the stage's layer gradients summed over the ticks beside
    # the tick's own, both in the parameters' sharding (the layer scan reduce-scatters each
    # layer's, FSDP, as it goes), in place of predict_memory's one stack of them (at least
    # fp32: XLA:CPU differentiates bf16 masters in fp32).
    layer_gradients, _ = parameter_bytes.layer_gradient_bytes(trainer, 4)
    return PipelineMemory(
        predicted.state,
        predicted.batch,
        predicted.gradients - predicted.layer_gradients + 2 * layer_gradients,
        in_flight,
        stack_buffers,
        max(working, activation_memory.LOSS_BUFFERS * logits),
        _position_one_hots(trainer),
        # Written out with several layers a stage, each stacked weight is split once into its
        # layers (`run`): a copy of the stage's weights, live through the step (XLA:CPU's
        # buffer assignment: one weight-shaped piece a layer and kernel). One layer a stage
        # splits nothing.
        layer_grads[0] if written_out and per > 1 else 0,
    )


def _recomputed_backward(a: dict[str, int]) -> int:
    """One layer's backward in a layer scan under remat, on one microbatch: its values
    recomputed from its saved input (all it saves without remat) and its cotangents and
    gradient temporaries beside them, half as many again (XLA:CPU's buffer assignment of the
    stage's scan body, GPipe under FSDP and 1F1B alike; docs/pipeline.md)."""
    whole = sum(activation_memory.layer_saved(a, "none").values())
    return whole + whole // 2


# 1F1B (model/schedules.py): its figures and memory, apart from GPipe's.


def schedule_permutes(schedule: str, stages: int, microbatches: int) -> int:
    """Stage-to-stage collective-permutes of one stack per step. GPipe: one a tick each way,
    `2T` (`T = m + p - 1`). 1F1B: the forward pass's `T`, then one a half-tick in the schedule,
    whose odd half-ticks move nothing when `p = 2`: `T (2 + [p > 2])`."""
    t = microbatches + stages - 1
    if schedule == "1f1b":
        return t * (2 + (stages > 2))
    return 2 * t


def _one_f_one_b_in_flight_line(f: PipelineFigures) -> str:
    return (
        f"  activations in flight per device: {f.stages} stage inputs per stack (1F1B's slots; "
        f"GPipe: {f.ticks} ticks' residuals) = {format_bytes(f.in_flight_bytes)}, and one "
        f"microbatch's residuals while a backward recomputes them"
    )


def _one_f_one_b_collectives(trainer: Trainer, f: PipelineFigures) -> tuple[list, list]:
    """1F1B's collectives over the stage axes, per stack of `T = m + p - 1` ticks and one
    microbatch's activations `a`: the schedule's permutes (`schedule_permutes`), the stack
    input's gradient summed over the stages once after the schedule (`m a`; T5's decoder also
    the encoder output's), and the output's hand-off (the last stage's `T` outputs permuted to
    the first, its `m` microbatches all-reduced to all; the output's gradient reaches every
    stage whole, so nothing goes back)."""
    axes, p, m, t = f.stage_axes, f.stages, f.microbatches, f.ticks
    n, a = len(f.stacks), sum(f.permute_bytes)
    k = schedule_permutes("1f1b", p, m)
    # T5's decoder reads the encoder output: its gradient comes out of the decoder's schedule.
    cross = m * f.permute_bytes[0] if n > 1 else 0
    expected = [
        (
            "collective-permute",
            axes,
            k * n,
            k * a,
            2,
            "1F1B: the forward pass's ticks, then one permute a half-tick of the schedule",
        ),
        (
            "all-reduce",
            axes,
            n + (n > 1),
            m * a + cross,
            p,
            "1F1B: the stack input's gradient summed over stages once, after the schedule",
        ),
        (
            "collective-permute",
            axes,
            n,
            t * a,
            2,
            "pipeline: the last stage's outputs to the first",
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
    return expected, [_lookup_choice(trainer, f)]


def one_f_one_b_memory(trainer: Trainer, f: PipelineFigures) -> PipelineMemory:
    """1F1B's peak memory per device: the backward pass runs the schedule with `p` slots of
    stage inputs, the stack's microbatched input, output gradient and input gradient, and one
    microbatch's residuals of the stage's layers (recomputed by the B being run); the forward
    pass kept nothing but the stack input."""
    cfg = trainer.model.network_config
    layers, logits = _stage_layers(trainer, f)
    recompute, slots, stack_buffers, encoder_x = [], 0, 0, 0
    for (n, kv, a), stack in zip(layers, f.stacks):
        per = n // f.stages
        saved = sum(activation_memory.layer_saved(a, cfg.remat_policy).values())
        # A B differentiates its stage's layers one at a time (their scan's backward): the
        # others keep what the policy saves. With one layer a stage the backward works in
        # the buffers of that layer's residuals (all it saves without remat: remat changes
        # nothing). With several, the one in hand holds those residuals and its working set
        # on top of them without remat; under remat, its recomputed values and cotangents
        # (`_recomputed_backward`); and the B's layer scan returns the stage's layer
        # gradients of this stack stacked, beside the schedule's accumulator they are then
        # added to.
        whole = sum(activation_memory.layer_saved(a, "none").values())
        working = activation_memory.layer_saved(a, "none", activation_memory.SCORES_WORKING)
        in_hand = whole
        if per > 1 and cfg.remat_policy == "none":
            in_hand = whole + sum(working.values())
        elif per > 1:
            in_hand = _recomputed_backward(a)
        stacked = parameter_bytes.layer_gradient_bytes(trainer, 4, stack.name)[0] if per > 1 else 0
        # A relative position bias reaches the stack whole (not cut into microbatches), so
        # its cotangent is summed over the B's layers and microbatches: the schedule's
        # accumulator, the B's result, its layer scan's carry and the layer's own (four
        # [1, H, L, L] fp32 buffers in XLA:CPU's buffer assignment of T5's decoder B).
        bias = 4 * _bias_bytes(trainer, stack.length)
        recompute.append((per - 1) * saved + in_hand + stacked + bias)
        slots += f.stages * a["x"]
        # its input, output's gradient and input's gradient, m microbatches each
        stack_buffers += 3 * f.microbatches * a["x"]
        # T5's decoder: the encoder output's m microbatches and their gradient (as GPipe's)
        stack_buffers += 2 * f.microbatches * encoder_x if len(kv) > 1 else 0
        encoder_x = a["x"]
    predicted = memory.predict_memory(trainer)
    # A B reduces its layers' gradients inside the layer scan (FSDP: reduce-scatters them),
    # so the stage's layer gradients are held in the parameters' sharding (the schedule
    # loop's accumulator), never unreduced.
    gradients = predicted.gradients - predicted.layer_gradients
    return PipelineMemory(
        predicted.state,
        predicted.batch,
        gradients + parameter_bytes.layer_gradient_bytes(trainer, 4)[0],
        slots + max(recompute),
        stack_buffers,
        activation_memory.LOSS_BUFFERS * logits,
        _position_one_hots(trainer),
    )


def _bias_bytes(trainer: Trainer, length: int) -> int:
    """Bytes per device of a stack's [1, H, L, L] fp32 relative position bias (0: none)."""
    if not _position_one_hots(trainer):
        return 0
    heads = trainer.model.network_config.num_heads
    part = trainer.partitioner
    return sharded_bytes.bytes_per_device(
        part, (None, "heads", None, None), (1, heads, length, length), 4
    )


def _position_one_hots(trainer: Trainer) -> int:
    """Relative position biases (T5's, a decoder-only model's with `position_embedding =
    'relative'`): each stack's [buckets, L, S] fp32 one-hot, whole on every device (no batch),
    kept for the bias table's gradient (model/positions.py)."""
    cfg = trainer.model.network_config
    if isinstance(cfg, T5Config):
        li, lt = trainer.lengths["inputs"], trainer.lengths["targets"]
        return 4 * cfg.relpos_num_buckets * (li * li + lt * lt)
    if getattr(cfg, "position_embedding", "rope") == "relative":
        return 4 * cfg.relpos_num_buckets * sum(trainer.lengths.values()) ** 2
    return 0
