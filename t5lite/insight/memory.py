"""Memory per device of the train step: XLA's figure for a compiled program and the analytic
prediction from shapes, shardings and the remat policy (what scales to models no laptop compiles).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from t5lite.partitioning import CompiledFunction, Partitioner, mesh_axes_of
from t5lite.trainer import Trainer


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
    act_bytes = np.dtype(cfg.policy.compute).itemsize
    data_size = trainer.partitioner.data_parallel_size
    b = trainer.batch_size // data_size
    # The model axis splits MLP and heads; activations' embed stays whole (1D activations).
    model_size = math.prod(
        trainer.partitioner.mesh.shape[t] for t in mesh_axes_of(rule_of(trainer.partitioner, "mlp"))
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


def rule_of(partitioner: Partitioner, name: str) -> Any:
    for n, axis in partitioner.rules:
        if n == name:
            return axis
    return None
