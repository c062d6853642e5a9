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


def _tree_bytes_per_device(tree: Any, min_itemsize: int = 0) -> int:
    """Bytes of one device's shards of a tree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * max(np.dtype(x.dtype).itemsize, min_itemsize)
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


def _sequence_layout(partitioner: Partitioner) -> tuple[bool, bool]:
    """(sequence parallel, context parallel): whether the rules split activations' `length`
    and the blocks' features over the same mesh axes (Megatron-3's layout, where
    `collectives.sequence_parallel_gather` gathers each block's input), or split `length` and keep
    `kv_length` whole (`collectives.context_parallel_attention` gathers keys and values)."""

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


def activation_itemsize(cfg: Any, platform: str) -> int:
    """Bytes an activation element takes in the compiled step on `platform`.

    XLA:CPU has no bf16 or fp16 matmul: it converts their operands to fp32, and since excess
    precision is allowed by default (`--xla_allow_excess_precision`) the algebraic simplifier
    then drops the round trips back to the compute dtype, so every activation is stored fp32
    (docs/performance.md, "bf16 on XLA:CPU"). TPUs and GPUs keep the compute dtype.
    """
    compute = np.dtype(cfg.policy.compute).itemsize
    return max(compute, 4) if platform == "cpu" else compute


def _platform(trainer: Trainer) -> str:
    return str(trainer.partitioner.mesh.devices.flat[0].platform)


def _layer_bytes(
    partitioner: Partitioner, cfg: Any, b: int, q_len: int, kv_lens: list[int], act: int
):
    """Per-device bytes of one layer's activations (`act` bytes an element): {name: bytes} by
    logical layout."""
    h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def of(axes: tuple[str | None, ...], shape: tuple[int, ...], itemsize: int = act) -> int:
        return _bytes_per_device(partitioner, axes, shape, itemsize)

    x_gathered = of(("batch", None, None), (b, q_len, cfg.emb_dim))
    sp, cp = _sequence_layout(partitioner)
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
        "x_gathered": x_gathered,
        "q": of(("batch", "length", "heads", "kv"), (b, q_len, h, k)),
        "kv": sum(2 * of(("batch", "length", "kv_heads", "kv"), (b, s, g, k)) for s in kv_lens),
        # NOTE: attention logits and probabilities are fp32 whatever the activation dtype.
        "scores": sum(of(("batch", "heads", "length", None), (b, h, q_len, s), 4) for s in kv_lens),
        "h": of(("batch", "length", "mlp"), (b, q_len, cfg.mlp_dim)),
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


# Buffers of each shape that the CPU compiler keeps per layer without remat, read from XLA's
# buffer assignment (`--xla_dump_to`) on the scanned models of tests/test_insight_accuracy.py
# and checked on longer sequences (docs/performance.md has the figures). Per block: the input,
# the norm's output, the block's output before its reduction and the residual sum; per
# attention, q and the context; keys and values once; the MLP's pre-activations, activation,
# gated product and their cotangents. The [B, H, L, L] fp32 attention scores: every layer
# keeps two (logits, probabilities); the layer being differentiated three more (their
# cotangents and the softmax's temporaries).
_X_PER_BLOCK, _Q_PER_ATTENTION, _KV, _HIDDEN = 4, 2, 1, 9
_SCORES_SAVED, _SCORES_WORKING = 2, 3
# The loss: logits and softmax probabilities (their cotangent reuses the logits' buffer).
_LOSS_BUFFERS = 2
# Unscanned layers (`scan_layers=False`): no loop carries stacked copies of each layer's
# values, so a layer keeps fewer [B, L, D] and [B, L, F] buffers (3 a block, 5 of the MLP's);
# and the backward's peak is at the loss gradient, with the logits, their softmax and
# cotangent and three [B, L, D] buffers of the last layer live beside every layer's saved
# values. Fitted on the CPU compiler's totals over FSDP configurations of both families
# (2 to 4 layers, several widths and lengths). Remat: under FSDP the scheduler hoists every
# layer's recomputation ahead of the loss gradient (no loop orders it), so the recomputed
# values are live together and the only saving is the [B, H, L, S] scores, which the
# recomputation fuses away; other layouts hoist less (_unscanned_backward).
_UNSCANNED_X_PER_BLOCK, _UNSCANNED_HIDDEN, _UNSCANNED_LOSS_BUFFERS, _UNSCANNED_LAST_X = 3, 5, 3, 3
# T5.1.1's gated GELU (tanh form): six [B, L, F] buffers of a layer of each stack at the loss
# gradient, whatever the depth and the remat policy (between 2 and 4 layers a stack, the
# part of XLA's figure that does not grow with depth is the same under every policy).
_UNSCANNED_GELU_HIDDEN = 6

# Kinds of activation a report breaks the total into (they add up to `activations`).
KINDS = ("attention", "mlp", "norms+residual", "logits+loss")


def _saved(a: dict[str, int], remat: str, scores: int | None = None) -> dict[str, int]:
    """What one layer keeps for its backward pass under a remat policy, by kind (`scores`: how
    many [B, H, L, L] buffers without remat; default: those every layer keeps)."""
    n = a["attentions"]
    if remat == "full":
        return {"norms+residual": a["x"]}  # the layer input; everything else is recomputed
    if remat == "minimal":  # outputs of dots without batch dims (projections) + the input
        return {
            "attention": n * (a["q"] + a["x"]) + a["kv"],  # q, k, v and the out projection
            "mlp": a["mlp_in"] * a["h"],
            "norms+residual": 2 * a["x"],
        }
    return {
        "attention": _Q_PER_ATTENTION * n * a["q"]
        + _KV * a["kv"]
        + a["kv_gathered"]
        + (_SCORES_SAVED if scores is None else scores) * a["scores"],
        "mlp": _HIDDEN * a["h"],
        "norms+residual": _X_PER_BLOCK * (n + 1) * a["x"] + a["sp_gathered"],
    }


def _saved_unscanned(
    a: dict[str, int],
    remat: str,
    hoisted: str = "all",
    scores_held: bool = False,
    hidden: int = _UNSCANNED_HIDDEN,
) -> dict[str, int]:
    """What one unscanned layer holds at the loss gradient, by kind (see above). Under `full`,
    `hoisted` says how much of the layer's recomputation XLA:CPU's scheduler has moved ahead
    of the loss gradient: "all", "attention" or "none" (_unscanned_backward says where);
    under `minimal`, `scores_held` whether the recomputed attention logits and probabilities
    are among it; `hidden`: how many [B, L, F] buffers it holds."""
    n = a["attentions"]
    if remat == "full" and hoisted == "none":
        return {"norms+residual": a["x"]}  # the layer's input, recomputed from after the loss
    if remat == "full" and hoisted == "attention":
        # Megatron: each layer's attention is recomputed ahead of the loss gradient (its
        # input, three more [B, L, D] buffers, q, k, v and both score buffers live at the
        # peak), its MLP, behind the out projection's all-reduce, is not.
        return {
            "attention": _Q_PER_ATTENTION * n * a["q"] + _KV * a["kv"] + 2 * a["scores"],
            "norms+residual": 4 * a["x"],
        }
    scores = _SCORES_SAVED * a["scores"] if remat == "none" or scores_held else 0
    # Sequence parallelism gathers each block's input (collectives.sequence_parallel_gather),
    # and those whole-length copies are live with the rest at the loss gradient whatever the
    # policy.
    gathered = a["sp_gathered"]
    return {
        "attention": _Q_PER_ATTENTION * n * a["q"] + _KV * a["kv"] + scores,
        "mlp": hidden * a["h"],
        "norms+residual": _UNSCANNED_X_PER_BLOCK * (n + 1) * a["x"] + gathered,
    }


def _recomputed(a: dict[str, int]) -> dict[str, int]:
    """One unscanned layer's `full` recomputation as it stands before its backward, by kind
    (XLA:CPU's buffer assignment): each block's gathered matmul input, the input and its
    norm's output, q (per attention), k and v, the logits and probabilities, the MLP's two
    pre-activations and their product. On megatron (heads split, `embed` whole) the
    attention's recomputation runs apart from the MLP's, and nothing is fused across blocks:
    each block's norm output is kept in both its layouts ([B, L, D] and the matmul's
    [B * L, D]), the residual sums and each attention's context are buffers of their own, and
    so is the GELU's tanh."""
    n = a["attentions"]
    if a["heads_split"] and not a["embed_split"]:
        return {
            "attention": 2 * n * a["q"] + a["kv"] + 2 * a["scores"],
            "mlp": (3 + a["gelu"]) * a["h"],
            "norms+residual": 2 * (n + 1) * a["x"] + (n + 1) * a["x"],
        }
    return {
        "attention": n * a["q"] + a["kv"] + 2 * a["scores"],
        "mlp": 3 * a["h"],
        "norms+residual": (n + 1) * a["x_gathered"] + 2 * a["x"],
    }


