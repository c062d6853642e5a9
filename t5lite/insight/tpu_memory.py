"""What XLA:TPU keeps for the train step's backward, by kind, and the code it loads into HBM
(`memory.predict_memory` on platform "tpu" sums them with the state, batch and gradients).

The TPU compiler differs from XLA:CPU's (activation_memory.py) in the ways that size the step:
- Dots run in the compute dtype (the MXU takes bf16), so a bf16 policy's activations are bf16.
- Elementwise work is fused into the dots' prologues and epilogues, forward and backward: what a
  layer saves for its backward is the output of its dots and norms, not the elementwise values
  between them (read from `--xla_dump_to`'s buffer assignment and live ranges, v5e ahead of
  time, the test-size T5 of `accuracy.accuracy_trainer`). Per block the norm's output; per
  attention q and the context, keys and values once, the fp32 logits once (the softmax is
  recomputed from them in the backward's fusion); the MLP's pre-activations (one per input
  projection: two for a gated MLP).
- The gradient all-reduce runs in place and the optimizer's update is fused into the write of
  the donated state: no parameter-sized update buffer.
- Without remat the peak is at the loss gradient: every layer's saved values, the fp32 logits
  and their cotangent. Gradients accumulate as the backward frees the saved values. Under
  remat the peak is inside the backward: the scheduler overlaps the stacks' backward passes, so
  one recomputed layer of each stack is live beside every layer's saved inputs, and under FSDP
  every layer's weights gathered again for the recomputation (live-range dumps, `full`; a
  scanned stack's loop gathers the layer in hand's only: `gathered_layer_bytes`).
- Memory-space assignment moves the peak's values into the core's VMEM (on chip, not counted
  in HBM) while they fit, the loss's logits and cotangent first: up to a budget of a quarter of
  VMEM (`VMEM_SHARE`, `vmem_budget`; a megacore keeps more in HBM: `backward`), which holds
  every activation of the test-size models on v5e (their temporaries are the same in fp32 and
  bf16, with remat and without); what overflows it stays in HBM (T5.1.1-small's sizes:
  hundreds of MiB). Gradients on their way through the
  all-reduce (operands in `S(1)` in the compiled HLO) stay on chip up to the same budget.
- Each parameter array leaves scalars in HBM (its finiteness check, the flags of its
  prefetches and all-reduce), each in its own 16 KiB-aligned slot, and `memory_analysis`
  reserves about as much again beyond the buffer assignment: `ARRAY_SLOTS` a parameter array
  (buffer assignment of the test-size decoder-only model on v5e, Megatron: 290 scalars over
  3.7 MiB, 21 arrays, and 3.4 MiB of temporaries beyond it).
- The executable itself lives in HBM and `memory_analysis` counts it (`generated_code`):
  unrolled layers each add their own kernels, FSDP's gathers and reduce-scatters theirs.
"""

from __future__ import annotations

from t5lite.insight.hardware import tensor_cores_per_device, vmem_bytes_of_kind

