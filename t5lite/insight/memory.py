"""Memory per device of the train step: XLA's figure for a compiled program and the analytic
prediction from shapes, shardings and the remat policy (what scales to models no laptop compiles).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from t5lite.insight import moe_memory, tpu_memory, tpu_moe_memory
from t5lite.insight.activation_memory import (
    PENDING,
    RING_BLOCKS_SAVED,
    UNSCANNED_LOSS_BUFFERS,
    scanned_backward,
    unscanned_backward,
)
from t5lite.insight.parameter_bytes import (
    embedding_gradient_bytes,
    gathered_layer_bytes,
    gradient_bytes,
    gradient_leaves,
    param_specs,
    params_split_over_batch,
    state_and_batch,
    tree_bytes_per_device,
)
from t5lite.insight.sharded_bytes import bytes_per_device
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


# --- the analytic model ---------------------------------------------------------------------


def _sequence_layout(partitioner: Partitioner) -> tuple[bool, bool]:
    """(sequence parallel, context parallel): whether the rules split activations' `length`
    and the blocks' features over the same mesh axes (Megatron-3's layout, where
    `collectives.sequence_parallel_gather` gathers each block's input), or split `length` and keep
    `kv_length` whole (`context_parallel.context_parallel_attention` gathers keys and values)."""

    def axes(names: tuple[str | None, ...], dim: int) -> set[str]:
        spec, _ = resolve_logical_axes(names, partitioner.rules)
        return set(mesh_axes_of(spec[dim])) & set(partitioner.mesh.shape)

    length = axes(("batch", "length", "embed"), 1)
    if not length:
        return False, False
    features = axes(("batch", "length", "heads", "kv"), 2) | axes(("batch", "length", "mlp"), 2)
    sp = length <= features
    cp = not sp and not axes(("batch", "kv_length", "kv_heads", "kv"), 1)
    return sp, cp


def _ring_size(partitioner: Partitioner) -> int:
    """The devices on the ring when attention runs it (`context_parallel_ring`: the rules split
    `kv_length` over the axes that split activations' `length`, model/ring_attention.py), else
    0."""

    def axes(names: tuple[str | None, ...], dim: int) -> set[str]:
        spec, _ = resolve_logical_axes(names, partitioner.rules)
        return set(mesh_axes_of(spec[dim])) & set(partitioner.mesh.shape)

    length = axes(("batch", "length", "embed"), 1)
    if not length or axes(("batch", "kv_length", "kv_heads", "kv"), 1) != length:
        return 0
    return math.prod(partitioner.mesh.shape[t] for t in length)


def activation_itemsize(cfg: Any, platform: str) -> int:
    """Bytes an activation element takes in the compiled step on `platform`.

    XLA:CPU has no bf16 or fp16 matmul: it converts their operands to fp32, and since excess
    precision is allowed by default (`--xla_allow_excess_precision`) the algebraic simplifier
    then drops the round trips back to the compute dtype, so every activation is stored fp32
    (docs/performance.md, "bf16 on XLA:CPU"). TPUs and GPUs keep the compute dtype.
    """
    compute = np.dtype(cfg.policy.compute).itemsize
    return max(compute, 4) if platform == "cpu" else compute


def platform_of(trainer: Trainer) -> str:
    """The platform ('cpu', 'tpu', 'gpu') of `trainer`'s devices."""
    return str(trainer.partitioner.mesh.devices.flat[0].platform)


def layer_bytes(
    partitioner: Partitioner,
    cfg: Any,
    b: int,
    q_len: int,
    kv_lens: list[int],
    act: int,
    causal: bool = False,
    platform: str = "cpu",
) -> dict[str, int]:
    """Per-device bytes of one layer's activations (`act` bytes an element) on `platform`:
    {name: bytes} by logical layout. `causal`: the layer's self-attention (kv_lens[0]) is
    causal without a prefix (the ring balances it: `ring_attention.is_balanced`)."""
    h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int = act) -> int:
        return bytes_per_device(partitioner, axes, shape, itemsize)

    x_gathered = of(("batch", None, None), (b, q_len, cfg.emb_dim))
    sp, cp = _sequence_layout(partitioner)
    n = 0 if sp else _ring_size(partitioner)
    ring = n > 1
    balanced = ring and causal and q_len == kv_lens[0] and q_len % (2 * n) == 0
    # Sequence parallelism's column-parallel shard_maps (t5lite/collectives.py) gather each
    # block's input whole over `length` and save it for the kernels' gradients: the
    # self-attention's and the MLP's input, and a cross-attention's query input and keys'
    # source (the encoder output, [B, S, D]).
    block_inputs = [x_gathered] * 2
    for s in kv_lens[1:]:
        block_inputs += [x_gathered, of(("batch", None, None), (b, s, cfg.emb_dim))]
    return {
        "x": of(("batch", "length", "embed"), (b, q_len, cfg.emb_dim)),
        "sp_gathered": sum(block_inputs) if sp else 0,
        # Context parallelism's attention gathers every key and value over `length` inside its
        # shard_map: whole-length k and v per attention.
        "kv_gathered": (
            sum(2 * of(("batch", "kv_length", "kv_heads", "kv"), (b, s, g, k)) for s in kv_lens)
            if cp
            else 0
        ),
        # a block's matmul input, gathered over whatever splits activations' length or embed
        # (the ring's layers take theirs split by position: nothing gathers it)
        "x_gathered": of(("batch", "length", "embed"), (b, q_len, cfg.emb_dim))
        if ring
        else x_gathered,
        "q": of(("batch", "length", "heads", "kv"), (b, q_len, h, k)),
        "kv": sum(2 * of(("batch", "length", "kv_heads", "kv"), (b, s, g, k)) for s in kv_lens),
        # NOTE: attention logits and probabilities are fp32 whatever the activation dtype. The
        # ring never holds [L/n, S]: one step's block [L/n, S/n] of the chunk in hand.
        "scores": sum(of(("batch", "heads", "length", None), (b, h, q_len, s), 4) for s in kv_lens)
        // (n if ring else 1),
        **_ring_bytes(partitioner, cfg, b, q_len, kv_lens, act, n if balanced else 0),
        "h": of(("batch", "length", "mlp"), (b, q_len, cfg.mlp_dim)),
        # a mixture of experts' MLP (zeros: dense), see moe_memory.moe_bytes
        **moe_memory.moe_bytes(partitioner, cfg, b, q_len, act, platform),
        "attentions": len(kv_lens),
        "mlp_in": len(cfg.mlp_activations),
        "gelu": int("gelu" in cfg.mlp_activations),
        # Where XLA:CPU's scheduler places an unscanned layer's `full` recomputation (see
        # _unscanned_backward): the attention's ahead of the loss gradient when its heads are
        # split without sequence parallelism, FSDP's parameter gathers or a split `embed`
        # (megatron: the out projection's all-reduce holds the MLP back; under FSDP the whole
        # recomputation is hoisted).
        "heads_split": int(
            not sp
            and of(("embed",), (cfg.emb_dim,)) == of((None,), (cfg.emb_dim,))
            and of(("batch", "length", "embed"), (b, q_len, cfg.emb_dim))
            == of(("batch", "length", None), (b, q_len, cfg.emb_dim))
            and of(("batch", "length", "heads", "kv"), (b, q_len, h, k))
            < of(("batch", "length", None, "kv"), (b, q_len, h, k))
        ),
        # Activations' `embed` split (the 2D layouts: 2D activations, fully sharded): none of
        # it ahead of the loss gradient.
        "embed_split": int(
            of(("batch", "length", "embed"), (b, q_len, cfg.emb_dim))
            < of(("batch", "length", None), (b, q_len, cfg.emb_dim))
        ),
    }