# Unscanned `full`, inside a stack's backward: every layer of that stack is recomputed and
# live (hoisted ahead of its first layer's backward), and the layer being differentiated adds
# the cotangents of its recomputed values and the matmuls' gradient temporaries,
# _RECOMPUTED_WORKING times its recomputed values (fitted on XLA:CPU's compiled totals of the
# layouts that recompute after the loss gradient, 2 to 6 layers).
_RECOMPUTED_WORKING = 1.5


def _add(*parts: dict[str, int], scale: float = 1) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for part in parts:
        for k, v in part.items():
            out[k] += int(v * scale)
    return out


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """An analytic estimate of the train step's peak memory per device (no compilation).

    The peak is the largest of these moments (and, for unscanned `full`, one a stack, below),
    each a sum of buffers live at once:
      backward: state + batch + gradients (whole over the batch axes until reduced, all layers:
        the scan carries them) + saved activations (all layers, under the remat policy) + the
        larger of the loss's temporaries ([B, L, V] fp32 logits and probabilities) and one
        layer's backward working set (its activations, recomputed under remat, and their
        cotangents);
      update: state + batch + gradients + the optimizer's parameter-sized update (the reduced
        gradients); unscanned, + the token embedding's scatter zeros and, per extra lookup of
        a shared table (T5), one more unreduced and reduced table gradient.
    `activations` is what the backward moment adds (0 when the update is the peak), `update`
    likewise; `terms` lists every modelled group and `activation_kinds` splits `activations`
    by kind of layer (attention, MLP, norms and residual sums, logits and loss, and, at an
    unscanned FSDP layout's inside-backward moment, the layers' gathered weights; they add up
    to it). State and batch are exact (shardings); every activation is sized by resolving its
    logical axes with the rules table, so any preset (sequence or context parallelism
    included) is sized by what it shards.

    Accuracy is measured against XLA:CPU's compiled figure by tests/test_insight_accuracy.py
    and benchmarks/memory_accuracy.py (every preset x remat policy, both families, layers
    scanned or unrolled); docs/performance.md has the figures and the layouts known to miss.
    Unscanned `full` has more moments, inside each stack's backward (that stack's every layer
    recomputed, the first one differentiated, the loss's buffers gone); at the loss gradient
    it counts the recomputation XLA:CPU hoists ahead of it, by layout (_unscanned_backward).
    """

    state: int
    batch: int
    gradients: int
    update: int
    activations: int
    terms: tuple[tuple[str, int], ...] = ()  # every modelled buffer group, for reports
    activation_kinds: tuple[tuple[str, int], ...] = ()  # `activations` by kind (KINDS)

    @property
    def total(self) -> int:
        return self.state + self.batch + self.gradients + self.update + self.activations