# Saved per layer without remat (see above), in units of the layer dict's buffers
# (memory.layer_bytes).
_X_PER_BLOCK, _Q_PER_ATTENTION, _KV, _SCORES = 1, 2, 1, 1
# The loss at its gradient: fp32 logits and their cotangent.
_LOSS_BUFFERS = 2
# Generated code in HBM: a fixed part (the loss, the embedding, the optimizer's fused updates)
# and each unrolled block's kernels (forward and backward); remat adds the recomputation's.
# Measured on v5e ahead of time (libtpu): test-size T5 (10 blocks) 14.6 MiB, decoder-only
# (4 blocks) 9.6 MiB, megatron, no remat; `full` 1.1-1.4 MiB more on 10 blocks.
_CODE_FIXED = 6.25 * 2**20
_CODE_PER_BLOCK = 0.85 * 2**20
_CODE_REMAT = 0.1  # the recomputation's share of a block's code under remat
# FSDP: each block's weight gathers and gradient reduce-scatters (twice under remat: the
# recomputation gathers again); test-size T5 18.8 / 22.5 MiB (`none` / `full`) against
# megatron's 14.6 / 16.0.
_CODE_GATHERED_BLOCK = 0.4 * 2**20
# The same four constants on other generations, by device kind (fixed, per block, remat share,
# per gathering block), and each context-parallel attention's key/value gathers and their
# gradients' reduce-scatters a pass (v5e: within the gathering block's). v5p (v5p:2x2x2 ahead
# of time, bf16): test-size T5 megatron `none` 13.84 MiB (10 blocks), decoder-only 7.8-8.0
# (4 blocks), `full` 0.5-0.8 more; FSDP's and the 2D layouts' gathers 0.0-0.5 more on 4
# blocks (v5e: 0.4 a block); context parallelism's 2 attentions 3.0 more (`none`), 3.5 (`full`).
_CODE_BY_KIND = {"TPU v5": (3.94 * 2**20, 0.99 * 2**20, 0.15, 0.025 * 2**20, 0.75 * 2**20)}
# A ring attention step's kernels, a pass: fitted on v5e ahead of time, the test-size
# decoder-only ring (2 layers, 4 devices on the ring, fp32): 5.3 MiB more executable than the
# model's blocks without remat, 8.2 under `full`; v5p's, by device kind (v5p:2x2x2, the same
# programs: 7.7 and 10.3 MiB more code than its blocks').
_CODE_RING_STEP = 0.44 * 2**20
_CODE_RING_STEP_BY_KIND = {"TPU v5": 0.6 * 2**20}
# A ring step's small values a pass (its permutes' tuples and flags, its softmax's finiteness
# checks) each take a 16 KiB slot of their own in the HBM heap, and `memory_analysis` reserves
# about as much again beyond the buffer assignment: 20 slots a step a pass, twice (v5p:2x2x2's
# buffer assignment of the test-size decoder-only ring, fp32: 493 slots without remat, 644
# under `full`, Megatron's program 263; temporaries beyond the heap 12.8 / 11.5 MiB, 4.4).
_RING_STEP_SLOTS = 2 * 20 * 16 * 2**10
VMEM_SHARE = 0.25
# HBM a parameter array takes in scalar slots and the reserve beside them (module docstring).
ARRAY_SLOTS = 20 * 16 * 2**10
# A scanned stack's layer arrays leave more scalar slots in its loops (the forward and backward
# scans' slice indices and their copies' flags): 6 of 16 KiB a stacked array, fitted on the
# scanned test-size programs on v5e (decoder-only, 9 stacked arrays: 1.4-2.2 MiB of
# temporaries beyond ARRAY_SLOTS' under megatron, FSDP, fully sharded and data parallel, fp32
# and bf16; T5, 23: 1.5 megatron `none` fp32, 2.7 FSDP `full` bf16).
LOOP_SLOTS = 6 * 16 * 2**10
# Code per block at T5.1.1-small's sizes (8x the test-size [B, L, D] a device): 4.2 MiB a T5
# block, 5.6 an FSDP decoder-only one; growth exponent 0.8 (fitted on those two programs,
# which it leaves 6-10% under).
_CODE_ELEMENTS = 8 * 128 * 256
_CODE_GROWTH = 0.8

KINDS = ("attention", "mlp", "norms+residual", "logits+loss")


def saved(a: dict[str, int], remat: str) -> dict[str, int]:
    """What one layer keeps for its backward on TPU under a remat policy, by kind."""
    n = a["attentions"]
    if remat == "full":
        return {"norms+residual": a["x"]}  # the layer input; the rest is recomputed
    if remat == "minimal":  # outputs of dots without batch dims (projections) + the input
        return {
            "attention": n * (a["q"] + a["x"]) + a["kv"],
            "mlp": a["mlp_in"] * a["h"],
            "norms+residual": a["x"],
        }
    return {
        "attention": _Q_PER_ATTENTION * n * a["q"]
        + _KV * a["kv"]
        + a["kv_gathered"]
        + _SCORES * a["scores"],
        "mlp": a["moe"] or a["mlp_in"] * a["h"],
        # The norm's output as the block's dots read it: gathered over whatever splits
        # activations' `embed` or `length` (2D activations, fully sharded).
        "norms+residual": _X_PER_BLOCK * (n + 1) * a["x_gathered"] + a["sp_gathered"],
    }


