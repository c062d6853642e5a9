"""What XLA:TPU keeps in HBM for a mixture of experts' layers, run by the layer scan or
unrolled (`memory.predict_memory` on platform "tpu", beside tpu_memory's dense terms).

Read from the TPU compiler's buffer assignment and live ranges (v5e:2x4 ahead of time, the
test-size decoder-only model of `accuracy.accuracy_trainer` with four experts, `expert_parallel`,
`megatron`, `fully_sharded`, capacity and dropless dispatch):
- The scan stacks what each MoE layer saves for its backward over the layers
  (`f32[layers, E, G, C, F]`, five of them for capacity dispatch; the sorted rows and the
  `[M, F]` hidden buffers for dropless) and the backward loop holds them beside the stacked
  gradients it writes (`dynamic-update-slice` into `[layers, E, D, F]` buffers) and one layer's
  working set. They are in the HBM heap (the default memory space's allocations), with the
  dense layers' stacked values and the gradients, which a dense model's keeps in VMEM
  (tpu_memory); on a one-axis mesh only the gradients are, and under `full` not even they
  where they fit the VMEM budget.
- Under `full` the stacks hold each layer's input only; the peak is one layer's recomputed
  values and their cotangents (the largest stack's) beside every gradient, and the
  parameters' prefetched copies; top-1 layers keep those in VMEM.
- Where the rules reshard the hidden layer (fully_sharded), the peak layer holds its hidden
  buffers F-whole as the matmuls give them (`moe_memory`'s `moe_resharded`).
- The MoE layer's kernels (routing, dispatch, the expert matmuls, combine and their
  gradients) add code once per stack: the scan compiles one layer.
- Unrolled (`scan_layers=False`, same dumps): the default memory space holds every gradient
  (the `[E, D, F]` expert kernels', the output layer's and the embedding's), each MoE layer's
  `f32[E, G, C, F]` hidden buffers (tile-padded) and their bf16 copies as the MXU reads them,
  and the `[B, L, D]` values they push out of VMEM; under `full` the parameters' copies as
  scanned. Each unrolled MoE layer adds its own kernels' code, and its small values (flags of
  the async copies between VMEM and HBM, slices, top_k's and the sort's outputs) each take a
  16 KiB slot of the heap, reserved twice as the parameters' scalars are (`moe slots`).
- Top-1 routing (T5's Switch default; a top-1 decoder-only program too) keeps all of it in
  VMEM, scanned or not: 1.5 MiB of temporaries beyond the dense model's scalars for a T5
  whose gradients are 11.5 MiB. Scanned, only the stacked MoE values stay in HBM (without
  remat). Why top-2 spills is not known (not the total: T5's 15 MiB dropless layers stay, a
  decoder-only model's 13 MiB top-2 ones do not); this is what the compiler was seen to do.
  docs/performance.md has the programs, the compiled and predicted totals.
The counts below are fitted (the compiled temporaries less the dense model's terms, less every
gradient), in units of the layer's own buffers (`moe_memory.moe_bytes`): `moe_h`, one expert
hidden buffer ([E, G, C, F] or dropless's [M, F]), and the rest of what the layer saves
(`moe` less six of those: capacity's masks and dispatched tokens, dropless's sorted rows and
combine input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (hidden buffers, other saved buffers, parameter-sized copies) in HBM: per MoE layer without
# remat, per stack under `full` (its one recomputed layer; the copies are of every gradient).
# Fitted on the scanned programs (expert_parallel, megatron, fully_sharded x none/full x
# capacity/dropless, v5e:2x4, fp32, 2026-11-26), beside every gradient: capacity `none` leaves
# 69.4-69.9 MiB for 2 layers of 1.875 MiB hidden buffers (18.6 a layer); dropless `none` 270 /
# 91 MiB (expert_parallel / megatron: hidden 12 / 3 MiB, rows and combine 6 / 6 MiB a layer:
# 10 and 2.6 a layer). Under `full` the peak holds gradient-sized buffers beside the stacked
# gradients (the parameters' prefetched copies, the gradients' partial sums, `[layers, E, D,
# F]`): capacity 44.5 / 22.5 MiB for 13.5 / 6.8 MiB of gradients a device (3.3 of them),
# dropless beyond those 53 / 26 MiB (2.9 hidden buffers and 2.9 rows). The copies are of the
# parameters as the layers read them, in the compute dtype (bf16 compute with fp32 masters,
# expert_parallel capacity `full`: 34.7 MiB of temporaries against fp32's 49.6).
_UNITS = {
    ("capacity", "none"): (18.6, 0.0, 0.0),
    ("capacity", "full"): (0.0, 0.0, 2.3),
    ("dropless", "none"): (10.0, 2.6, 0.0),
    ("dropless", "full"): (2.9, 2.9, 2.3),
}
# Without remat, the share of those values whose dtype follows the compute dtype; the rest is
# fp32 under either policy (the dense layers' stacked `f32[layers, B, L, D]` values) or bf16
# under either (the expert matmuls' operands as the MXU reads them, `bf16[layers, E, G, C,
# D]`). Fitted on bf16 compute with fp32 masters, capacity `none`: the temporaries fall 25.0
# (expert_parallel) and 16.9 MiB (megatron) from fp32's, of 34.9 the fitted values' halving
# takes (0.72, 0.48).
_COMPUTE_DTYPE_SHARE = 0.6
# The MoE layer's code, once a stack (scanned), and its recomputation's share under remat:
# 4.2-5.8 MiB without remat, 5.4-6.9 with (compiled code less the dense twin's, same presets).
CODE_MOE = 5.0 * 2**20
_CODE_MOE_REMAT = 0.2
# Unrolled (scan_layers=False), as _UNITS, beside every gradient: per MoE layer without
# remat, per stack under `full`. Fitted on the decoder-only expert_parallel programs (v5e:2x4,
# fp32, 2026-11-27), gradients 13.5 MiB: capacity `none` leaves 23.9 MiB for 2 layers of
# 1.875 MiB hidden buffers, dropless `none` 125.7 for 2 of 12; capacity `full` 17.3 (1.28
# gradients: the parameters' copies, as scanned but one fewer); dropless `full` beyond those
# 90.5 / 28.1 MiB (expert_parallel / megatron) for one layer's 12 / 3 MiB hidden buffer and
# 6 / 6 MiB of rows.
_UNROLLED_UNITS = {
    ("capacity", "none"): (3.45, 0.0, 0.0),
    ("capacity", "full"): (0.0, 0.0, 0.47),
    ("dropless", "none"): (4.78, 0.0, 0.0),
    ("dropless", "full"): (6.94, 1.21, 0.47),
}
# Those fits less the MoE layers' slots (`_MOE_LAYER_SLOTS`), which they held: 5.5 MiB a layer
# of capacity `none`'s 12 (6.38 hidden buffers), dropless `none`'s 63 (5.24); under `full`
# 11 MiB of the 17.3 (1.28 copies): what is left (0.47 of the gradients) is mostly `[B, L, D]`
# values out of VMEM (four f32[8,128,256] at the expert_parallel and megatron peaks), fitted
# as before. On a one-axis mesh under `full` (data_parallel) the copies keep their fit (1.28
# of the gradients, no slots).
_ONE_AXIS_COPIES = 1.28
# Each unrolled MoE layer's small values (its async copies' flags between VMEM and HBM, its
# dynamic slices' and all-to-alls' tuples and flags, top_k's and the sort's outputs) each take a
# 16 KiB slot in the HBM heap, and `memory_analysis` reserves about as much again beyond the
# buffer assignment (as tpu_memory.ARRAY_SLOTS): 176 slots a layer, twice. Read from the buffer
# assignment of the unrolled decoder-only programs (v5e:2x4, 2 MoE layers, 23 parameter
# arrays): 571-610 16 KiB values above the heap's large ones where the dense rule counts 230,
# and 8.4-9.9 MiB of temporaries beyond the heap (expert_parallel, megatron, fully_sharded,
# capacity, `none` and `full`, fp32 and bf16): 4.8-6.3 MiB a MoE layer beyond ARRAY_SLOTS.
_MOE_LAYER_SLOTS = 2 * 176 * 16 * 2**10
# Each unrolled MoE layer's own kernels (top-2; `moe_code` scales them by routing) and their
# recomputation's share under `full`: expert_parallel capacity 3.3 MiB a layer `none`, 5.0
# `full`, dropless 4.6 (compiled code less the dense model's predicted code).
CODE_MOE_UNROLLED = 3.9 * 2**20
_CODE_UNROLLED_REMAT = 0.27


@dataclass(frozen=True)
class MoeProgram:
    """What `scanned_moe` and `unscanned_moe` read of a train step with MoE layers on TPU.

    `layers`: (count, layer_bytes with `moe_share`) per stack; `remat`: the remat policy;
    `dispatch`: "capacity" or "dropless"; `gradients`: every gradient, unreduced; `copies`: the
    parameters in the compute dtype (what the backward's copies hold under remat); `one_axis`:
    the mesh splits over one axis only; `itemsize`: the activations' (the layer's buffers are
    sized with it); `spill`: the layers' values leave VMEM (`spills`); `top_k`: the
    routing's choices a token; `vmem`: the VMEM budget (tpu_memory.vmem_budget), bytes;
    `f_split`: the rules split the expert kernels' F (`expert_mlp`, Megatron-style: the output
    projection's partial sums are all-reduced);
    `lane_padding`: the expert hidden buffers' bytes in HBM over their elements' (F, the minor
    dimension, padded to 128 lanes)."""

    layers: tuple
    remat: str
    dispatch: str
    gradients: int
    copies: int
    one_axis: bool
    itemsize: int = 4
    spill: bool = True
    top_k: int = 2
    vmem: int = 0
    f_split: bool = False
    lane_padding: float = 1.0


def moe_terms(
    cfg: Any,
    layers: list,
    *,
    gradients: int,
    master_itemsize: int,
    itemsize: int,
    f_split: int,
    one_axis: bool,
    vmem: int,
) -> dict[str, int]:
    """`scanned_moe` or `unscanned_moe` (as `cfg.scan_layers`) of a network config's MoE
    layers: `gradients` every gradient unreduced, in masters of `master_itemsize`; `f_split`
    the ways the rules split the expert kernels' F."""
    f_local = max(1, cfg.mlp_dim // f_split)
    program = MoeProgram(
        layers=tuple(layers),
        remat=cfg.remat_policy,
        dispatch=cfg.moe_dispatch,
        gradients=gradients,
        copies=gradients * itemsize // master_itemsize,
        one_axis=one_axis,
        itemsize=itemsize,
        spill=spills(layers, cfg.moe_top_k, vmem, itemsize),
        top_k=cfg.moe_top_k,
        vmem=vmem,
        f_split=f_split > 1,
        lane_padding=-(-f_local // 128) * 128 / f_local,
    )
    return scanned_moe(program) if cfg.scan_layers else unscanned_moe(program)


def scanned_moe(program: MoeProgram) -> dict[str, int]:
    """HBM a scanned stack's mixture-of-experts layers take on TPU, by term: their stacked
    saved values and one layer's working set (`moe (scanned)`), and every gradient (the
    backward loop's stacked outputs, `stacked gradients`); where the values do not spill,
    only the stacked MoE values are in HBM."""
    layers, remat, dispatch = program.layers, program.remat, program.dispatch
    gradients, copies, itemsize = program.gradients, program.copies, program.itemsize
    spill, one_axis = program.spill, program.one_axis
    if one_axis:
        # On a one-axis mesh (data=8, experts over it) memory-space assignment keeps the
        # stacked values in VMEM (test-size T5, data_parallel capacity `none`: 13.8 MiB of
        # temporaries, none of its 25.2 MiB of stacked MoE values). The gradients stay in HBM
        # where the values spill without remat (decoder-only, capacity `none`: 26.7 MiB of
        # temporaries with 22.5 MiB of gradients); under `full`, with no stacked values
        # beside them, they stay in VMEM up to the budget (the heap of capacity and dropless
        # `full` holds the 8 MiB logits and no gradient: 16.7 and 17.1 MiB of temporaries).
        # Why the two-axis layouts' do not is not known; this is what the compiler was seen
        # to do.
        if remat == "full":
            return {"stacked gradients": max(0, gradients - program.vmem)}
        return {"stacked gradients": gradients} if spill else {}
    if not spill:
        # The gradients stay in VMEM; only the scan's stacked MoE values are in HBM, and
        # under `full` each layer's input alone (test-size T5, expert_parallel capacity
        # `none`: 25.8 MiB of values in HBM for 25.2 saved; megatron `full`: 4.6).
        saved = sum(round(n * a["moe_share"]) * a["moe"] for n, a in layers)
        return {"moe (scanned)": 0 if remat == "full" else saved}
    if remat == "full" and program.top_k == 1:
        # Top-1 layers under `full` keep the recomputed layer and the parameters' copies in
        # VMEM even where their hidden buffers spill without remat; the stacked gradients
        # leave it where they and one recomputed layer's hidden buffer exceed the budget
        # (dropless, expert_parallel: T5's 29.5 MiB of gradients and 8 MiB hidden buffer,
        # the heap holding the `[layers, E, D, F]` gradient stacks and nothing of the
        # layers'; a top-1 decoder-only model's 13.5 and 6 MiB: 10 MiB of temporaries).
        largest = max(a["moe_h"] for n, a in layers if round(n * a["moe_share"]))
        return {"stacked gradients": gradients} if gradients + largest > program.vmem else {}
    units = _UNITS[(dispatch, "full" if remat == "full" else "none")]
    values, recomputed, sparse = 0.0, 0.0, False
    for n, a in layers:
        moe_layers = round(n * a["moe_share"])
        if not moe_layers:
            continue
        sparse = True
        hidden, other = a["moe_h"], max(a["moe"] - 6 * a["moe_h"], 0)
        per = units[0] * hidden + units[1] * other
        if remat == "full":
            # Where the rules reshard the hidden layer (fully_sharded), the recomputed layer's
            # backward holds four bf16 F-whole copies (the kernels' gradient operands, C
            # minor) in place of F-split ones (`moe_resharded`, in bf16 whatever the policy:
            # `bf16[2,16,80,768]` at the fp32 and bf16 peaks alike).
            per += a.get("moe_resharded", 0) * 2 // itemsize
        if remat != "full":  # part of them keeps its dtype whatever the compute dtype
            share = _COMPUTE_DTYPE_SHARE
            per *= (1 - share) * 4 / itemsize + share
            values += per * moe_layers
        else:
            # One recomputed layer at a time: the peak is in the backward of the stack with the
            # largest (an encoder-decoder's encoder; T5 top-2 dropless: three [M, F] hidden
            # buffers and two [M, D] rows of the encoder's layer, 56 MiB, none of the
            # decoder's).
            recomputed = max(recomputed, per)
    if not sparse:
        return {}
    values += recomputed + units[2] * copies
    return {"moe (scanned)": int(values), "stacked gradients": gradients}


def unscanned_moe(program: MoeProgram) -> dict[str, int]:
    """HBM unrolled mixture-of-experts layers take on TPU, by term: nothing where the values
    do not spill (they and the gradients stay in VMEM) or on a one-axis mesh; else each MoE
    layer's values (`moe (unrolled)`, in hidden buffers) or, under `full`, one recomputed
    layer's a stack and the parameters' copies (`recomputed_in_hbm` where F is split), one
    layer's backward's F-whole hidden buffers where the rules reshard them, every gradient,
    and each MoE layer's 16 KiB slots (`moe slots`, not on a one-axis mesh)."""
    layers, remat, dispatch = program.layers, program.remat, program.dispatch
    gradients, copies, itemsize = program.gradients, program.copies, program.itemsize
    spill, one_axis = program.spill, program.one_axis
    if not spill or (one_axis and remat != "full"):
        # On a one-axis mesh (data_parallel) without remat nothing leaves VMEM either: 2 MiB
        # of temporaries beyond the scalars, capacity `none`, for 22.5 MiB of gradients.
        return {}
    units = _UNROLLED_UNITS[(dispatch, "full" if remat == "full" else "none")]
    slots = 0
    if one_axis:  # under `full` the gradients and the copies only (dropless: 45.6 MiB)
        units = (0.0, 0.0, _ONE_AXIS_COPIES)
    else:
        slots = _MOE_LAYER_SLOTS * sum(round(n * a["moe_share"]) for n, a in layers)
    values = 0.0
    for n, a in layers:
        moe_layers = round(n * a["moe_share"])
        if not moe_layers:
            continue
        per = units[0] * a["moe_h"] + units[1] * max(a["moe"] - 6 * a["moe_h"], 0)
        if remat != "full":
            per *= (1 - _COMPUTE_DTYPE_SHARE) * 4 / itemsize + _COMPUTE_DTYPE_SHARE
        values += per * (1 if remat == "full" else moe_layers)
    values += units[2] * copies
    # Where the expert kernels keep `expert_mlp` whole while the hidden layer's rules split it
    # (fully_sharded: `embed` takes `model` first), the layer whose backward is the peak holds
    # its hidden buffers as the matmuls give them, F whole, in place of F-split ones: without
    # remat two in the activations' dtype and four bf16 copies the MXU reads (decoder-only
    # fully_sharded capacity `none`: f32[2,16,80,768] and bf16[2,16,80,768] against the
    # rules' [2,16,80,192]), as many as the F-whole buffers XLA:CPU's backward holds
    # (moe_memory's `moe_resharded`, four); under `full` three of the recomputed layer's bf16
    # copies at once, C minor and padded to 128 lanes whatever the policy (`bf16[2,16,80,768]`
    # at 6 MiB for 3.75 of elements: three at once in the fp32 heap, up to three in the bf16
    # one). Once a program: the other layers' saved values are F-split.
    moe = [a for n, a in layers if round(n * a["moe_share"]) and a.get("moe_resharded", 0)]
    resharded = max((a["moe_resharded"] for a in moe), default=0)
    if remat != "full":
        resharded = resharded // 2 + resharded * 2 // itemsize
    elif resharded:
        a = max(moe, key=lambda a: a["moe_resharded"])
        whole = (a["moe_resharded"] // 4 + a["moe_h"]) // itemsize  # elements, F whole
        c = a.get("moe_capacity", 128)
        resharded = int(3 * whole * 2 * (-(-c // 128) * 128 / c))
    values += resharded
    if remat == "full" and dispatch == "capacity" and not one_axis and not resharded:
        values += recomputed_in_hbm(program)
    out = {"moe (unrolled)": int(values), "stacked gradients": gradients}
    return {**out, "moe slots": slots} if slots else out


def recomputed_in_hbm(program: MoeProgram) -> int:
    """HBM an unrolled capacity layer's recomputation holds under `full` where the rules split
    the expert kernels' F (megatron; the hidden layer as the kernels') and its hidden buffers,
    one a choice, exceed a tenth of the VMEM budget in the activations' dtype: memory-space
    assignment evicts the recomputed forward's values the layer's backward reads later, both
    pre-activations in that dtype and the activation's and the two dispatched tokens' bf16
    copies, tile-padded (decoder-only megatron `full` fp32, v5e:2x4: two `f32[2,16,80,192]`
    at 2.5 MiB, `bf16[2,16,80,192]` at 1.25 and two `bf16[2,16,80,256]` copy-starts' outputs at
    the peak, 8.75 MiB; the same with mlp_dim 1024, F unpadded, and with 8 experts; with bf16
    compute (0.94 MiB buffers) and on expert_parallel (F whole: its recomputed
    `f32[2,16,20,768]` stays in VMEM) none). The rule separates the programs seen; it is not
    the compiler's."""
    if not program.f_split:
        return 0
    moe = [a for n, a in program.layers if round(n * a["moe_share"])]
    if not moe:
        return 0
    a = max(moe, key=lambda a: a["moe_h"])
    if program.top_k * a["moe_h"] <= program.vmem // 10:
        return 0
    hidden = a["moe_h"] * program.lane_padding
    bf16 = 2 / program.itemsize
    return int(2 * hidden + hidden * bf16 + 2 * a.get("moe_dispatched", 0) * bf16)


def spills(layers: list, top_k: int, vmem: int, itemsize: int = 4) -> bool:
    """Whether memory-space assignment takes the MoE layers' values and every gradient out of
    VMEM into HBM: a layer's expert hidden buffers, one a choice (`top_k`) and as fp32,
    exceed a tenth of the VMEM budget (`vmem`, bytes). Seen on v5e, not the compiler's rule:
    top-1 T5 layers of 1.25 and 2 MiB hidden buffers and a top-1 decoder-only one of 0.94
    stay, top-2 decoder-only ones of 1.9 (bf16: 0.9) and more and a top-1 T5 one of 8 spill."""
    return any(
        top_k * a["moe_h"] * 4 // itemsize > vmem // 10
        for n, a in layers
        if round(n * a["moe_share"])
    )


def moe_code(layers: list, remat: str, scanned: bool = True, top_k: int = 2) -> int:
    """Code of the stacks' MoE layers: one layer's kernels a scanned stack, every MoE layer's
    when unrolled; top-1 routing's take two thirds of top-2's (unrolled decoder-only layers
    2.2 and 3.3 MiB: the second choice's dispatch and combine kernels)."""
    scale = (1 + top_k) / 3
    if not scanned:
        moe_layers = sum(round(n * a["moe_share"]) for n, a in layers)
        share = _CODE_UNROLLED_REMAT if remat == "full" else 0
        return int(moe_layers * CODE_MOE_UNROLLED * scale * (1 + share))
    stacks = sum(1 for n, a in layers if round(n * a["moe_share"]))
    return int(stacks * CODE_MOE * scale * (1 + (_CODE_MOE_REMAT if remat == "full" else 0)))