def predict_memory(trainer: Trainer, platform: str | None = None) -> PredictedMemory:
    """Peak memory per device of `trainer.train_step`, from shapes and shardings alone.

    `platform` ("cpu", "tpu", "gpu"; default: that of the trainer's mesh) is the backend whose
    compiler is modelled: XLA:CPU stores a bf16 policy's activations in fp32
    (`activation_itemsize`).
    """
    part = trainer.partitioner
    cfg = trainer.model.network_config
    act = activation_itemsize(cfg, platform or _platform(trainer))
    compute = np.dtype(cfg.policy.compute).itemsize
    b = trainer.batch_size // trainer.num_microbatches
    lt = trainer.lengths["targets"]
    if hasattr(cfg, "num_encoder_layers"):
        li = trainer.lengths["inputs"]
        stacks = [(cfg.num_encoder_layers, li, [li]), (cfg.num_decoder_layers, lt, [lt, li])]
    else:
        lt += trainer.lengths.get("inputs", 0)  # a prefix-LM's row
        stacks = [(cfg.num_layers, lt, [lt])]
    layers = [(n, _layer_bytes(part, cfg, b, q, kv, act)) for n, q, kv in stacks]
    logits = _bytes_per_device(part, ("batch", "length", "vocab"), (b, lt, cfg.vocab_size), 4)
    if cfg.scan_layers:
        backward, terms = _scanned_backward(layers, cfg.remat_policy, logits)
    else:
        gathered = _gathered_layer_bytes(trainer)
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
        unsplit = _bytes_per_device(part, ("batch", None, None), (b, lt, cfg.vocab_size), 4)
        replicated = _tree_bytes_per_device(params) == whole and logits == unsplit
        loss_buffers = _UNSCANNED_LOSS_BUFFERS - replicated
        backward, terms = _unscanned_backward(layers, remat, logits, gathered, loss_buffers)
    state = _tree_bytes_per_device(trainer.abstract_state())
    batch = _tree_bytes_per_device(
        jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            trainer.batch_abstract,
            trainer.batch_shardings,
        )
    )
    # XLA:CPU computes a bf16 master's gradient and its update in fp32 too
    # (activation_itemsize's upcast) and holds them so until the new state is written.
    upcast = act if act > compute else 0
    grads = _unreduced_gradient_bytes(trainer, upcast)
    # The gradient reduction and the update: beside the gradients, their reduced copies (the
    # optimizer's parameter-sized update).
    update = _tree_bytes_per_device(trainer.abstract_state().params, upcast)
    if not cfg.scan_layers:
        # Unscanned, each lookup of the token embedding keeps its own scatter-add gradient up
        # to the reduction (an encoder-decoder's shared table is looked up by both stacks, and
        # each lookup's gradient is reduced as its own operand of the combined all-reduce
        # before they are summed), beside the scatter's zero-initialised table (XLA:CPU's
        # buffer assignment, T5 on data parallel). The scanned program sums them first.
        table = _embedding_gradient_bytes(trainer, upcast)
        lookups = 2 if hasattr(cfg, "num_encoder_layers") else 1
        update += (lookups - 1) * (table[0] + table[1]) + table[0]
    terms = (*terms, ("optimizer update", update))
    total = sum(backward.values())
    if total >= update:
        kinds = tuple(backward.items())
        return PredictedMemory(state, batch, grads, 0, total, terms, kinds)
    return PredictedMemory(state, batch, grads, update, 0, terms)