def _add(*parts: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def vmem_budget(device_kind: str) -> int:
    """Bytes of VMEM the model lets memory-space assignment give the peak's values on one
    device: a quarter of a core's VMEM, divided by the TensorCores the device spans (a v5p or
    v4 megacore: 2). Fitted, not the compiler's rule (the assignment is cost-driven): on a
    megacore it sizes what of the gradients stays on chip at the update; the backward's
    values have their own split there (`backward`'s `device_kind`)."""
    cores = tensor_cores_per_device(device_kind)
    return int(VMEM_SHARE * vmem_bytes_of_kind(device_kind)) // cores


def _in_hbm(values: dict[str, int], vmem: int) -> tuple[dict[str, int], int]:
    """What of one moment's `values` overflows the VMEM budget (the loss's first: it is the
    shortest-lived), and the bytes held in VMEM."""
    out, left = dict(values), vmem
    for k in ("logits+loss", *(k for k in out if k != "logits+loss")):
        moved = min(left, out.get(k, 0))
        out[k] = out.get(k, 0) - moved
        left -= moved
    return out, vmem - left


def _pinned(a: dict[str, int], remat: str) -> dict[str, int]:
    """What of one layer's saved values a megacore's memory-space assignment leaves in HBM:
    each attention's fp32 logits and the MLP's pre-activations (v5p:2x2x2's buffer assignment,
    decoder-only Megatron `none`: both layers' in HBM in bf16, the logits and two of four
    pre-activations in fp32; q, keys, values, the context and the norms' outputs in VMEM)."""
    if remat == "full":
        return {}
    scores = _SCORES * a["scores"] if remat == "none" else 0
    return {"attention": scores, "mlp": a["moe"] or a["mlp_in"] * a["h"]}


def _moment_in_hbm(
    values: dict[str, int], pinned: dict[str, int], vmem: int
) -> tuple[dict[str, int], int]:
    """`_in_hbm` of one moment's `values` of which `pinned` (a part of them) stays in HBM."""
    rest = {k: v - pinned.get(k, 0) for k, v in values.items()}
    out, held = _in_hbm(rest, vmem)
    return _add(out, pinned), held


def backward(
    layers: list,
    remat: str,
    logits: int,
    vmem: int,
    gathered: int = 0,
    arrays: int = 0,
    device_kind: str = "",
    casts: int = 0,
    ring_steps: int = 0,
    *,
    scanned: bool = False,
    itemsize: int = 4,
    stacked: int = 0,
    held: int = 0,
):
    """The backward's peak temporaries in HBM by kind, and its terms: the larger of two moments,
    each beyond what VMEM holds (`vmem`: the budget, bytes): the loss gradient (every layer's
    saved values and the loss's buffers) and, under `full`, inside the backward (the saved
    values, one recomputed layer of each stack and (FSDP) the gathered weights, `gathered`:
    every unrolled layer's, a scanned stack's one layer (`parameter_bytes.gathered_layer_bytes`);
    the loss's buffers are gone by then); and each of the `arrays` parameter arrays' scalar
    slots.
    On a megacore `device_kind` (v5p) the logits, the attentions' fp32 logits and the MLPs'
    pre-activations stay in HBM (`_pinned`) and the rest has a whole core's budget; so do,
    where FSDP gathers the weights (`gathered`), the parameters' shards cast to the compute
    dtype (`casts`: their bytes, 0 when the masters are the compute dtype): the gathers'
    operands, kept for the backward's (v5p:2x2x2, decoder-only fully sharded, fp32 masters,
    `none` and `full`: every layer's bf16 shards live from their layer's forward to its
    backward; Megatron's and context parallelism's casts are fused into their dots; v5e keeps
    them in VMEM at test sizes). `ring_steps`: the ring attentions' steps compiled as their
    own kernels (`ring_slots`). `scanned`: the layers are scanned (on a megacore:
    `scanned_megacore`, the ring's too, but for context parallelism without remat, whose heap
    reuses the stacks' space for the logits: v5p:2x2x2, decoder-only, `none` bf16, 12.6 MiB of
    stacks in a 19.4 MiB heap, which the split below predicts within 10%; under `full` the
    stacks are the layers' inputs, beside the logits); `itemsize`: the compute dtype's bytes
    (what a scanned stack's residuals take); `stacked`, `held`: `scanned_megacore`'s."""
    megacore = tensor_cores_per_device(device_kind) > 1
    context = any(a["kv_gathered"] * (remat != "full") for _, a in layers)
    if scanned and megacore and not context:
        return scanned_megacore(layers, remat, logits, itemsize, arrays, ring_steps, stacked, held)
    kept = _add(*(saved(a, remat) for n, a in layers for _ in range(n)))
    # `minimal` recomputes only elementwise work, which the backward's fusions do anyway: its
    # peak stays at the loss gradient (test-size T5 megatron: 14.6 MiB of temporaries, `none`
    # 14.3).
    work = _add(*(saved(a, "none") for _, a in layers)) if remat == "full" else {}
    loss = {"logits+loss": _LOSS_BUFFERS * logits}
    regathered = {"gathered weights": gathered} if remat == "full" and gathered else {}
    pinned, pinned_inside = {}, {}
    if megacore:
        vmem = int(VMEM_SHARE * vmem_bytes_of_kind(device_kind))
        pinned = _add(
            {"logits+loss": logits}, *(_pinned(a, remat) for n, a in layers for _ in range(n))
        )
        pinned_inside = _add(*(_pinned(a, "none") for _, a in layers)) if remat == "full" else {}
        if casts and gathered:
            pinned, pinned_inside = (
                _add(p, {"cast weights": casts}) for p in (pinned, pinned_inside)
            )
    values, held = _moment_in_hbm(_add(loss, kept), pinned, vmem)
    if remat == "full":
        inside, held_inside = _moment_in_hbm(
            {**_add(kept, work), **regathered}, pinned_inside, vmem
        )
        if sum(inside.values()) > sum(values.values()):
            values, held = inside, held_inside
    if any(a["ring_steps"] for _, a in layers):
        values["ring attention"] = ring_in_hbm(layers, remat)
        values["ring slots"] = ring_slots(ring_steps, remat)
    values["parameter scalars"] = arrays * ARRAY_SLOTS
    terms = (
        ("saved activations", sum(kept.values())),
        ("layer working set", sum(work.values())),
        ("loss temporaries", loss["logits+loss"]),
        ("held in VMEM", held),
        ("parameter scalars", values["parameter scalars"]),
    )
    return values, terms


# What a scanned layer's forward scan stacks for its backward beyond `saved`'s values, on a
# megacore, without remat (v5p:2x2x2's buffer assignment of the test-size scanned decoder-only
# model; the stacks are the scan's residuals as JAX saves them, which XLA cannot fuse into the
# backward across the loop): each norm's input, as the norm holds it (split like the
# residual stream), in fp32 three times (upcast, normalised, scaled; twice where the compute
# dtype is fp32 and the upcast is the input itself), each attention's probabilities in the
# compute dtype beside its fp32 logits, and per MLP input projection two more pre-activation
# sized values, three with gelu (the activation's intermediates: six `[B, L, F]` stacks a
# decoder-only layer's gated SiLU, eight a T5 layer's gated gelu, not two).
_NORM_FP32_STACKS, _MLP_STACKS_PER_INPUT = 3, 2


def scanned_stacks(a: dict[str, int], remat: str, itemsize: int) -> dict[str, int]:
    """What one scanned layer's forward scan stacks for its backward on a megacore, by kind
    (`itemsize`: the compute dtype's bytes): `saved`'s values and, without remat, the
    residuals the unrolled program fuses away (`_NORM_FP32_STACKS`, `_MLP_STACKS_PER_INPUT`)."""
    out = saved(a, remat)
    if remat != "none":
        return out
    n = a["attentions"]
    fp32_copies = _NORM_FP32_STACKS - (itemsize >= 4)
    norm_fp32 = fp32_copies * a["x"] * 4 // itemsize
    return _add(
        out,
        {
            "attention": _SCORES * a["scores"] * itemsize // 4,
            "mlp": (_MLP_STACKS_PER_INPUT + a["gelu"]) * a["mlp_in"] * a["h"],
            "norms+residual": (n + 1) * norm_fp32,
        },
    )


# Sequence parallelism's loss on a megacore: the targets' comparison with the vocabulary's iota
# materialised in int32, logits-sized, and its all-to-all's output, beside the fp32 logits
# (v5p:2x2x2's buffer assignment of the test-size scanned decoder-only model, `full` bf16:
# `s32[8, 32, 4, 2048]` twice, 8 MiB each, live with the logits at the loss).
_SP_LOSS_COPIES = 2


def held_logits(layers: list, logits: int, encoder_decoder: bool, params_split: bool) -> int:
    """Bytes of the logits-sized value an encoder-decoder's scanned step holds on a megacore from
    the loss gradient to the logits' kernel's gradient, which the scheduler puts after both
    stacks' backward (`logits`: the fp32 logits' bytes): where the parameters are split over
    the batch's axes (FSDP, fully sharded: the kernel's gradient is reduce-scattered there) the
    logits' cotangent in bf16, where only activations' `embed` is split (2D activations) the
    fp32 logits; none elsewhere (v5p:2x2x2's buffer assignments of the test-size scanned T5,
    every FSDP and fully sharded program, `none` and `full`, fp32 and bf16: `bf16[8, 64,
    2048]`, 2 MiB, live from the loss to the kernel's gradient; 2D activations `none`:
    `f32[8, 64, 2048]`; Megatron bf16, sequence and context parallelism and the decoder-only
    model: none)."""
    if not encoder_decoder:
        return 0
    if params_split:
        return logits // 2
    return logits if any(a["embed_split"] for _, a in layers) else 0


def scanned_megacore(
    layers: list,
    remat: str,
    logits: int,
    itemsize: int,
    arrays: int,
    ring_steps: int = 0,
    stacked: int = 0,
    held: int = 0,
):
    """`backward` for scanned layers on a megacore (v5p), by kind, and its terms: every layer's
    stacks (`scanned_stacks`) in HBM, beside the fp32 logits (and the logits-sized value `held`
    through the backward: `held_logits`), the parameter arrays' scalar slots and a ring's own
    buffers and its `ring_steps`' slots (`ring_in_hbm`, `ring_slots`), each in heap space of
    its own, and the heap's fragmentation (its extent less the bytes live at its peak, the
    larger of one stack's residuals with the ring's buffers and the logits; under `full`,
    inside the backward, with `held`), which `memory_analysis` counts again beyond the HLO
    temp allocation (libtpu's log at `TPU_MIN_LOG_LEVEL=0`: "HLO temp ... fragmentation").
    Read from v5p:2x2x2's buffer assignments of the test-size scanned models (decoder-only
    megatron, FSDP and fully sharded and the ring, T5; `none` and `full`, fp32 and bf16): the
    logits sit above the stacks though they live after them (the logits' kernel's fp32
    gradient reuses their space), and the slots above both; under sequence parallelism the
    loss holds `_SP_LOSS_COPIES` more logits-sized buffers. The `stacked` parameter arrays'
    loop slots (`LOOP_SLOTS`) are the residual stacks' (their loops' indices and flags): none
    under `full`, whose stacks are the layers' inputs (the slots above the heap's values shrink
    by 1.0-1.3 MiB from `none` to `full` on the decoder-only model, LOOP_SLOTS' 0.84; T5 2.9,
    2.16)."""
    per_stack = [_add(*(scanned_stacks(a, remat, itemsize) for _ in range(n))) for n, a in layers]
    stacks = _add(*per_stack)
    logits *= 1 + _SP_LOSS_COPIES * any(a["sp_gathered"] for _, a in layers)
    kept = sum(stacks.values())
    ring = ring_in_hbm(layers, remat) if ring_steps else 0
    slots = arrays * ARRAY_SLOTS + ring_slots(ring_steps, remat)
    loop = 0 if remat == "full" else stacked * LOOP_SLOTS
    peak = max(logits, *(sum(p.values()) + ring for p in per_stack))
    peak += held if remat == "full" else 0
    values = _add(stacks, {"logits+loss": logits + held})
    if ring_steps:
        values["ring attention"] = ring
        values["ring slots"] = ring_slots(ring_steps, remat)
    values["fragmentation"] = kept + logits + held + ring + slots - peak
    values["parameter scalars"] = arrays * ARRAY_SLOTS + loop
    terms = (
        ("saved activations", kept),
        ("layer working set", 0),
        ("loss temporaries", logits + held),
        ("heap fragmentation", values["fragmentation"]),
        ("parameter scalars", arrays * ARRAY_SLOTS),
        ("loop scalars", loop),
    )
    return values, terms


def ring_in_hbm(layers: list, remat: str) -> int:
    """Ring attention's own buffers, in HBM whatever the VMEM budget (v5e's buffer assignment of
    the test-size decoder-only ring, fp32: its fp32 key/value chunks and stacked keys and
    values live across the ring's steps, in HBM beside VMEM's free space), at their peak, the
    first layer differentiated: every layer's custom_vjp residuals (one layer's, recomputed,
    under `full`) and that layer's ring in flight (`memory.layer_bytes`)."""
    residuals = [a["ring_saved"] * (1 if remat == "full" else n) for n, a in layers]
    return (max(residuals) if remat == "full" else sum(residuals)) + max(
        a["ring_flight"] for _, a in layers
    )


def ring_slots(steps: int, remat: str) -> int:
    """HBM the ring's `steps` (compiled as their own kernels) take in small values' slots,
    whatever the moment: each step's forward and backward pass, and under `full` its forward
    again (`_RING_STEP_SLOTS`)."""
    return steps * (2 + (remat == "full")) * _RING_STEP_SLOTS


def ring_update(backward: dict, gradients: int, largest: int, device_kind: str) -> dict:
    """What a ring layout's update holds in HBM on a megacore `device_kind` (empty elsewhere),
    by kind: the gradients beyond VMEM (`gradients`, bytes) and the all-reduce's output of the
    `largest` gradient, written beside its operand ("reduced copy"), beside the slots that
    live through the step (`backward`'s). Read from v5p:2x2x2's buffer assignment of the
    test-size decoder-only ring, fp32: the logits' kernel and the embedding's fp32 gradients,
    `[256, 8192]` and `[8192, 256]` with the vocabulary replicated, in HBM at the update, the
    former's reduced copy in a third 8 MiB buffer, the layers' gradients in VMEM; v5e keeps
    them all in VMEM. Scanned, the heap's fragmentation (`scanned_megacore`) is counted
    whichever moment is the peak."""
    if tensor_cores_per_device(device_kind) < 2:
        return {}
    kept = ("parameter scalars", "ring slots", "fragmentation")
    slots = {k: backward[k] for k in kept if k in backward}
    return {"gradients": gradients, "reduced copy": largest, **slots}


def gathers_in_blocks(layers: list, fsdp: bool) -> bool:
    """Whether every block runs collectives of its own (their kernels are code per block):
    FSDP's weight gathers (`fsdp`), a split `embed`'s activation gathers and reduce-scatters
    (the 2D layouts), sequence parallelism's, context parallelism's gathered keys and values."""
    return fsdp or any(a["embed_split"] or a["sp_gathered"] or a["kv_gathered"] for _, a in layers)


def code_bytes(
    blocks: list[tuple[int, int]],
    remat: str,
    gathered: bool = False,
    ring_steps: int = 0,
    device_kind: str = "",
    cp_attentions: int = 0,
) -> int:
    """Bytes of the TPU executable. `blocks`: (count, elements) per stack, `count` the blocks
    compiled as their own kernels (every block of unrolled layers, one layer's per stack when
    scanned), `elements` a block's per-device [B, L, D] activation; `gathered`: each block
    gathers and reduce-scatters (`gathers_in_blocks`); `ring_steps`: the ring attentions'
    steps compiled as their own kernels (each step's permutes and block attention, forward,
    backward and, under `full`, the forward again); `device_kind`: the chip (v5e's figures
    where `_CODE_BY_KIND` has none); `cp_attentions`: the attentions compiled as their own
    kernels that gather keys and values (context parallelism)."""
    remat_on = remat == "full"  # `minimal` recomputes only what is fused anyway
    fixed, block, remat_share, gathering, cp = _CODE_BY_KIND.get(
        device_kind, (_CODE_FIXED, _CODE_PER_BLOCK, _CODE_REMAT, _CODE_GATHERED_BLOCK, 0)
    )
    total = fixed + cp_attentions * cp * (2 + remat_on)
    for count, elements in blocks:
        # Kernels unroll over their tiles: a block's code grows with its activations beyond
        # the test-size models' (_CODE_ELEMENTS) sublinearly (_CODE_GROWTH, T5.1.1-small).
        scale = max(1.0, elements / _CODE_ELEMENTS) ** _CODE_GROWTH
        per_block = block * scale * (1 + (remat_share if remat_on else 0))
        per_block += gathering * (1 + remat_on) if gathered else 0
        total += count * per_block
    ring_step = _CODE_RING_STEP_BY_KIND.get(device_kind, _CODE_RING_STEP)
    total += ring_steps * ring_step * (2 + remat_on)
    return int(total)
