"""Loss functions.

`cross_entropy_with_logits` works on vocab-sharded logits without gathering them (Megatron's fused
vocab-parallel cross-entropy): every step is either elementwise over [B, L, V] or a reduction over
V, so GSPMD turns the reductions into all-reduces of [B, L] and never all-gathers [B, L, V].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from t5lite import constraints

Array = jax.Array


def cross_entropy_with_logits(
    logits: Array, targets: Array, z_loss: float = 0.0
) -> tuple[Array, Array]:
    """Per-token softmax cross-entropy with an optional z-loss, in fp32.

    Args:
      logits: [B, L, V] unnormalized scores (any float dtype; computed in fp32). May be sharded
        over V.
      targets: [B, L] int target ids.
      z_loss: coefficient of the auxiliary `z_loss * logsumexp(logits)**2` term (PaLM / t5x),
        which keeps the softmax normalizer near 1.

    Returns:
      (loss, z_loss_term), both [B, L] fp32; `loss` already includes `z_loss_term`.
      Padding is not masked here: weight the result by `targets > 0` (or loss weights).
    """
    logits_BLV = logits.astype(jnp.float32)
    vocab = logits_BLV.shape[-1]
    # Max over V: one all-reduce(max) of [B, L] when V is sharded. No gradient flows through it
    # (the logsumexp is invariant to the shift).
    max_BL1 = jax.lax.stop_gradient(jnp.max(logits_BLV, axis=-1, keepdims=True))
    shifted_BLV = logits_BLV - max_BL1
    log_z_BL = jnp.log(jnp.sum(jnp.exp(shifted_BLV), axis=-1)) + max_BL1[..., 0]
    # NOTE: the target logit is picked with a one-hot product and a sum over V rather than
    # take_along_axis: a gather across a sharded V would make GSPMD all-gather the logits.
    one_hot_BLV = jax.nn.one_hot(targets, vocab, dtype=jnp.float32)
    target_logit_BL = jnp.sum(logits_BLV * one_hot_BLV, axis=-1)
    loss_BL = log_z_BL - target_logit_BL
    z_loss_BL = z_loss * jnp.square(log_z_BL)
    return loss_BL + z_loss_BL, z_loss_BL


# --- weighted sequence losses (label smoothing, normalisation) ------------------------------

LOSS_NORMALIZATIONS = ("sum", "per_real_token", "per_total_token", "per_sequence")
# t5x's `SpecialLossNormalizingFactor` names, accepted as synonyms.
T5X_NORMALIZATIONS = {
    "NUM_REAL_TARGET_TOKENS": "per_real_token",
    "NUM_TOTAL_TARGET_TOKENS": "per_total_token",
    "AVERAGE_PER_SEQUENCE": "per_sequence",
}
Normalization = str | float


def canonical_normalization(normalization: Normalization | None) -> Normalization:
    """A loss normalisation in canonical form: one of `LOSS_NORMALIZATIONS` or a constant > 0.

    Accepts t5x's spellings too: `None` (t5x's `loss_normalizing_factor=None`, i.e. "sum"), the
    `SpecialLossNormalizingFactor` names (or the enum itself), and a number (t5x's constant
    factor, e.g. 233472 = 2048 x 114 for fine-tuning the T5.1.1 checkpoints).
    """
    if normalization is None:
        return "sum"
    name = getattr(normalization, "name", normalization)  # a t5x enum member
    if isinstance(name, str):
        name = T5X_NORMALIZATIONS.get(name, name)
        if name in LOSS_NORMALIZATIONS:
            return name
    elif isinstance(name, int | float) and not isinstance(name, bool) and name > 0:
        return float(name)
    raise ValueError(
        f"loss normalization must be one of {LOSS_NORMALIZATIONS}, a t5x name "
        f"{sorted(T5X_NORMALIZATIONS)} or a positive constant, got {normalization!r}"
    )


def weighted_cross_entropy(
    logits: Array,
    targets: Array,
    weights: Array | None = None,
    **kwargs: Any,
) -> tuple[Array, dict[str, Array]]:
    """`cross_entropy_terms` normalised: (numerator / loss_denominator, metrics)."""
    numerator, metrics = cross_entropy_terms(logits, targets, weights, **kwargs)
    return numerator / jnp.maximum(metrics["loss_denominator"], 1.0), metrics


def cross_entropy_terms(
    logits: Array,
    targets: Array,
    weights: Array | None = None,
    *,
    z_loss: float = 1e-4,
    label_smoothing: float = 0.0,
    normalization: Normalization | None = "per_real_token",
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The training loss of a batch as numerator / denominator, plus summable metrics.

    Args:
      logits: [B, L, V] (may be vocab-sharded; never gathered).
      targets: [B, L] int ids.
      weights: [B, L] loss weights (default: `targets > 0`).
      z_loss: coefficient of `logsumexp(logits)**2` (1e-4 as in T5.1.1).
      label_smoothing: mass spread uniformly over the other V-1 ids; the constant entropy of the
        smoothed distribution is subtracted so a perfect model still scores 0 (as t5x does).
      normalization: "sum" (t5x's default, no normalising factor), "per_real_token" (divide by
        the number of weighted target tokens), "per_total_token" (divide by every target
        position, padding included: B * L), "per_sequence" (mean over examples of each
        example's mean token loss; packed examples are told apart by `segment_ids`), or a
        constant (t5x's numeric `loss_normalizing_factor`: the weighted sum divided by it). See
        `canonical_normalization` for t5x's spellings.
      segment_ids: [B, L] packing ids, used by "per_sequence".

    Returns:
      (numerator, metrics): the loss is `numerator / metrics["loss_denominator"]`. The trainer
      sums both over microbatches, so gradient accumulation reproduces the big-batch gradient
      exactly for every normalisation. Metrics are sums over the batch: `loss_sum`, `z_loss_sum`,
      `weight_sum`, `correct_sum` (argmax hits), `num_sequences`, `loss_denominator` (loss =
      numerator / loss_denominator).
    """
    normalization = canonical_normalization(normalization)
    weights_BL = (
        (targets > 0).astype(jnp.float32) if weights is None else weights.astype(jnp.float32)
    )
    loss_BL, z_BL = cross_entropy_with_logits(logits, targets, z_loss)
    if label_smoothing:
        # -sum_v soft_v log p_v = log_z - (confidence - low) * logit_t - low * sum_v logit_v:
        # only reductions over V, so vocab-sharded logits stay sharded.
        vocab = logits.shape[-1]
        confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
        logits_BLV = logits.astype(jnp.float32)
        log_z_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
        target_logit_BL = log_z_BL - (loss_BL - z_BL)
        smooth_BL = (
            log_z_BL - (confidence - low) * target_logit_BL - low * jnp.sum(logits_BLV, axis=-1)
        )
        entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
        loss_BL = smooth_BL - entropy + z_BL
    weighted_BL = loss_BL * weights_BL
    correct_BL = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weights_BL
    b, length = targets.shape
    if segment_ids is None:
        seq_ids_BL = jnp.broadcast_to(jnp.arange(b)[:, None] * length + 1, (b, length))
        seq_ids_BL = jnp.where(weights_BL > 0, seq_ids_BL, 0)
    else:
        seq_ids_BL = jnp.where(segment_ids > 0, jnp.arange(b)[:, None] * length + segment_ids, 0)
    flat_ids = seq_ids_BL.reshape(-1)
    # A scatter from batch-sharded ids has no inferable output sharding on Explicit axes:
    # there the [B * L] ids and weights are gathered first (no-ops on Auto axes).
    tokens_per_seq = jax.ops.segment_sum(
        constraints.whole(weights_BL.reshape(-1)), constraints.whole(flat_ids), b * length + 1
    )
    num_sequences = jnp.sum(tokens_per_seq[1:] > 0).astype(jnp.float32)
    weight_sum = jnp.sum(weights_BL)
    if normalization == "sum" or isinstance(normalization, float):
        # A denominator of 0 stays 0 when summed over microbatches; the divisor is max(den, 1).
        # A constant divides each microbatch's numerator, so the sum over microbatches is the
        # big batch's sum / constant, as in t5x.
        scale = 1.0 if normalization == "sum" else 1.0 / normalization
        numerator, denominator = jnp.sum(weighted_BL) * scale, jnp.zeros([], jnp.float32)
    elif normalization == "per_real_token":
        numerator, denominator = jnp.sum(weighted_BL), weight_sum
    elif normalization == "per_total_token":
        numerator, denominator = jnp.sum(weighted_BL), jnp.asarray(b * length, jnp.float32)
    else:
        per_token = weighted_BL.reshape(-1) / jnp.maximum(tokens_per_seq[flat_ids], 1.0)
        numerator = jnp.sum(jnp.where(flat_ids > 0, per_token, 0.0))
        denominator = num_sequences
    metrics = {
        "loss_sum": jnp.sum(weighted_BL),
        "z_loss_sum": jnp.sum(z_BL * weights_BL),
        "weight_sum": weight_sum,
        "correct_sum": jnp.sum(correct_BL),
        "num_sequences": num_sequences,
        "loss_denominator": denominator,
    }
    return numerator, metrics
