"""The activations a train step holds at its backward's peak, by kind: what each layer keeps for
its backward under a remat policy and where the backward's peak falls, scanned or unscanned
(`memory.predict_memory` sums them with the state, batch, gradients and update)."""

from __future__ import annotations

# Buffers of each shape that the CPU compiler keeps per layer without remat, read from XLA's
# buffer assignment (`--xla_dump_to`) on the scanned models of tests/test_insight_accuracy.py
# and checked on longer sequences (docs/performance.md has the figures). Per block: the input,
# the norm's output, the block's output before its reduction and the residual sum; per
# attention, q and the context; keys and values once; the MLP's pre-activations, activation,
# gated product and their cotangents. The [B, H, L, L] fp32 attention scores: every layer
# keeps two (logits, probabilities); the layer being differentiated three more (their
# cotangents and the softmax's temporaries).
_X_PER_BLOCK, _Q_PER_ATTENTION, _KV, _HIDDEN = 4, 2, 1, 9
_SCORES_SAVED, SCORES_WORKING = 2, 3
# Ring attention (model/ring_attention.py) saves no scores for its backward (its custom_vjp
# keeps the softmax statistics and recomputes each block), but XLA:CPU keeps one
# [B, H, L/n, S/n] block a layer beside its residuals: fitted on the compiled totals of the
# decoder-only model at 512 and 1024 positions (docs/ring-attention.md).
RING_BLOCKS_SAVED = 1
# The loss: logits and softmax probabilities (their cotangent reuses the logits' buffer).
LOSS_BUFFERS = 2
# Unscanned layers (`scan_layers=False`): no loop carries stacked copies of each layer's
# values, so a layer keeps fewer [B, L, D] and [B, L, F] buffers (3 a block, 5 of the MLP's);
# and the backward's peak is at the loss gradient, with the logits, their softmax and
# cotangent and three [B, L, D] buffers of the last layer live beside every layer's saved
# values. Fitted on the CPU compiler's totals over FSDP configurations of both families
# (2 to 4 layers, several widths and lengths). Remat: under FSDP the scheduler hoists every
# layer's recomputation ahead of the loss gradient (no loop orders it), so the recomputed
# values are live together, the [B, H, L, S] logits and probabilities too, and the only
# saving is one [B, L, F] buffer a layer (_HOISTED_SAVING): `full` compiles to about
# `none`'s memory (decoder-only, 128 to 8192 positions, 2 and 4 layers, data parallel, FSDP
# and context parallel); other layouts hoist less (unscanned_backward).
_UNSCANNED_X_PER_BLOCK, _UNSCANNED_HIDDEN, UNSCANNED_LOSS_BUFFERS, _UNSCANNED_LAST_X = 3, 5, 3, 3
_HOISTED_SAVING = 1
# Context parallelism (keys and values gathered, queries split by position): every layer
# also holds a transposed copy of its probabilities ([B, H, S, L/n], for the values'
# gradient, which contracts the split positions), whatever the policy (XLA:CPU's buffer
# assignment, decoder-only at 4096 positions; fitted on the totals from 1024 to 8192).
_CP_SCORES_HELD = 1
# T5.1.1's gated GELU (tanh form): six [B, L, F] buffers of a layer of each stack at the loss
# gradient, whatever the depth and the remat policy (between 2 and 4 layers a stack, the
# part of XLA's figure that does not grow with depth is the same under every policy).
_UNSCANNED_GELU_HIDDEN = 6

# Kinds of activation a report breaks the total into (they add up to `activations`).
KINDS = ("attention", "mlp", "norms+residual", "logits+loss")


