"""Per-device bytes of a mixture-of-experts MLP (model/moe.py) for the analytic memory model
(memory.layer_bytes): capacity dispatch's masks, dispatched tokens and expert hidden buffers,
dropless dispatch's sorted rows and, on CPU, its ragged dots' masked operands."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from t5lite.insight.sharded_bytes import bytes_per_device
from t5lite.partitioning import Partitioner, mesh_axes_of, resolve_logical_axes


def moe_bytes(
    partitioner: Partitioner, cfg: Any, b: int, length: int, act: int, platform: str = "cpu"
) -> dict[str, int]:
    """Per-device bytes of a mixture-of-experts MLP (model/moe.py) of a layer of `b` rows of
    `length` tokens on `platform`, zeros for a dense model: "moe", what a scanned layer keeps
    for its backward without remat; "moe_held", what an unscanned one holds at the loss
    gradient; "moe_h", one expert hidden buffer; "moe_work" / "moe_rework", its backward's
    working set without / with remat; "moe_extra", what of it no dense layer has;
    "moe_hoisted", an encoder layer's `full` recomputation held ahead of the decoder's
    backward (capacity); "moe_grads", its expert kernels' gradients."""
    if not getattr(cfg, "num_experts", 0):
        keys = ("moe", "moe_h", "moe_work", "moe_rework", "moe_extra", "moe_held", "moe_recomputed")
        return dict.fromkeys(keys, 0)
    grads = {"moe_grads": expert_gradient_bytes(partitioner, cfg)}
    of_dispatch = dropless_bytes if cfg.moe_dispatch == "dropless" else capacity_bytes
    return {**of_dispatch(partitioner, cfg, b, length, act, platform), **grads}


def capacity_bytes(
    partitioner: Partitioner, cfg: Any, b: int, length: int, act: int, platform: str
) -> dict[str, int]:
    """`moe_bytes` of capacity dispatch (MoeBlock._capacity)."""
    # Imported here: the model package is only needed for a sparse model's shapes.
    from t5lite.model.moe import DISPATCHED_AXES, HIDDEN_AXES, expert_capacity

    e = cfg.num_experts
    c = cfg.moe_expert_capacity or expert_capacity(
        length, e, cfg.moe_top_k, cfg.moe_capacity_factor
    )
    c = max(1, min(length, c))

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int = act) -> int:
        return bytes_per_device(partitioner, axes, shape, itemsize)

    # Capacity dispatch keeps the dispatch and combine masks [G, S, E, C] (their slots split
    # as the dispatched tokens they build), the dispatched inputs and the experts' outputs
    # [E, G, C, D], and six [E, G, C, F] buffers of the experts' hidden layer (pre-activations,
    # activation, product, cotangents); the router's [T, E] ones are negligible (XLA:CPU).
    masks = of(("batch", None, None, "expert_capacity"), (b, length, e, c), act)
    dispatched = of(DISPATCHED_AXES, (e, b, c, cfg.emb_dim))
    hidden = of(HIDDEN_AXES, (e, b, c, cfg.mlp_dim))
    saved = 2 * masks + 2 * dispatched + _MOE_HIDDEN * hidden
    # Where the expert kernels keep `expert_mlp` whole while the hidden layer's rules split it
    # (the 2D layouts: `embed` takes the axis first), the expert matmuls' outputs and their
    # cotangents come in the kernels' layout and are resharded after: four [E, G, C, F]
    # buffers of the backward are F-whole (the hidden layer and product gathered, both
    # pre-activations' cotangents before their reduce-scatter).
    f_split = kernel_splits(partitioner)[2]
    whole_f = of((*HIDDEN_AXES[:3], None), (e, b, c, cfg.mlp_dim)) // f_split
    resharded = _RESHARDED_HIDDEN * max(whole_f - hidden, 0)
    held_whole = _HELD_WHOLE * whole_f - _UNSTACKED_HIDDEN * hidden if resharded else 0
    recomputed = 2 * whole_f if resharded and cfg.remat_policy == "full" else 0
    # Under `minimal` (the MLP recomputed ahead of the loss gradient where the weights are
    # gathered), the same: every layer holds both pre-activations F-whole there, in place of
    # its F-split hidden buffers (XLA:CPU's live ranges, T5 fully_sharded: f32[2,16,40,1024]
    # `egcd,edf->egcf` outputs, two or three an encoder layer, two a decoder layer).
    minimal = resharded and cfg.remat_policy == "minimal" and platform == "cpu"
    recomputed_minimal = 2 * whole_f if minimal else 0
    # Its backward: the values' cotangents (as many again); under remat the recomputed values
    # and part of their cotangents, _MOE_RECOMPUTED times them (fitted on XLA:CPU's compiled
    # totals of both families under megatron and expert_parallel).
    work = {
        "moe_work": saved + resharded,
        "moe_rework": int(_MOE_RECOMPUTED * saved) + resharded,
        # (unscanned, beside the layer's held F-split values: whole copies, not the difference)
        "moe_extra": _RESHARDED_HIDDEN * whole_f if resharded and not recomputed else 0,
        # Unscanned `full`, resharded: the recomputation holds both pre-activations as the
        # matmuls give them, F whole (XLA:CPU's live ranges, T5 fully_sharded: two or three
        # f32[2,16,40,1024] an encoder layer, two a decoder layer; two counted), and the layer
        # in hand's backward works on them: they are the F-whole copies counted above.
        "moe_recomputed": recomputed,
        # Unscanned (no loop stacks them) a layer holds two of the six hidden buffers fewer,
        # as a dense layer holds five [B, L, F] of the scanned nine (activation_memory).
        "moe_held_remat": saved - _UNSTACKED_HIDDEN * hidden
        if not recomputed_minimal
        else saved - _MOE_HIDDEN * hidden + recomputed_minimal,
        # Without remat, where the hidden layer is resharded, a layer holds the matmuls'
        # outputs in the kernels' layout (both pre-activations F-whole, and the product's
        # F-whole copy the output matmul reads) in place of two more F-split buffers; its
        # backward's own temporaries then come after the loss's buffers, smaller than them.
        "moe_held": saved - _UNSTACKED_HIDDEN * hidden + held_whole,
        **({"moe_extra_none": 0} if resharded else {}),
        # Unscanned `full` where the attention's recomputation is hoisted (heads split, `embed`
        # whole): an encoder's MoE layer's whole recomputed MLP is held ahead of the decoder's
        # backward too (the dispatched tokens in and out, both pre-activations, the
        # activation and the product; XLA:CPU's live ranges under megatron and
        # expert_parallel alike, though only expert_parallel's holds an all-to-all).
        "moe_hoisted": 2 * dispatched + 4 * hidden,
    }
    # (XLA:TPU's unrolled layers: the same four F-whole buffers, tpu_moe_memory.unscanned_moe)
    return {
        "moe": saved,
        "moe_h": hidden,
        "moe_resharded": resharded,
        # one [E, G, C, D] dispatched tokens buffer (XLA:TPU's recomputed layer: tpu_moe_memory)
        "moe_dispatched": dispatched,
        "moe_capacity": c,  # slots an expert (C) a group
        **work,
    }


