"""What XLA:TPU needs in HBM for a pipelined train step (model/pipeline.py, model/schedules.py),
and the one place pipelined memory dispatches by platform (`stage_memory`).

Read from the TPU compiler's memory report and buffer assignment of pipelined steps compiled
ahead of time (docs/performance.md has the programs and how close the model comes):
- The state and batch take their tiles: XLA:TPU pads an array's two minor dimensions to its
  (8, 128) tile (16 sublanes in bf16; fewer for a dimension under 8) in whichever order pads
  least, and no buffer takes under 512 bytes; the donated state's aliased bytes match
  `tile_bytes`.
- The activations the schedule holds (every tick's residuals under GPipe, 1F1B's slots, the
  stack buffers: pipeline.pipeline_memory) sit in VMEM while they fit, only what overflows it
  in HBM: 1F1B's within `vmem_budget`, as the unpipelined step's (tpu_memory); GPipe's within
  all that memory-space assignment allocates (`_values_budget`: every GPipe program at d_model
  256 to 1024 fills 112 MiB of v5e's VMEM with its tick stacks, gradient sums and the stage's
  weights split per layer, and keeps in HBM only what is left).
- The temporaries are scalar slots: each of the heap's small buffers (the tick loops' carried
  flags and indices, each collective's) takes its own 16 KiB-aligned slot, and
  `memory_analysis` reserves about as much again beyond the heap (tpu_memory). tpu_memory's
  per-array slots (`ARRAY_SLOTS`, `LOOP_SLOTS`) hold as in the unpipelined step, and the
  schedule adds its own, with its kernels (`generated_code`), by what the compiled loops
  contain: the stage's blocks' all-reduces under tensor parallelism, a stack's weight gathers
  under FSDP, 1F1B's separately compiled forward and backward of each of the stage's layers,
  and, with bf16 weights under FSDP, the collective matmuls XLA:TPU makes of the attention
  projections' gathers (`_collective_matmuls`). The slot and code bytes of each term are
  fitted (`_SCHEDULE_CODE`, `_SCHEDULE_SLOTS`), the collective matmuls' read from the
  compiled programs' differences against their fp32 twins.
- Those terms are the test size's, where every weight array is a tile or two. Past that
  (`_stage_weights`' growth), each term's kernels grow with the log of the weights' tiles
  (`_GROWN_CODE`), 1F1B's loop-carried values stay in HBM (`_CARRIED`), under FSDP part of the
  gathered weights too (`_GATHERED_HELD`), and the gathers stay all-gathers: no collective
  matmuls (d_model 32 to 512 ahead of time).
- Where the stages cross slices (a multi-slice topology), each collective between them is a
  DCN send/recv pair with its own slots and code (`_dcn_transfers`: the stage hand-offs
  counted, the all-reduces a fitted mean), and FSDP gathers over a whole slice become
  collective matmuls: the attention projections' fp32 ones too, the MLP's bf16 ones too.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import numpy as np

from t5lite.insight import hardware, memory, pipeline, tpu_memory
from t5lite.insight.hlo import axes_along, device_slices
from t5lite.insight.parameter_bytes import param_specs, sharded_batch
from t5lite.insight.sharded_bytes import bytes_per_device
from t5lite.insight.sharding import format_bytes
from t5lite.model.config import T5Config
from t5lite.partitioning import STAGE, mesh_axes_of
from t5lite.trainer import Trainer

# Bytes (KiB) by what the compiled step holds (fitted, docs/performance.md): (fixed; a block of
# the stage's layers under tensor parallelism; a stack under FSDP; a layer of the stage's under
# 1F1B; a collective matmul (a ring of permutes and its partial einsums: the heap slots of its
# permutes' buffers, doubled by the reserve); a stack under FSDP and 1F1B, which gathers the
# stage's weights in each F and again in each B). A block: an attention or an MLP (tpu_memory's
# unit). The slots' FSDP stack term is negative: it is what the 1F1B term leaves of it. Last,
# a DCN transfer between slices (`_dcn_transfers`; fitted on three two-slice LMs: 78 to
# 88 KiB each over the one-slice step).
_SCHEDULE_CODE = (1535, 173, 1090, 227, 64, 357, 14)
_SCHEDULE_SLOTS = (-114, 88, -268, 407, 192, 1078, 70)
# Beyond test size (`_weight_growth`): code (KiB) a doubling of the weights' tiles adds, by
# what the compiled step holds: a block of one layer of each stack; a stack under FSDP; a layer
# of the stage's under 1F1B; a stack under FSDP and 1F1B (fitted on the d_model 128 programs,
# docs/performance.md).
_GROWN_CODE = (230, 122, 58, 426)
# Under FSDP beyond test size, the gathered weights XLA:TPU keeps in HBM, in units of the
# stage's weights as its layers read them (fitted on the same programs, either schedule).
_GATHERED_HELD = 0.5
# 1F1B's values carried through its half-tick loop's switch (the stage's gradient sums, the
# stack's microbatched buffers), which XLA:TPU keeps in HBM beyond test size.
_CARRIED = ("gradients", "stack_buffers")
# The weights' mean tiles an array at which the test-size terms hold (a tile or two).
_TEST_TILES = 2
# How many times a step gathers a stage's weight, by schedule (`_collective_matmuls`).
_GATHERING_PASSES = {"gpipe": 1, "1f1b": 3}
# The all-reduces between slices where the stages cross them: the loss's scalars, the
# finiteness flags and the unstacked parameters' gradients, which XLA:TPU combines into 4 to 13
# transfers by layout (fitted: their mean, 8.5, over 19 two-slice programs, docs/performance.md).
_DCN_ALL_REDUCES = 8
_KIB = 2**10
# The VMEM XLA:TPU reserves for its kernels' scoped buffers (`xla_tpu` scoped VMEM's default),
# which memory-space assignment does not hand out: GPipe's values get the rest.
_SCOPED_VMEM = 16 * 2**20
# The smallest buffer XLA:TPU allocates, and the tile of an array's two minor dimensions in
# 32-bit words (sublanes, lanes).
_MIN_BUFFER = 512
_SUBLANES, _LANES = 8, 128
_TILE = _SUBLANES * _LANES * 4


def tile_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes XLA:TPU allocates for an array of `shape`: its two minor dimensions padded to the
    tile, in the layout that pads least (a sublane dimension under the tile's takes the next
    power of two: `f32[2,16]` is tiled (2, 128))."""
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return max(_MIN_BUFFER, -(-n // _LANES) * _LANES * itemsize)
    sub = _SUBLANES * 4 // itemsize
    best = None
    for i, j in itertools.permutations(range(len(shape)), 2):
        lanes, rows = shape[i], shape[j]
        rows = -(-rows // sub) * sub if rows >= sub else 1 << (rows - 1).bit_length()
        rest = math.prod(d for k, d in enumerate(shape) if k not in (i, j))
        size = rest * rows * -(-lanes // _LANES) * _LANES * itemsize
        best = size if best is None else min(best, size)
    return max(_MIN_BUFFER, best)


def _tiled_tree_bytes(tree) -> int:
    """Bytes per device of a tree of sharded `ShapeDtypeStruct`s, each shard in its tiles."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += tile_bytes(tuple(shape), np.dtype(x.dtype).itemsize)
    return total


@dataclasses.dataclass(frozen=True)
class TpuPipelineMemory(pipeline.PipelineMemory):
    """`PipelineMemory` on XLA:TPU: the state and batch in their tiles, the schedule's values
    only where they overflow VMEM (`in_flight`, `stack_buffers`, `working`, `gradients`), and
    the scalar slots and executable the schedule's loops compile to."""

    vmem: int = 0  # the schedule's values memory-space assignment keeps on chip
    scalars: int = 0  # the heap's scalar slots (tpu_memory's per array, and the schedule's)
    code: int = 0  # the executable
    weight_values: int = 0  # gathered weights in HBM beyond the test size (FSDP)

    @property
    def total(self) -> int:
        return super().total + self.scalars + self.code + self.weight_values

    def format(self, compiled: int | None = None) -> str:
        values = super().total - self.state - self.batch + self.weight_values
        line = (
            f"  memory per device (XLA:TPU): analytic {format_bytes(self.total)} = state "
            f"{format_bytes(self.state)} + batch {format_bytes(self.batch)} (tiled) + scalar "
            f"slots {format_bytes(self.scalars)} + code {format_bytes(self.code)} + schedule "
            f"values in HBM {format_bytes(values)} ({format_bytes(self.vmem)} in VMEM)"
        )
        if compiled:
            line += f"; compiled {format_bytes(compiled)} ({compiled / self.total:.2f}x)"
        return line


def _schedule_counts(
    trainer: Trainer, f: pipeline.PipelineFigures, grown: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The schedule terms' counts (`_SCHEDULE_CODE`): 1, the stage's blocks under tensor
    parallelism, the stacks under FSDP, the stage's layers under 1F1B, the collective
    matmuls (`_collective_matmuls`; none where the weights have `grown` beyond the test
    size's tiles: the gathers stay all-gathers), the stacks under FSDP and 1F1B, the DCN
    transfers between slices (`_dcn_transfers`); and the grown code's (`_GROWN_CODE`): the
    blocks of one layer of each stack, the stacks under FSDP, the stage's layers under 1F1B,
    the stacks under FSDP and 1F1B."""
    cfg = trainer.model.network_config
    part = trainer.partitioner
    if isinstance(cfg, T5Config):
        # (layers, blocks a layer, attention projections a layer)
        stacks = [(cfg.num_encoder_layers, 2, 4), (cfg.num_decoder_layers, 3, 8)]
    else:
        stacks = [(cfg.num_layers, 2, 4)]
    layers = sum(n // f.stages for n, _, _ in stacks)
    blocks = sum(n // f.stages * per for n, per, _ in stacks)
    kernels = sum(n // f.stages * k for n, _, k in stacks)
    tensor = bytes_per_device(part, ("mlp",), (cfg.mlp_dim,), 4) < 4 * cfg.mlp_dim
    fsdp = _layers_split_over_batch(trainer)
    # The weights as the layers read them: a bf16 policy's gathers feed the einsums directly.
    bf16 = fsdp and np.dtype(cfg.policy.params).itemsize == 2
    transfers, whole_slice = _dcn_transfers(trainer, f, len(stacks))
    # Across slices, where the FSDP ways are a whole slice, XLA:TPU makes collective matmuls of
    # the attention projections' fp32 gathers too, and of the MLP's kernels' bf16 ones
    # (observed on 2xv5e:2x2 at data=4; at data=2 model=2 fp32 gathers stay all-gathers).
    mlp = sum(n // f.stages * (len(cfg.mlp_activations) + 1) for n, _, _ in stacks)
    matmuls = kernels * (bf16 or whole_slice) + mlp * (bf16 and whole_slice)
    one_f_one_b = f.schedule == "1f1b"
    return (
        1,
        blocks * tensor,
        len(stacks) * fsdp,
        layers * one_f_one_b,
        _collective_matmuls(matmuls, f.schedule) if fsdp and not grown else 0,
        len(stacks) * fsdp * one_f_one_b,
        transfers,
    ), (
        sum(per for _, per, _ in stacks),
        len(stacks) * fsdp,
        layers * one_f_one_b,
        len(stacks) * fsdp * one_f_one_b,
    )


def _dcn_transfers(trainer: Trainer, f: pipeline.PipelineFigures, stacks: int) -> tuple[int, bool]:
    """The DCN transfers (send/recv pairs) of a step whose stages cross slices, and whether its
    batch's mesh axes are a whole slice; (0, False) within one slice. Each stack hands its
    activations on and their cotangents back, and its stack buffers (GPipe's two, 1F1B's one);
    an embedding table split over the other mesh axes goes to the last stage and its gradient
    back; then the all-reduces (`_DCN_ALL_REDUCES`). Only the stage axis crossing is counted."""
    mesh = trainer.partitioner.mesh
    slices = device_slices(mesh.devices)
    if STAGE not in axes_along(mesh, slices):
        return 0, False
    table = False
    for s, names in param_specs(trainer):
        axes = {t for e in s.spec for t in mesh_axes_of(e)} - {STAGE}
        table |= "vocab" in names and "layers" not in names and bool(axes)
    hand_offs = stacks * (2 + (2 if f.schedule == "gpipe" else 1)) + 2 * table
    batch_axes = set(trainer.partitioner.batch_axes) - {STAGE}
    ways = math.prod(mesh.shape[a] for a in batch_axes)
    return hand_offs + _DCN_ALL_REDUCES, ways == int(np.sum(slices == slices.flat[0]))


def _collective_matmuls(kernels: int, schedule: str) -> int:
    """The collective matmuls (windowed einsums) XLA:TPU makes of a bf16 stage's attention
    projections under FSDP (`kernels` of them; across slices more, `_schedule_counts`): each
    gather that feeds its einsum directly becomes a loop of collective-permutes over the FSDP
    ways, each step's partial einsum its own kernel. GPipe gathers a projection once a step,
    1F1B three times (as the compiled steps count them: its forward and backward, compiled
    apart, gather again)."""
    return kernels * _GATHERING_PASSES[schedule]


def _stage_weights(trainer: Trainer, stages: int) -> tuple[int, float]:
    """The stage's stacked weights as its layers read them (whole over the batch's mesh axes,
    which FSDP gathers; split over the others), in their tiles, bytes per device; and how much
    they have outgrown the test size's tiles: `log2` of their mean tiles an array (one layer of
    each stack) over `_TEST_TILES`, 0 at or under it."""
    part = trainer.partitioner
    mesh = part.mesh
    batch_axes = set(part.batch_axes) - {STAGE}
    total, tiles, arrays = 0, 0, 0
    for x, (s, names) in zip(
        jax.tree_util.tree_leaves(trainer.state_abstract.params), param_specs(trainer)
    ):
        if "layers" not in names:
            continue
        spec = tuple(s.spec) + (None,) * (len(x.shape) - len(s.spec))
        shape = []
        for d, n, e in zip(x.shape, names, spec):
            if n != "layers":
                ways = math.prod(mesh.shape[a] for a in mesh_axes_of(e) if a not in batch_axes)
                shape.append(d // ways)
        layer = tile_bytes(tuple(shape), np.dtype(x.dtype).itemsize)
        total += layer * x.shape[names.index("layers")] // stages
        tiles += layer / _TILE
        arrays += 1
    growth = math.log2(max(1.0, tiles / max(arrays, 1) / _TEST_TILES))
    return total, growth


def _layers_split_over_batch(trainer: Trainer) -> bool:
    """Whether the rules split a stacked layer weight over the batch's mesh axes (FSDP: each
    tick gathers the stage's weights)."""
    batch_axes = set(trainer.partitioner.batch_axes) - {STAGE}
    for s, names in param_specs(trainer):
        axes = {t for e, n in zip(s.spec, names) if n != "layers" for t in mesh_axes_of(e)}
        if "layers" in names and axes & batch_axes:
            return True
    return False


def tpu_pipeline_memory(trainer: Trainer) -> TpuPipelineMemory | None:
    """A pipelined train step's peak bytes per device on XLA:TPU (module docstring); None
    without stages."""
    f = pipeline.pipeline_figures(trainer)
    pm = pipeline.pipeline_memory(trainer)
    if f is None or pm is None:
        return None
    state = _tiled_tree_bytes(trainer.abstract_state())
    batch = _tiled_tree_bytes(sharded_batch(trainer))
    kind = trainer.partitioner.mesh.devices.flat[0].device_kind
    vmem = _values_budget(kind, f.schedule)
    weights, growth = _stage_weights(trainer, f.stages)
    # The schedule's values (pipeline.pipeline_memory's, sized in the compute dtype): on chip
    # up to the budget, the rest in HBM, the largest group first out; past test size 1F1B's
    # loop-carried values stay in HBM whole (`_CARRIED`).
    carried = _CARRIED if growth > 0 and f.schedule == "1f1b" else ()
    values = {
        "gradients": pm.gradients,
        "in_flight": pm.in_flight,
        "stack_buffers": pm.stack_buffers,
        "working": pm.working,
        "position_bias": pm.position_bias,
        # GPipe's written-out stage splits each stacked weight into its layers once (XLA:TPU's
        # buffer assignment: the `f32[1, ...]` pieces, with the gradient sums, in VMEM).
        "weight_split": pm.weight_split,
    }
    left = vmem
    for k in sorted(values, key=values.get):
        if k in carried:
            continue
        moved = min(left, values[k])
        values[k] -= moved
        left -= moved
    params = trainer.state_abstract.params
    arrays = len(jax.tree_util.tree_leaves(params))
    stacked = sum("layers" in names for _, names in param_specs(trainer))
    counts, grown = _schedule_counts(trainer, f, growth > 0)
    slots = arrays * tpu_memory.ARRAY_SLOTS + stacked * tpu_memory.LOOP_SLOTS
    slots += _KIB * sum(c * n for c, n in zip(_SCHEDULE_SLOTS, counts))
    code = _KIB * sum(c * n for c, n in zip(_SCHEDULE_CODE, counts))
    # Kernels unroll over their tiles: past the test size's, each term's code grows with the
    # log of the weights' tiles; and under FSDP gathered weights leave VMEM for HBM.
    code += int(_KIB * growth * sum(c * n for c, n in zip(_GROWN_CODE, grown)))
    held = int(_GATHERED_HELD * weights) if growth > 0 and counts[2] else 0
    return TpuPipelineMemory(
        state,
        batch,
        **values,
        vmem=vmem - left,
        scalars=max(slots, 0),
        code=code,
        weight_values=held,
    )


def _values_budget(device_kind: str, schedule: str) -> int:
    """VMEM the schedule's values may take. GPipe's tick loop writes each tick's residuals into
    its `[T, ...]` stacks and reads them back in the transposed loop: long-lived buffers that
    memory-space assignment places on chip up to all it allocates (VMEM past the scoped
    reserve), only the rest in HBM (d_model 512 and 1024 ahead of time on v5e: 112 MiB of VMEM
    temporaries). 1F1B's values keep the unpipelined step's budget (`tpu_memory.vmem_budget`)."""
    if schedule != "gpipe":
        return tpu_memory.vmem_budget(device_kind)
    cores = hardware.tensor_cores_per_device(device_kind)
    return max(0, hardware.vmem_bytes_of_kind(device_kind) - _SCOPED_VMEM) // cores


def stage_memory(trainer: Trainer) -> pipeline.PipelineMemory | None:
    """A pipelined train step's peak memory per device, by the compiler of its devices:
    XLA:TPU's (`tpu_pipeline_memory`) on TPU devices (a topology's compile-only ones
    included), XLA:CPU's (`pipeline.pipeline_memory`) elsewhere; None without stages."""
    if memory.platform_of(trainer) == "tpu":
        return tpu_pipeline_memory(trainer)
    return pipeline.pipeline_memory(trainer)