def _ring_bytes(
    partitioner: Partitioner,
    cfg: Any,
    b: int,
    q_len: int,
    kv_lens: list[int],
    act: int,
    balanced: int,
) -> dict[str, int | None]:
    """Ring attention's own terms of one layer (`layer_bytes`; `balanced`: the ring's size
    when the self-attention is zigzag-balanced, else 0); none for other layouts."""
    if not _ring_size(partitioner):
        return {"scores_saved": None, "ring_saved": 0, "ring_flight": 0, "ring_steps": 0}
    h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int = act) -> int:
        return bytes_per_device(partitioner, axes, shape, itemsize)

    q = of(("batch", "length", "heads", "kv"), (b, q_len, h, k))
    # one device's chunk of keys (or values) of each attention
    kv_chunk = [of(("batch", "length", "kv_heads", "kv"), (b, s, g, k)) for s in kv_lens]
    return {
        "scores_saved": RING_BLOCKS_SAVED,
        # What the custom_vjp keeps beyond the layer's own q, k, v and context: a balanced
        # (zigzag) layer's reordered copies of q, k, v and its output, and each attention's
        # softmax statistics (max and sum, [B, H, L/n] fp32).
        "ring_saved": (2 * q + 2 * kv_chunk[0]) * bool(balanced)
        + len(kv_lens) * 2 * of(("batch", "heads", "length"), (b, h, q_len), 4),
        # The ring's backward while a layer is differentiated: its stacked keys and values,
        # the chunk in hand and the one arriving, and their fp32 gradients, in hand and in
        # flight; the queries' fp32 gradient accumulator.
        "ring_flight": max(4 * kv_s * (1 + 4 // act) for kv_s in kv_chunk) + q * 4 // act,
        # each ring attention's steps (its permutes and block kernels: code on TPU)
        "ring_steps": len(kv_lens) * (_ring_size(partitioner) - 1),
    }


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """An analytic estimate of the train step's peak memory per device (no compilation).

    The peak is the largest of these moments (and, for unscanned `full`, one a stack, below),
    each a sum of buffers live at once:
      backward: state + batch + gradients (whole over the batch axes until reduced; a scanned
        stack's in the parameters' sharding, the layer scan reducing each layer's as it goes,
        beside the layer in hand's) + saved activations (all layers, under the remat policy) + the
        larger of the loss's temporaries ([B, L, V] fp32 logits and probabilities) and one
        layer's backward working set (its activations, recomputed under remat, and their
        cotangents);
      update: state + batch + gradients + the optimizer's parameter-sized update (the reduced
        gradients); unscanned, + the token embedding's scatter zeros and, per extra lookup of
        a shared table (T5), one more unreduced and reduced table gradient.
    `activations` is what the backward moment adds (0 when the update is the peak, but for the
    HBM slots at a TPU ring layout's update: `tpu_memory.ring_update`), `update` likewise; `terms`
    lists every modelled group and `activation_kinds` splits `activations` by kind of layer
    (attention, MLP, norms and residual sums, logits and loss, and, at an unscanned FSDP
    layout's inside-backward moment, the layers' gathered weights; they add up to it). State
    and batch are exact (shardings); every activation is sized by resolving its logical axes
    with the rules table, so any preset (sequence or context parallelism included) is sized
    by what it shards.

    Accuracy is measured against XLA:CPU's compiled figure by tests/test_insight_accuracy.py
    and benchmarks/memory_accuracy.py (every preset x remat policy, both families, layers
    scanned or unrolled); docs/performance.md has the figures and the layouts known to miss.
    Unscanned `full` has more moments, inside each stack's backward (that stack's every layer
    recomputed, the first one differentiated, the loss's buffers gone); at the loss gradient
    it counts the recomputation XLA:CPU hoists ahead of it, by layout
    (`activation_memory.unscanned_backward`).
    """

    state: int
    batch: int
    gradients: int
    update: int
    activations: int
    terms: tuple[tuple[str, int], ...] = ()  # every modelled buffer group, for reports
    # `activations` by kind (activation_memory.KINDS)
    activation_kinds: tuple[tuple[str, int], ...] = ()
    # The executable in device memory (TPU: `memory_analysis` counts it; 0 elsewhere)
    code: int = 0
    # The scanned stacks' part of `gradients` (in the parameters' sharding, and one layer's
    # whole over the batch's axes where the scan reduces them); 0 unscanned
    layer_gradients: int = 0

    @property
    def total(self) -> int:
        return self.state + self.batch + self.gradients + self.update + self.activations + self.code


def predict_memory(trainer: Trainer, platform: str | None = None) -> PredictedMemory:
    """Peak memory per device of `trainer.train_step`, from shapes and shardings alone.

    `platform` ("cpu", "tpu", "gpu"; default: that of the trainer's mesh) is the backend whose
    compiler is modelled: XLA:CPU stores a bf16 policy's activations in fp32
    (`activation_itemsize`); XLA:TPU fuses more and keeps fewer buffers (`tpu_memory`).
    """
    part = trainer.partitioner
    cfg = trainer.model.network_config
    platform = platform or platform_of(trainer)
    act = activation_itemsize(cfg, platform)
    compute = np.dtype(cfg.policy.compute).itemsize
    b = trainer.batch_size // trainer.num_microbatches
    lt = trainer.lengths["targets"]
    if hasattr(cfg, "num_encoder_layers"):
        li = trainer.lengths["inputs"]
        stacks = [
            (cfg.num_encoder_layers, li, [li], False),
            (cfg.num_decoder_layers, lt, [lt, li], True),
        ]
    else:
        lt += trainer.lengths.get("inputs", 0)  # a prefix-LM's row
        prefix = getattr(trainer.model, "feature_converter", "lm") == "prefix_lm" and getattr(
            trainer.model, "inputs_bidirectional_attention", True
        )
        stacks = [(cfg.num_layers, lt, [lt], not prefix)]
    layers = [(n, layer_bytes(part, cfg, b, q, kv, act, c, platform)) for n, q, kv, c in stacks]
    layers = [(n, {**a, "moe_share": moe_memory.moe_share(cfg, n)}) for n, a in layers]
    logits = bytes_per_device(part, ("batch", "length", "vocab"), (b, lt, cfg.vocab_size), 4)
    if platform == "tpu":
        return _predict_tpu(trainer, layers, logits)
    if cfg.scan_layers:
        backward, terms = scanned_backward(layers, cfg.remat_policy, logits)
    else:
        gathered = gathered_layer_bytes(trainer)
        remat = cfg.remat_policy
        if act > compute:
            # Upcast by XLA:CPU (activation_itemsize), unscanned layers' recomputation is
            # hoisted ahead of the loss gradient, all of it, and held there: the compiled
            # step needs what it needs without remat, whatever the policy (the buffer
            # assignment names every layer's rematted values at the peak).
            remat = "none"
        # With every parameter replicated and the logits split over the batch only (data
        # parallel) XLA:CPU holds two [B, L, V] buffers at the loss gradient, not three: the
        # output layer's gradient is written straight from the logits' cotangent.
        params = trainer.abstract_state().params
        whole = sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(params)
        )
        unsplit = bytes_per_device(part, ("batch", None, None), (b, lt, cfg.vocab_size), 4)
        replicated = tree_bytes_per_device(params) == whole and logits == unsplit
        loss_buffers = UNSCANNED_LOSS_BUFFERS - replicated
        backward, terms = unscanned_backward(layers, remat, logits, gathered, loss_buffers)
    state, batch = state_and_batch(trainer)
    # XLA:CPU computes a bf16 master's gradient and its update in fp32 too
    # (activation_itemsize's upcast) and holds them so until the new state is written.
    upcast = act if act > compute else 0
    grads, layer_grads = gradient_bytes(trainer, upcast)
    # (unscanned `full` inside a stack's backward: the expert kernels' gradients not yet
    # computed, activation_memory._pending)
    grads += backward.pop(PENDING, 0)
    # The gradient reduction and the update: beside the gradients, their reduced copies (the
    # optimizer's parameter-sized update).
    update = tree_bytes_per_device(trainer.abstract_state().params, upcast)
    if not cfg.scan_layers:
        update += _unscanned_update(trainer, layers, upcast)
    terms = (*terms, ("optimizer update", update))
    total = sum(backward.values())
    if total >= update:
        kinds = tuple(backward.items())
        return PredictedMemory(state, batch, grads, 0, total, terms, kinds, 0, layer_grads)
    return PredictedMemory(state, batch, grads, update, 0, terms, (), 0, layer_grads)


def _unscanned_update(trainer: Trainer, layers: list, upcast: int) -> int:
    """What the unscanned program's update holds beyond the parameters' reduced copies."""
    cfg = trainer.model.network_config
    # Unscanned, each lookup of the token embedding keeps its own scatter-add gradient up
    # to the reduction (an encoder-decoder's shared table is looked up by both stacks, and
    # each lookup's gradient is reduced as its own operand of the combined all-reduce
    # before they are summed), beside the scatter's zero-initialised table (XLA:CPU's
    # buffer assignment, T5 on data parallel). The scanned program sums them first.
    table = embedding_gradient_bytes(trainer, upcast)
    lookups = 2 if hasattr(cfg, "num_encoder_layers") else 1
    # Expert kernels split over every batch axis need no reduction: no reduced copy.
    moe = sum(round(n * a["moe_share"]) for n, a in layers)
    local = moe * moe_memory.local_expert_gradient_bytes(trainer.partitioner, cfg)
    return (lookups - 1) * (table[0] + table[1]) + table[0] - local


def _predict_tpu(trainer: Trainer, layers: list, logits: int) -> PredictedMemory:
    """`predict_memory` for XLA:TPU (tpu_memory): the larger of the loss gradient's moment
    (saved activations and the loss) and the backward's end (every gradient, unreduced: the
    saved values are gone by then), beside the state, the batch and the executable."""
    cfg = trainer.model.network_config
    state, batch = state_and_batch(trainer)
    kind = trainer.partitioner.mesh.devices.flat[0].device_kind
    vmem = tpu_memory.vmem_budget(kind)
    # Gradients on their way through the all-reduce stay in VMEM up to the budget.
    grads = max(0, gradient_bytes(trainer, scan_reduces=False)[0] - vmem)
    gathered = gathered_layer_bytes(trainer)
    arrays = len(jax.tree_util.tree_leaves(trainer.state_abstract.params))
    moe = {}
    if getattr(cfg, "num_experts", 0):
        moe = _tpu_moe(trainer, layers, vmem)
        layers = [(n, {**a, "moe": 0}) for n, a in layers]
    # The parameters cast from their masters to a narrower compute dtype (bf16 of fp32 masters):
    # on a megacore, where FSDP gathers them, they live through the backward (tpu_memory).
    params = trainer.abstract_state().params
    master = np.dtype(jax.tree_util.tree_leaves(params)[0].dtype).itemsize
    narrow = activation_itemsize(cfg, "tpu")
    casts = tree_bytes_per_device(params) * narrow // master if master > narrow else 0
    steps = sum(a["ring_steps"] * (1 if cfg.scan_layers else n) for n, a in layers)
    stacked = sum("layers" in names for _, names in param_specs(trainer))
    encoder_decoder = hasattr(cfg, "num_encoder_layers")
    held = tpu_memory.held_logits(layers, logits, encoder_decoder, params_split_over_batch(trainer))
    backward, terms = tpu_memory.backward(
        layers,
        cfg.remat_policy,
        logits,
        vmem,
        gathered,
        arrays,
        kind,
        casts,
        steps,
        # (MoE layers keep the unscanned split: their programs were fitted on it)
        scanned=cfg.scan_layers and not moe,
        itemsize=narrow,
        stacked=stacked,
        held=held,
    )
    backward, terms = {**backward, **moe}, (*terms, *moe.items())
    if cfg.scan_layers and "loop scalars" not in dict(terms):  # (scanned_megacore's are in)
        backward["parameter scalars"] += stacked * tpu_memory.LOOP_SLOTS
        terms = (*terms, ("loop scalars", stacked * tpu_memory.LOOP_SLOTS))
    itemsize = activation_itemsize(cfg, "tpu")
    blocks = [
        ((a["attentions"] + 1) * (1 if cfg.scan_layers else n), a["x_gathered"] // itemsize)
        for n, a in layers
    ]
    gathers = tpu_memory.gathers_in_blocks(layers, gathered > 0)
    cp = sum(a["attentions"] * (1 if cfg.scan_layers else n) for n, a in layers if a["kv_gathered"])
    code = tpu_memory.code_bytes(blocks, cfg.remat_policy, gathers, steps, kind, cp)
    if getattr(cfg, "num_experts", 0):
        code += tpu_moe_memory.moe_code(layers, cfg.remat_policy, cfg.scan_layers, cfg.moe_top_k)
    terms = (*terms, ("optimizer update", 0), ("generated code", code))
    # A ring layout's update on a megacore, with the HBM slots that live through the step.
    update = {}
    if steps:
        largest = max(reduced for _, _, _, reduced, _ in gradient_leaves(trainer, 0))
        # (the gradients of the parameters' casts: in the compute dtype)
        whole = gradient_bytes(trainer, scan_reduces=False)[0] * narrow // master
        update = tpu_memory.ring_update(
            backward, max(0, whole - vmem), largest * narrow // master, kind
        )
    if sum(update.values()) > sum(backward.values()):
        copy, grads = update.pop("reduced copy"), update.pop("gradients")
        terms = (*terms, ("gradients at the update", grads), ("reduced copy", copy))
        kinds = tuple(update.items())
        return PredictedMemory(state, batch, grads, copy, sum(update.values()), terms, kinds, code)
    if sum(backward.values()) >= grads:
        kinds = tuple(backward.items())
        return PredictedMemory(state, batch, 0, 0, sum(backward.values()), terms, kinds, code)
    return PredictedMemory(state, batch, grads, 0, 0, terms, code=code)


def _tpu_moe(trainer: Trainer, layers: list, vmem: int) -> dict[str, int]:
    """The MoE layers' terms on XLA:TPU (tpu_moe_memory): where their values leave VMEM, they
    and every gradient are in HBM (`tpu_moe_memory.spills`)."""
    cfg = trainer.model.network_config
    params = trainer.state_abstract.params
    return tpu_moe_memory.moe_terms(
        cfg,
        layers,
        gradients=gradient_bytes(trainer, scan_reduces=False)[0],
        master_itemsize=np.dtype(jax.tree_util.tree_leaves(params)[0].dtype).itemsize,
        itemsize=activation_itemsize(cfg, "tpu"),
        f_split=moe_memory.kernel_splits(trainer.partitioner)[2],
        one_axis=sum(n > 1 for n in trainer.partitioner.mesh.shape.values()) == 1,
        vmem=vmem,
    )


def rule_of(partitioner: Partitioner, name: str) -> Any:
    for n, axis in partitioner.rules:
        if n == name:
            return axis
    return None