def layer_saved(a: dict[str, int], remat: str, scores: int | None = None) -> dict[str, int]:
    """What one layer keeps for its backward pass under a remat policy, by kind (`scores`: how
    many [B, H, L, L] buffers without remat; default: those every layer keeps)."""
    n = a["attentions"]
    if remat == "full":
        return {"norms+residual": a["x"]}  # the layer input; everything else is recomputed
    if remat == "minimal":  # outputs of dots without batch dims (projections) + the input
        return {
            "attention": n * (a["q"] + a["x"]) + a["kv"],  # q, k, v and the out projection
            # A mixture of experts saves none of its MLP: its expert matmuls (batched over
            # experts or groups, or ragged dots) are not dots without batch dims.
            "mlp": 0 if a["moe"] else a["mlp_in"] * a["h"],
            "norms+residual": 2 * a["x"],
        }
    if scores is None:
        scores = _SCORES_SAVED if a.get("scores_saved") is None else a["scores_saved"]
    return {
        "attention": _Q_PER_ATTENTION * n * a["q"]
        + _KV * a["kv"]
        + a["kv_gathered"]
        + a.get("ring_saved", 0)
        + scores * a["scores"],
        "mlp": a["moe"] or _HIDDEN * a["h"],
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
    of the loss gradient: "all", "attention" or "none" (unscanned_backward says where);
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
    # Unscanned, a ring layer holds two of its blocks (logits and probabilities) at the loss
    # gradient whatever the policy: its recomputation is hoisted ahead of it (fitted on the
    # decoder-only model at 1024 and 8192 positions). So does a layer whose whole `full`
    # recomputation is hoisted, less one [B, L, F] buffer.
    ring = a.get("scores_saved") is not None
    hoisted_full = remat == "full" and hoisted == "all"
    held = remat == "none" or scores_held or ring or hoisted_full
    scores = _SCORES_SAVED * a["scores"] if held else 0
    if remat in ("none", "full") and a["kv_gathered"] and not ring:
        scores += _CP_SCORES_HELD * a["scores"]
    hidden -= _HOISTED_SAVING if hoisted_full else 0
    # Sequence parallelism gathers each block's input (collectives.sequence_parallel_gather),
    # and those whole-length copies are live with the rest at the loss gradient whatever the
    # policy.
    gathered = a["sp_gathered"]
    # A stack's mixtures of experts (every `moe_every`-th layer) hold their saved values in
    # place of the dense MLP's: per layer, the stack's mean.
    share = a.get("moe_share", 0)
    held = a["moe_held"] if remat == "none" else a.get("moe_held_remat", a["moe_held"])
    mlp = share * held + (1 - share) * hidden * a["h"]
    return {
        "attention": _Q_PER_ATTENTION * n * a["q"]
        + _KV * a["kv"]
        + a.get("ring_saved", 0)
        + scores,
        "mlp": int(mlp),
        "norms+residual": _UNSCANNED_X_PER_BLOCK * (n + 1) * a["x"] + gathered,
    }


def _recomputed(a: dict[str, int]) -> dict[str, int]:
    """One unscanned layer's `full` recomputation as it stands before its backward, by kind
    (XLA:CPU's buffer assignment): each block's gathered matmul input, the input and its
    norm's output, q (per attention), k and v, the logits and probabilities, the MLP's two
    pre-activations and their product (a mixture of experts': its experts' [E, G, C, F]
    ones). On megatron (heads split, `embed` whole) the
    attention's recomputation runs apart from the MLP's, and nothing is fused across blocks:
    each block's norm output is kept in both its layouts ([B, L, D] and the matmul's
    [B * L, D]), the residual sums and each attention's context are buffers of their own, and
    so is the GELU's tanh."""
    n = a["attentions"]
    if a["heads_split"] and not a["embed_split"]:
        return {
            "attention": 2 * n * a["q"] + a["kv"] + 2 * a["scores"],
            "mlp": a.get("moe_recomputed") or (3 + a["gelu"]) * (a["moe_h"] or a["h"]),
            "norms+residual": 2 * (n + 1) * a["x"] + (n + 1) * a["x"],
        }
    return {
        "attention": n * a["q"] + a["kv"] + 2 * a["scores"],
        "mlp": a.get("moe_recomputed") or 3 * (a["moe_h"] or a["h"]),
        "norms+residual": (n + 1) * a["x_gathered"] + 2 * a["x"],
    }


def _full_work(a: dict[str, int], hoisted: bool) -> dict[str, int]:
    """The working set of an unscanned `full` layer's backward beside its recomputed values."""
    # A hoisted layer's logits and probabilities are already among what it holds (and
    # their cotangents take the loss buffers' place).
    work = _add(_recomputed({**a, "scores": 0} if hoisted else a), scale=_RECOMPUTED_WORKING)
    if a.get("moe_extra"):
        # CPU dropless: the peak is in the MLP's backward, among its masked operands; it runs
        # before the layer's attention's, so none of the attention's cotangents are live yet
        # (XLA:CPU's live ranges, decoder-only megatron every other layer).
        return {"mlp": work["mlp"] + a["moe_extra"]}
    return work


def _recomputed_mean(a: dict[str, int]) -> dict[str, int]:
    """`_recomputed` of a stack's mean layer: with mixtures of experts every `moe_every`-th
    layer, the share of its sparse layers' MLP and the rest's dense one."""
    share = a.get("moe_share", 0)
    if share in (0, 1):
        return _recomputed(a)
    dense = _recomputed({**a, "moe_recomputed": 0, "moe_h": 0})
    return _add(_add(_recomputed(a), scale=share), _add(dense, scale=1 - share))


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


# Where the `full` recomputation goes, read from XLA:CPU's buffer assignment: all of it
# ahead of the loss gradient on data parallel, FSDP, sequence and context parallel; the
# attention's on megatron (an encoder's right after its forward, a decoder's self-attention
# ahead of the loss; the MLP waits behind the out projection's all-reduce); none on the 2D
# layouts (embed split), whose layers are recomputed after the loss gradient, a stack's
# all ahead of its first layer's backward. Of an encoder-decoder's encoder under FSDP (its
# recomputation gathers the weights again), only the attention's. Sequence parallel,
# without the gathers, hoists all of it (T5 `full` compiles to `minimal`'s figure).
def _hoisted(a: dict[str, int], stack: int, layers: list, gathered: int) -> str:
    if a["embed_split"]:
        return "none"
    encoder = stack < len(layers) - 1
    return "attention" if a["heads_split"] or (encoder and gathered) else "all"


# `minimal` on megatron (heads split, `embed` whole) and on the fully sharded layouts
# (`embed` split, weights gathered over the batch axes): every layer's attention logits and
# probabilities are recomputed ahead of the loss gradient and held there (XLA:CPU's buffer
# assignment); not on 2D activations or FSDP, whose scheduler leaves them to each
# layer's backward.
def _scores_held(a: dict[str, int], remat: str, gathered: int) -> bool:
    split = (a["heads_split"] and not a["embed_split"]) or (a["embed_split"] and gathered)
    return remat == "minimal" and bool(split)


# `minimal` on 2D activations (`embed` split, weights not gathered), a gated GELU's layer
# holds four [B, L, F] buffers (the two saved pre-activations, the recomputed tanh and
# product) and no stack holds the per-stack GELU buffers (XLA:CPU's buffer assignment).
def _gelu_2d(a: dict[str, int], remat: str, gathered: int) -> bool:
    return remat == "minimal" and bool(a["embed_split"] and a["gelu"]) and not gathered


def scanned_backward(layers: list, remat: str, logits: int):
    """The backward moment's activations by kind, and its terms, for scanned layers."""
    saved = _add(*(layer_saved(a, remat) for n, a in layers for _ in range(n)))
    # One layer's backward, all of it. Under remat it recomputes the layer's matmuls, whose
    # inputs are gathered over the axes that split activations (2D activations, sequence
    # parallelism), so its [B, L, D] buffers are counted at their gathered size.
    # Sequence parallelism's blocks differentiate their gathered inputs whatever the policy
    # (the cotangent is whole until the reduce-scatter); context parallelism's attention holds
    # the gathered keys and values and their whole cotangents.
    gathered = remat != "none" or any(a["sp_gathered"] for _, a in layers)
    works = [
        layer_saved(
            {
                **a,
                "x": a["x_gathered" if gathered else "x"],
                "kv_gathered": 2 * a["kv_gathered"],
                # the ring's chunks and gradients in hand and in flight
                "ring_saved": a.get("ring_saved", 0) + a.get("ring_flight", 0),
                # a mixture of experts' backward: its own count (moe_memory.moe_bytes)
                "moe": a["moe_rework" if gathered else "moe_work"],
            },
            "none",
            SCORES_WORKING,
        )
        for _, a in layers
    ]
    work = max(works, key=lambda w: sum(w.values()))
    loss = {"logits+loss": LOSS_BUFFERS * logits}
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


def _compiled_policy(layers: list, remat: str) -> str:
    """The policy whose program XLA:CPU compiles: where every layer is a CPU dropless MoE
    whose recomputation is hoisted ahead of the loss gradient (moe_held_last), `minimal`
    saves none of its MLP and the attention's recomputation is hoisted under both, so
    `full` compiles to `minimal`'s program (the same buffers, T5 and decoder-only
    megatron)."""
    if remat == "full" and all(a.get("moe_share") == 1 and "moe_held_last" in a for _, a in layers):
        return "minimal"
    return remat


def unscanned_backward(
    layers: list,
    remat: str,
    logits: int,
    gathered: int = 0,
    loss_buffers: int = UNSCANNED_LOSS_BUFFERS,
):
    """The backward moment's activations by kind, and its terms, for unscanned layers: the
    larger of the loss gradient (every layer's saved values, the last layer's working set and
    the loss's buffers) and, under `full`, each stack's backward (that stack's every layer
    recomputed, the earlier stacks' held values, no loss buffers left)."""
    first, remat = layers[-1][1], _compiled_policy(layers, remat)  # first differentiated

    def held_by(a: dict[str, int], stack: int) -> dict[str, int]:
        hidden = 4 if _gelu_2d(a, remat, gathered) else _UNSCANNED_HIDDEN
        hoist, held_scores = _hoisted(a, stack, layers, gathered), _scores_held(a, remat, gathered)
        out = _saved_unscanned(a, remat, hoist, held_scores, hidden)
        if remat == "full" and hoist == "attention" and stack < len(layers) - 1:
            # an encoder's MoE layers' recomputed MLP is hoisted with the attention's
            out["mlp"] = int(a.get("moe_share", 0) * a.get("moe_hoisted", 0))
        return out

    held = [[held_by(a, i)] * n for i, (n, a) in enumerate(layers)]
    # NOTE: sequence parallelism counts its layers' gathered block inputs instead of the GELU
    # buffers (_saved_unscanned): T5's `full` compiles to `minimal`'s figure.
    sp = any(a["sp_gathered"] for _, a in layers)
    # (a stack of mixtures of experts holds none: its GELU buffers are its experts' own)
    gelu = sum(
        int(_UNSCANNED_GELU_HIDDEN * a["gelu"] * a["h"] * (1 - a.get("moe_share", 0)))
        for _, a in layers
        if not _gelu_2d(a, remat, gathered)
    )
    last = {"norms+residual": _UNSCANNED_LAST_X * first["x"], "mlp": 0 if sp else gelu}
    loss = {"logits+loss": loss_buffers * logits}
    at_loss, loss = _moe_backward_extra(layers, remat, held, last, loss)

    def inside(s: int) -> tuple[dict[str, int], dict[str, int]]:
        """Stack `s`'s backward (stacks are differentiated last to first): the earlier stacks
        hold what they held at the loss gradient, the later ones are done."""
        n, a = layers[s]
        hoisted = _hoisted(a, s, layers, gathered) == "all"
        work = _full_work(a, hoisted)
        earlier = (v for stack in held[:s] for v in stack)
        # A stack recomputed ahead of the loss gradient holds what it held there.
        own = held[s][0] if hoisted else _recomputed_mean(a)
        return _add(*earlier, *[own] * n, work), work

    moments = [_pending(inside(s), layers, s) for s in range(len(layers))]
    if any(_hoisted(a, i, layers, gathered) == "none" for i, (_, a) in enumerate(layers)):
        # Recomputed after the loss gradient with nothing to order it (the 2D layouts), an
        # earlier stack's recomputation starts while the later one's backward still runs:
        # every layer of every stack recomputed, beside the first layer's working set.
        work = _add(_recomputed(first), scale=_RECOMPUTED_WORKING)
        everything = (_recomputed_mean(a) for n, a in layers for _ in range(n))
        moments.append(_pending((_add(*everything, work), work), layers, len(layers) - 1))
    moment, work = max(moments, key=lambda m: sum(m[0].values()))
    if gathered:
        # FSDP: each layer's recomputation gathers its weights again (over the batch axes),
        # and every layer's gathered copy stays live until its backward.
        moment["gathered weights"] = gathered
    if remat == "full" and sum(moment.values()) > sum(at_loss.values()):
        pending = moment.get(PENDING, 0)
        terms = (
            ("saved activations", sum(moment.values()) - pending - sum(work.values()) - gathered),
            ("layer working set", sum(work.values())),
            ("loss temporaries", 0),
            ("gathered weights", gathered),
            *(((PENDING, pending),) if pending else ()),
        )
        return moment, terms
    terms = (
        ("saved activations", sum(at_loss.values()) - sum(last.values()) - sum(loss.values())),
        ("layer working set", sum(last.values())),
        ("loss temporaries", loss["logits+loss"]),
    )
    return at_loss, terms


# The gradients of the expert kernels that the backward has not reached yet.
PENDING = "expert gradients not yet computed"


def _pending(moment: tuple[dict, dict], layers: list, s: int) -> tuple[dict, dict]:
    """`moment` (stack `s`'s backward, at its first layer) less the expert-kernel gradients of
    the MoE layers not yet differentiated (stack `s`'s others and every earlier stack's),
    under PENDING as a negative figure: XLA:CPU holds only the layer in hand's and the later
    stacks' there (predict_memory counts every gradient, and takes it off them)."""
    moe = sum(round(n * a.get("moe_share", 0)) for n, a in layers[: s + 1])
    pending = max(moe - 1, 0) * max((a.get("moe_grads", 0) for _, a in layers), default=0)
    return ({**moment[0], PENDING: -pending} if pending else moment[0]), moment[1]


def _moe_backward_extra(
    layers: list, remat: str, held: list, last: dict, loss: dict
) -> tuple[dict[str, int], dict[str, int]]:
    """The loss gradient's moment (`held`: what each stack's layers hold there) and the loss's
    buffers, once a mixture of experts' backward temporaries (which no dense layer has: CPU's
    masked ragged-dot operands, expert hidden layers resharded to the kernels' layout) are
    counted; adds them to `last` where they are live beside the loss's. Without remat
    XLA:CPU starts the last MoE layer's backward while the loss's buffers are live; under
    remat it first recomputes the layer, after them. CPU's dropless layers hold their forward
    masked operands at the loss gradient (moe_held), and their backward's own temporaries
    come after the loss's buffers whatever the policy: in the backward of a stack's last
    layer, where the later stacks' held values are freed (stacks are differentiated last to
    first)."""
    extras = [a.get("moe_extra", 0) for _, a in layers]
    after_loss = remat != "none" or any("moe_extra_none" in a for _, a in layers)
    if remat == "none":
        extras = [a.get("moe_extra_none", a.get("moe_extra", 0)) for _, a in layers]
    if not after_loss:
        last["mlp"] += max(extras)
    # Under remat, where XLA:CPU recomputes ahead of the loss gradient (moe_held_last), each
    # stack's last MoE layer holds its masked operands and recomputed hidden layer there.
    held_last = sum(a.get("moe_held_last", 0) for _, a in layers if a.get("moe_share"))
    held_last = held_last if remat != "none" else 0
    best = (_add(*(v for stack in held for v in stack), last, loss, {"mlp": held_last}), loss)
    for s, extra in enumerate(extras if after_loss else ()):
        if extra > loss["logits+loss"]:
            # (the recomputed values a MoE layer holds at the loss gradient under `minimal`
            # are gone by then)
            gone = (
                sum(
                    round(n * a.get("moe_share", 0)) * a.get("moe_hoisted_remat", 0)
                    for n, a in layers[: s + 1]
                )
                if remat == "minimal"
                else 0
            )
            inside = {"logits+loss": 0, "mlp": extra - gone}
            moment = _add(*(v for stack in held[: s + 1] for v in stack), last, inside)
            if sum(moment.values()) > sum(best[0].values()):
                best = (moment, inside)
    return best