_MOE_HIDDEN, _MOE_RECOMPUTED, _RESHARDED_HIDDEN, _UNSTACKED_HIDDEN, _HELD_WHOLE = 6, 1.3, 4, 2, 3


def moe_share(cfg: Any, layers: int) -> float:
    """The fraction of a stack's `layers` layers that are sparse (`moe_every`)."""
    if not getattr(cfg, "num_experts", 0):
        return 0.0
    from t5lite.model.config import is_moe_layer

    return sum(is_moe_layer(cfg, i) for i in range(layers)) / layers


def expert_gradient_bytes(partitioner: Partitioner, cfg: Any) -> int:
    """Per-device bytes of one MoE layer's expert-kernel gradients ([E, D, F] for each input
    kernel, [E, F, D] for the output) as the backward holds them: split over the axes the rules
    give `expert` (tokens travel to the experts: the gradient is local) and over the other
    dimensions' axes that do not carry the batch (parameter_bytes.gradient_bytes)."""
    spec, _ = resolve_logical_axes(("expert", "embed", "expert_mlp"), partitioner.rules)
    mesh = partitioner.mesh.shape
    batch = set(partitioner.batch_axes)
    expert = set(mesh_axes_of(spec[0]))
    axes = [t for e in spec for t in mesh_axes_of(e) if t in mesh]
    split = math.prod(mesh[t] for t in axes if t not in batch or t in expert)
    itemsize = np.dtype(cfg.policy.params).itemsize
    kernels = len(cfg.mlp_activations) + 1
    return kernels * cfg.num_experts * cfg.emb_dim * cfg.mlp_dim * itemsize // split


def local_expert_gradient_bytes(partitioner: Partitioner, cfg: Any) -> int:
    """`expert_gradient_bytes` where the rules put `expert` over every axis that splits the
    batch (tokens travel to the experts: each device's expert gradients are whole sums that
    no all-reduce or reduce-scatter touches, and the update has no reduced copy of them;
    XLA:CPU's buffer assignment, unscanned T5 on data parallel), else 0."""
    spec, _ = resolve_logical_axes(("expert",), partitioner.rules)
    mesh = partitioner.mesh.shape
    batch = {t for t in partitioner.batch_axes if mesh.get(t, 1) > 1}
    local = batch <= set(mesh_axes_of(spec[0]))
    return expert_gradient_bytes(partitioner, cfg) if local and cfg.num_experts else 0


def kernel_splits(partitioner: Partitioner) -> tuple[int, int, int]:
    """How many ways the rules split an expert kernel [E, D, F]'s three dimensions."""
    spec, _ = resolve_logical_axes(("expert", "embed", "expert_mlp"), partitioner.rules)
    mesh = partitioner.mesh.shape
    splits = [math.prod(mesh[t] for t in mesh_axes_of(e) if t in mesh) for e in spec]
    return splits[0], splits[1], splits[2]


