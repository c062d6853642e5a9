"""Memory per device of the train step: XLA's figure for a compiled program and the analytic
prediction from shapes, shardings and the remat policy (what scales to models no laptop compiles).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from t5lite.partitioning import CompiledFunction, Partitioner, mesh_axes_of, resolve_logical_axes
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


# --- the analytic model ---------------------------------------------------------------------


def _bytes_per_device(
    partitioner: Partitioner, axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int
) -> int:
    """Bytes one device holds of an array with these logical axes under the rules table."""
    spec, _ = resolve_logical_axes(axes, partitioner.rules)
    mesh = partitioner.mesh.shape
    split = math.prod(mesh[t] for e in spec for t in mesh_axes_of(e) if t in mesh)
    return math.prod(shape) * itemsize // max(split, 1)


def _layer_bytes(partitioner: Partitioner, cfg: Any, b: int, q_len: int, kv_lens: list[int]):
    """Per-device bytes of one layer's activations: {name: bytes} by logical layout."""
    act = np.dtype(cfg.policy.compute).itemsize
    h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int = act) -> int:
        return _bytes_per_device(partitioner, axes, shape, itemsize)

    return {
        "x": of(("batch", "length", "embed"), (b, q_len, cfg.emb_dim)),
        # a block's matmul input, gathered over whatever splits activations' length or embed
        "x_gathered": of(("batch", None, None), (b, q_len, cfg.emb_dim)),
        "q": of(("batch", "length", "heads", "kv"), (b, q_len, h, k)),
        "kv": sum(2 * of(("batch", "length", "kv_heads", "kv"), (b, s, g, k)) for s in kv_lens),
        # NOTE: attention logits and probabilities are fp32 whatever the activation dtype.
        "scores": sum(of(("batch", "heads", "length", None), (b, h, q_len, s), 4) for s in kv_lens),
        "h": of(("batch", "length", "mlp"), (b, q_len, cfg.mlp_dim)),
        "attentions": len(kv_lens),
        "mlp_in": len(cfg.mlp_activations),
    }


# Buffers of each shape that the CPU compiler keeps per layer without remat, read from XLA's
# buffer assignment (`--xla_dump_to`) and fitted on the scanned models of
# tests/test_insight_accuracy.py (L = 64..128), then checked on sequences of 512 (a decoder-only
# model, and T5.1.1-small under FSDP at batch 128, 512/114 tokens: within 5%). Per block: the
# input, the norm's output, the block's output before its reduction and the residual sum; per
# attention, q and the context; keys and values once; the MLP's pre-activations, activation,
# gated product and their cotangents. The [B, H, L, L] fp32 attention scores: every layer
# keeps two (logits, probabilities); the layer being differentiated three more (their
# cotangents and the softmax's temporaries).
_X_PER_BLOCK, _Q_PER_ATTENTION, _KV, _HIDDEN = 4, 2, 1, 9
_SCORES_SAVED, _SCORES_WORKING = 2, 3
# The loss: logits and softmax probabilities (their cotangent reuses the logits' buffer).
_LOSS_BUFFERS = 2