def _scanned_backward(layers: list, remat: str, logits: int):
    """The backward moment's activations by kind, and its terms, for scanned layers."""
    saved = _add(*(_saved(a, remat) for n, a in layers for _ in range(n)))
    # One layer's backward, all of it. Under remat it recomputes the layer's matmuls, whose
    # inputs are gathered over the axes that split activations (2D activations, sequence
    # parallelism), so its [B, L, D] buffers are counted at their gathered size.
    # Sequence parallelism's blocks differentiate their gathered inputs whatever the policy
    # (the cotangent is whole until the reduce-scatter); context parallelism's attention holds
    # the gathered keys and values and their whole cotangents.
    gathered = remat != "none" or any(a["sp_gathered"] for _, a in layers)
    works = [
        _saved(
            {**a, "x": a["x_gathered" if gathered else "x"], "kv_gathered": 2 * a["kv_gathered"]},
            "none",
            _SCORES_WORKING,
        )
        for _, a in layers
    ]
    work = max(works, key=lambda w: sum(w.values()))
    loss = {"logits+loss": _LOSS_BUFFERS * logits}
    # Under remat the compiler recomputes the last layer's forward (half its working set: the
    # values, not yet their cotangents) while the loss's [B, L, V] buffers are still live.
    with_loss = _add(loss, _add(work, scale=0.5 if gathered else 0))
    peak = with_loss if sum(with_loss.values()) > sum(work.values()) else work
    terms = (
        ("saved activations", sum(saved.values())),
        ("layer working set", sum(work.values())),
        ("loss temporaries", loss["logits+loss"]),
    )
    return _add(saved, peak), terms