def dropless_bytes(
    partitioner: Partitioner, cfg: Any, b: int, length: int, act: int, platform: str
) -> dict[str, int]:
    """`moe_bytes` of dropless dispatch (MoeBlock._dropless).

    Its M = B * L * k (token, choice) rows are sorted by expert globally, so GSPMD holds them
    whole on every device (their features split as the expert kernels' are). A
    layer keeps the sorted inputs [M, D], six [M, F] hidden buffers (both pre-activations,
    the activation, the product and the activation's derivative terms, as capacity's six
    [E, G, C, F]) and the experts' outputs [B, L, k, D] for the combine (XLA:CPU's scan
    carry). Its backward also holds the ragged dots' operands: on CPU JAX lowers
    `ragged_dot(x [M, K], w [E, K, N])` to a broadcast of x to [E, M, K], a select that zeros
    each expert's rows outside its group, and one dot contracting E and K, so the
    transposes of the larger ragged dot (the [E, M, D] masked inputs or the [E, M, F]
    masked hidden layer, E split as the kernels) are materialised four times: the masked
    operand, its transposed copy [M, E * K], the masked cotangent and its copy. XLA's
    grouped ragged dot on TPU and GPU (`chlo.ragged_dot`) builds none of them.
    """
    k = cfg.moe_top_k
    m, d, f = b * length * k, cfg.emb_dim, cfg.mlp_dim

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> int:
        return bytes_per_device(partitioner, axes, shape, act)

    # No constraint names the sorted rows' layout: they take the expert kernels'.
    e_split, d_split, f_split = kernel_splits(partitioner)
    rows, hidden = m * d * act // d_split, m * f * act // f_split
    saved = rows + _MOE_HIDDEN * hidden + of(("batch", None, "embed"), (b, length * k, d))
    masked = smaller = held_masked = larger = packed = 0
    cpu = platform == "cpu"
    if cpu:
        e = cfg.num_experts
        masked = _MASKED_COPIES * max(e * rows, e * hidden) // e_split
        smaller = min(e * rows, e * hidden) // e_split
        # Unscanned without remat, the masked operands of the kernels' gradients depend on
        # forward values only and XLA:CPU builds every layer's ahead of the loss gradient:
        # the rows masked for each of the two input kernels ([E, M, D], twice) and the hidden
        # layer masked for the output kernel ([E, M, F]), held by every MoE layer.
        held_masked = (2 * e * rows + e * hidden) // e_split
        larger = max(e * rows, e * hidden) // e_split
        # Under remat the recomputed hidden layer's four [M, F] live across the masked
        # operands. XLA:CPU's heap places the largest buffers first: with more than one
        # expert a device the masked operands are larger than any [M, F], whose four slots
        # the heap holds beside them though they are not live at the same moment (the live
        # peak is the model's without them: 32 to 48 MiB of heap above it, fully_sharded).
        if cfg.remat_policy != "none" and e > e_split:
            packed = _PACKED_HIDDEN * hidden
    # The backward: the masked operands, the sorted inputs' cotangent and three [M, F]
    # cotangents (both pre-activations', the product's); under remat five [M, F] buffers, the
    # recomputed hidden layer (both pre-activations, the activation, the product) and one
    # cotangent at a time (XLA:CPU's totals under megatron, expert_parallel and fully_sharded).
    return {
        "moe": saved,
        "moe_h": hidden,
        "moe_work": masked + rows + 3 * hidden,
        "moe_rework": masked + rows + 5 * hidden,
        # Unscanned, the last layer's backward holds the smaller ragged dot's masked operands
        # too, two of them, beside the larger one's four.
        "moe_extra": masked + _UNSCANNED_SMALLER_MASKED * smaller + packed,
        "moe_held": saved - _UNSTACKED_HIDDEN * hidden + held_masked,
        # The last layer's backward then masks the pre-activations' cotangents for the input
        # kernels' ragged dots, each with its transposed copy: three more of the larger masked
        # operand, after the loss's buffers are freed.
        "moe_extra_none": _LAST_MASKED * larger,
        # An unscanned `full` recomputation stops at the sorted rows: the ragged dots run
        # inside the layer's backward, beside its masked operands.
        "moe_recomputed": rows,
        # Under remat its hidden layer is not saved (ragged dots are no dots without batch
        # dims) and only partly hoisted ahead of the loss gradient: two [M, F] buffers a layer
        # are held there (fitted on XLA:CPU's totals of megatron, data_parallel and T5
        # expert_parallel `minimal`); where the heap packs four (above), they are among
        # those once the last layer's backward runs (none of them live there: fully_sharded).
        "moe_held_remat": saved - (_MOE_HIDDEN - 2) * hidden,
        "moe_hoisted_remat": 2 * hidden if packed else 0,
        # Where the kernels split F but not D (megatron), each stack's last MoE layer is
        # recomputed under remat ahead of the loss gradient and holds there its three masked
        # forward operands and four [M, F] (both pre-activations, the tanh, the product).
        **({"moe_held_last": held_masked + 4 * hidden} if cpu and d_split == 1 < f_split else {}),
    }


_MASKED_COPIES, _UNSCANNED_SMALLER_MASKED, _LAST_MASKED, _PACKED_HIDDEN = 4, 2, 3, 4