def _saved(a: dict[str, int], remat: str, scores: int | None = None) -> int:
    """What one layer keeps for its backward pass under a remat policy (`scores`: how many
    [B, H, L, L] buffers without remat; default: those every layer keeps)."""
    n = a["attentions"]
    if remat == "full":
        return a["x"]  # the layer input; everything else is recomputed
    if remat == "minimal":  # outputs of dots without batch dims (projections) + the input
        return 2 * a["x"] + n * (a["q"] + a["x"]) + a["kv"] + a["mlp_in"] * a["h"]
    return (
        _X_PER_BLOCK * (n + 1) * a["x"]
        + _Q_PER_ATTENTION * n * a["q"]
        + _KV * a["kv"]
        + (_SCORES_SAVED if scores is None else scores) * a["scores"]
        + _HIDDEN * a["h"]
    )


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """An analytic estimate of the train step's peak memory per device (no compilation).

    The peak is the larger of two moments, each a sum of buffers live at once:
      backward: state + batch + gradients (whole over the batch axes until reduced, all layers:
        the scan carries them) + saved activations (all layers, under the remat policy) + the
        larger of the loss's temporaries ([B, L, V] fp32 logits and probabilities) and one
        layer's backward working set (its activations, recomputed under remat, and their
        cotangents);
      update: state + batch + gradients + the optimizer's parameter-sized update.
    `activations` is what the backward moment adds (0 when the update is the peak), `update`
    likewise; `terms` lists every modelled group. State and batch are exact (shardings); every
    activation is sized by resolving its logical axes with the rules table, so any preset
    (sequence or context parallelism included) is sized by what it shards.

    Accuracy: within 9% of XLA's CPU figure for every preset x remat policy on scanned
    (`scan_layers=True`) T5.1.1 and decoder-only models (tests/test_insight_accuracy.py). Not
    for unscanned layers: without the scan's loop as a barrier, the CPU scheduler moves the
    rematerialised forward passes of all layers ahead of the loss gradient (seen in the buffer
    assignment), so remat saves less than modelled, and the unscanned forward keeps fewer
    copies than the scanned one; measured on the T5 test model under FSDP, unscanned: none
    85.9, minimal 82.9, full 71.2 MiB against scanned 99.5, 56.0, 42.8 MiB.
    """

    state: int
    batch: int
    gradients: int
    update: int
    activations: int
    terms: tuple[tuple[str, int], ...] = ()  # every modelled buffer group, for reports

    @property
    def total(self) -> int:
        return self.state + self.batch + self.gradients + self.update + self.activations


def predict_memory(trainer: Trainer) -> PredictedMemory:
    """Peak memory per device of `trainer.train_step`, from shapes and shardings alone."""
    part = trainer.partitioner
    cfg = trainer.model.network_config
    b = trainer.batch_size // trainer.num_microbatches
    lt = trainer.lengths["targets"]
    if hasattr(cfg, "num_encoder_layers"):
        li = trainer.lengths["inputs"]
        stacks = [(cfg.num_encoder_layers, li, [li]), (cfg.num_decoder_layers, lt, [lt, li])]
    else:
        lt += trainer.lengths.get("inputs", 0)  # a prefix-LM's row
        stacks = [(cfg.num_layers, lt, [lt])]
    layers = [(n, _layer_bytes(part, cfg, b, q, kv)) for n, q, kv in stacks]
    saved = sum(n * _saved(a, cfg.remat_policy) for n, a in layers)
    # One layer's backward, all of it. Under remat it recomputes the layer's matmuls, whose
    # inputs are gathered over the axes that split activations (2D activations, sequence
    # parallelism), so its [B, L, D] buffers are counted at their gathered size.
    gathered = cfg.remat_policy != "none"
    work = max(
        _saved({**a, "x": a["x_gathered"]} if gathered else a, "none", _SCORES_WORKING)
        for _, a in layers
    )
    logits = _bytes_per_device(part, ("batch", "length", "vocab"), (b, lt, cfg.vocab_size), 4)
    loss = _LOSS_BUFFERS * logits
    state = _tree_bytes_per_device(trainer.abstract_state())
    batch = _tree_bytes_per_device(
        jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            trainer.batch_abstract,
            trainer.batch_shardings,
        )
    )
    grads = _unreduced_gradient_bytes(trainer)
    update = _tree_bytes_per_device(trainer.abstract_state().params)
    # Under remat the compiler recomputes the last layer's forward (half its working set: the
    # values, not yet their cotangents) while the loss's [B, L, V] buffers are still live.
    backward = saved + max(loss + (work // 2 if gathered else 0), work)
    terms = (
        ("saved activations", saved), ("layer working set", work), ("loss temporaries", loss),
        ("optimizer update", update),
    )  # fmt: skip
    if backward >= update:
        return PredictedMemory(state, batch, grads, 0, backward, terms)
    return PredictedMemory(state, batch, grads, update, 0, terms)


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