def _unscanned_backward(
    layers: list,
    remat: str,
    logits: int,
    gathered: int = 0,
    loss_buffers: int = _UNSCANNED_LOSS_BUFFERS,
):
    """The backward moment's activations by kind, and its terms, for unscanned layers: the
    larger of the loss gradient (every layer's saved values, the last layer's working set and
    the loss's buffers) and, under `full`, each stack's backward (that stack's every layer
    recomputed, the earlier stacks' held values, no loss buffers left)."""
    first = layers[-1][1]  # the first layer differentiated: the last stack's last

    # Where the `full` recomputation goes, read from XLA:CPU's buffer assignment: all of it
    # ahead of the loss gradient on data parallel, FSDP, sequence and context parallel; the
    # attention's on megatron (an encoder's right after its forward, a decoder's self-attention
    # ahead of the loss; the MLP waits behind the out projection's all-reduce); none on the 2D
    # layouts (embed split), whose layers are recomputed after the loss gradient, a stack's
    # all ahead of its first layer's backward. Of an encoder-decoder's encoder under FSDP (its
    # recomputation gathers the weights again), only the attention's. Sequence parallel,
    # without the gathers, hoists all of it (T5 `full` compiles to `minimal`'s figure).
    def hoisted(a: dict[str, int], stack: int) -> str:
        if a["embed_split"]:
            return "none"
        encoder = stack < len(layers) - 1
        return "attention" if a["heads_split"] or (encoder and gathered) else "all"

    # `minimal` on megatron (heads split, `embed` whole) and on the fully sharded layouts
    # (`embed` split, weights gathered over the batch axes): every layer's attention logits and
    # probabilities are recomputed ahead of the loss gradient and held there (XLA:CPU's buffer
    # assignment); not on 2D activations or FSDP, whose scheduler leaves them to each
    # layer's backward.
    def scores_held(a: dict[str, int]) -> bool:
        split = (a["heads_split"] and not a["embed_split"]) or (a["embed_split"] and gathered)
        return remat == "minimal" and bool(split)

    # `minimal` on 2D activations (`embed` split, weights not gathered), a gated GELU's layer
    # holds four [B, L, F] buffers (the two saved pre-activations, the recomputed tanh and
    # product) and no stack holds the per-stack GELU buffers (XLA:CPU's buffer assignment).
    def gelu_2d(a: dict[str, int]) -> bool:
        return remat == "minimal" and bool(a["embed_split"] and a["gelu"]) and not gathered

    def held_by(a: dict[str, int], stack: int) -> dict[str, int]:
        hidden = 4 if gelu_2d(a) else _UNSCANNED_HIDDEN
        return _saved_unscanned(a, remat, hoisted(a, stack), scores_held(a), hidden)

    held = [[held_by(a, i)] * n for i, (n, a) in enumerate(layers)]
    saved = _add(*(v for stack in held for v in stack))
    # NOTE: sequence parallelism counts its layers' gathered block inputs instead of the GELU
    # buffers (_saved_unscanned): T5's `full` compiles to `minimal`'s figure.
    sp = any(a["sp_gathered"] for _, a in layers)
    gelu = sum(_UNSCANNED_GELU_HIDDEN * a["gelu"] * a["h"] for _, a in layers if not gelu_2d(a))
    last = {"norms+residual": _UNSCANNED_LAST_X * first["x"], "mlp": 0 if sp else gelu}
    loss = {"logits+loss": loss_buffers * logits}
    at_loss = _add(saved, last, loss)

    def inside(s: int) -> tuple[dict[str, int], dict[str, int]]:
        """Stack `s`'s backward (stacks are differentiated last to first): the earlier stacks
        hold what they held at the loss gradient, the later ones are done."""
        n, a = layers[s]
        work = _add(_recomputed(a), scale=_RECOMPUTED_WORKING)
        earlier = (v for stack in held[:s] for v in stack)
        # A stack recomputed ahead of the loss gradient holds what it held there.
        own = held[s][0] if hoisted(a, s) == "all" else _recomputed(a)
        return _add(*earlier, *[own] * n, work), work

    moments = [inside(s) for s in range(len(layers))]
    if any(hoisted(a, i) == "none" for i, (_, a) in enumerate(layers)):
        # Recomputed after the loss gradient with nothing to order it (the 2D layouts), an
        # earlier stack's recomputation starts while the later one's backward still runs:
        # every layer of every stack recomputed, beside the first layer's working set.
        work = _add(_recomputed(first), scale=_RECOMPUTED_WORKING)
        everything = (_recomputed(a) for n, a in layers for _ in range(n))
        moments.append((_add(*everything, work), work))
    moment, work = max(moments, key=lambda m: sum(m[0].values()))
    if gathered:
        # FSDP: each layer's recomputation gathers its weights again (over the batch axes),
        # and every layer's gathered copy stays live until its backward.
        moment["gathered weights"] = gathered
    if remat == "full" and sum(moment.values()) > sum(at_loss.values()):
        terms = (
            ("saved activations", sum(moment.values()) - sum(work.values()) - gathered),
            ("layer working set", sum(work.values())),
            ("loss temporaries", 0),
            ("gathered weights", gathered),
        )
        return moment, terms
    terms = (
        ("saved activations", sum(saved.values())),
        ("layer working set", sum(last.values())),
        ("loss temporaries", loss["logits+loss"]),
    )
    return at_loss, terms


def _gathered_layer_bytes(trainer: Trainer) -> int:
    """Bytes per device of every layer's weights gathered over the batch's mesh axes (FSDP),
    0 where no layer weight is split over them."""
    part = trainer.partitioner
    batch_axes = set(mesh_axes_of(part.data_partition_spec[0]))
    total = 0
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(trainer.state_abstract.params),
        jax.tree_util.tree_leaves(trainer.state_shardings.params),
    ):
        axes = [t for e in s.spec for t in mesh_axes_of(e)]
        if "layers_" not in jax.tree_util.keystr(path) or not batch_axes & set(axes):
            continue
        split = math.prod(part.mesh.shape[t] for t in axes if t not in batch_axes)
        total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // split
    return total


def _embedding_gradient_bytes(trainer: Trainer, min_itemsize: int = 0) -> tuple[int, int]:
    """(unreduced, reduced) bytes per device of the token embedding's gradient."""
    part = trainer.partitioner
    batch_axes = set(mesh_axes_of(part.data_partition_spec[0]))
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(trainer.state_abstract.params),
        jax.tree_util.tree_leaves(trainer.state_shardings.params),
    ):
        if "token_embedder" in jax.tree_util.keystr(path):
            whole = math.prod(x.shape) * max(np.dtype(x.dtype).itemsize, min_itemsize)
            axes = [t for e in s.spec for t in mesh_axes_of(e)]
            unreduced = math.prod(part.mesh.shape[t] for t in axes if t not in batch_axes)
            reduced = math.prod(part.mesh.shape[t] for t in axes)
            return whole // unreduced, whole // reduced
    return 0, 0


def _unreduced_gradient_bytes(trainer: Trainer, min_itemsize: int = 0) -> int:
    """Gradient bytes per device before the reduction over the batch's mesh axes, each
    element at least `min_itemsize` bytes (XLA:CPU differentiates bf16 masters in fp32)."""
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
        total += math.prod(x.shape) * max(np.dtype(x.dtype).itemsize, min_itemsize) // split
    return total


# --- the models the accuracy is stated on ----------------------------------------------------

ACCURACY_FAMILIES = ("t5", "lm")


def accuracy_trainer(
    family: str,
    preset: str,
    remat: str,
    scan: bool = True,
    batch_size: int = 16,
    layers: int = 2,
    precision: str = "float32",
) -> Trainer:
    """A trainer of the small-but-not-tiny models `PredictedMemory`'s accuracy is measured on
    (tests/test_insight_accuracy.py, benchmarks/memory_accuracy.py): shapes dominate XLA's
    fixed overheads, `layers` a stack (two by default); `family` is "t5" (T5.1.1-like
    encoder-decoder) or "lm" (decoder-only), on data=2 x model=4 (data=8 for a preset without
    model parallelism), under the mixed-precision `precision` policy (precision.py).
    """
    # Imported here: the models are only needed by whoever measures accuracy.
    from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
    from t5lite.model.network import DecoderOnlyConfig, T5Config
    from t5lite.partitioning import PRESETS, create_mesh, preset_rules

    if family == "t5":
        cfg = T5Config(
            vocab_size=8192,
            emb_dim=256,
            num_heads=4,
            head_dim=64,
            mlp_dim=1024,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            remat_policy=remat,
            scan_layers=scan,
            precision=precision,
        )
        model, lengths = EncoderDecoderModel(network_config=cfg), {"inputs": 128, "targets": 64}
    elif family == "lm":
        cfg = DecoderOnlyConfig(
            vocab_size=8192,
            emb_dim=256,
            num_heads=4,
            head_dim=64,
            mlp_dim=768,
            num_layers=layers,
            remat_policy=remat,
            scan_layers=scan,
            precision=precision,
        )
        model, lengths = DecoderOnlyModel(network_config=cfg), {"targets": 128}
    else:
        raise ValueError(f"family {family!r}: one of {ACCURACY_FAMILIES}")
    model_parallel = 1 if PRESETS[preset] is None else 4
    part = Partitioner(create_mesh(model_parallel), logical_axis_rules=preset_rules(preset))
    return Trainer(model, part, batch_size=batch_size, lengths=lengths)


def rule_of(partitioner: Partitioner, name: str) -> Any:
    for n, axis in partitioner.rules:
        if n == name:
            return axis
    return None
